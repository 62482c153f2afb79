"""The planner under a preference objective: a row of whole pairs (the longest prompt beside two
completions, as train/pairs.py packs them), the per-token loss's bytes (measured against the
summed loss's), the reference pass's peak by hand and below the training step's in every layout,
and ``ringtrain plan --objective dpo``: the longest DPO pair of Llama-3-8B on 8 H100s."""

from __future__ import annotations

import argparse
import dataclasses
import json

import numpy as np
import pytest
import torch

from ringtrain.commands import plan as command
from ringtrain.config import REFERENCE_OBJECTIVES
from ringtrain.planner.devices import H100
from ringtrain.planner.layout import Layout, Workload
from ringtrain.planner.memory import activations, estimate, reference_activations
from ringtrain.planner.models import PRESETS, ModelSpec
from ringtrain.planner.preference import (
    FUSED_FALLBACK_CHUNK,
    SHARED,
    TOKEN_LOSS_BYTES,
    TWO_DOCUMENTS,
    PairFit,
    longest_prompt,
    row_tokens,
)
from ringtrain.planner.savers import loss_bytes
from ringtrain.planner.search import Cluster, layouts

# d = 64 / 4 = 16, KV width k d = 2 x 16 = 32 (tests/unit/test_planner.py's SMALL).
SMALL = ModelSpec("small", vocab_size=1000, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=192)
RING2 = Layout(dp=1, ring=2, ulysses=1, zero_stage=0, checkpointing=False)
T = 200  # tokens per rank of a 400-token row on a ring of 2


# --- a row of pairs --------------------------------------------------------------------------


def test_a_pairs_row_is_what_training_packs() -> None:
    from ringtrain.train.pairs import pack_pairs, row_length

    prompt, chosen, rejected = np.array([1, 7, 300]), np.array([1, 5, 64]), np.array([2, 9, 1])
    for layout, shared in ((SHARED, True), (TWO_DOCUMENTS, False)):
        want = row_length(prompt, chosen, rejected, shared)
        assert [row_tokens(int(p), int(c), layout) for p, c in zip(prompt, chosen)] == list(
            row_length(prompt, chosen, chosen, shared)
        )
        assert want.tolist() == ([5, 22, 366] if shared else [5, 28, 665])

    # The longest prompt beside two 100-token completions in a 1,000-token row: 799 shared
    # (799 + 2 x 100 + 1), 400 as two documents (2 x 400 + 2 x 100); one more token is dropped.
    assert longest_prompt(1000, 100, SHARED) == 799 and longest_prompt(1000, 100, TWO_DOCUMENTS) == 400
    for layout, shared in ((SHARED, True), (TWO_DOCUMENTS, False)):
        p = longest_prompt(1000, 100, layout)
        lengths = np.array([p, 100, 100, p + 1, 100, 100])
        rows = pack_pairs(lengths, 1000, seed=0, shared=shared, overlong="drop")
        assert (rows.dropped, rows.pairs.tolist()) == (1, [0])


def test_a_row_too_short_for_both_completions_holds_no_pair() -> None:
    assert PairFit.of(2049, 1024) == PairFit(2049, 1024, 0, 0)  # a prompt needs a token
    assert PairFit.of(2050, 1024) == PairFit(2050, 1024, 1, 1)
    assert PairFit.of(131072, 1024).record() == {
        "row_tokens": 131072, "completion_tokens": 1024,
        "prompt_tokens_shared": 131072 - 2049, "prompt_tokens_two_documents": (131072 - 2048) // 2,
    }  # fmt: skip


# --- the per-token loss ------------------------------------------------------------------------


def test_the_loss_of_a_preference_objective_by_hand() -> None:
    t, V, h = T, 1000, 64
    assert loss_bytes(SMALL, RING2, t, 2, per_token=True) == (12 * t * V + 8 * t, 0)
    chunked = dataclasses.replace(RING2, loss_chunk=16)
    assert loss_bytes(SMALL, chunked, t, 2, per_token=True) == (16 * V * 14 + 4 * t + 4 * V * h + 8 * t, 0)
    # Where the fused kernel would run, the per-token loss runs chunked instead (train/model.py).
    long = 8192
    assert loss_bytes(SMALL, RING2, long, 2, fused=True, per_token=True) == (
        FUSED_FALLBACK_CHUNK * V * 14 + 4 * long + 4 * V * h + 8 * long, 0
    )
    # Next-token training's losses are what they were.
    assert loss_bytes(SMALL, RING2, t, 2) == (12 * t * V, 0)
    assert loss_bytes(SMALL, chunked, t, 2) == (16 * V * 14 + 4 * t + 4 * V * h, 0)


def test_the_planners_constants_are_the_trainers() -> None:
    from ringtrain.train.model import WEIGHTED_CHUNK_TOKENS

    assert FUSED_FALLBACK_CHUNK == WEIGHTED_CHUNK_TOKENS


@pytest.mark.parametrize("chunk", [0, 1024])
def test_the_per_token_loss_adds_at_most_token_loss_bytes(chunk: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Measured: the peak of a micro-batch's DPO loss (token losses summed into their pairs, the
    objective, its backward) over the peak of the summed next-token loss of the same tokens.
    One rank: the CP group's all-reduce adds nothing."""
    import torch.nn.functional as F

    from ringtrain.train import pair_loss
    from ringtrain.train.data import MicroBatch
    from ringtrain.train.loss import chunked_cross_entropy_sum, chunked_cross_entropy_tokens
    from ringtrain.train.preference import Objective
    from ringtrain_dev.live_bytes import LiveBytes

    monkeypatch.setattr(pair_loss.dist, "all_reduce", lambda tensor, group=None: None)
    tokens, width, vocab, num_pairs = 8192, 16, 512, 64
    g = torch.Generator().manual_seed(0)
    hidden0, weight = torch.randn(tokens, width, generator=g), torch.randn(vocab, width, generator=g, requires_grad=True)
    labels = torch.randint(0, vocab, (tokens,), generator=g)
    slots = np.repeat(np.arange(2 * num_pairs), tokens // (2 * num_pairs))[None]
    mb = MicroBatch((0,), np.zeros((1, tokens)), labels.numpy()[None], np.zeros((1, tokens)), completions=slots,
                    pairs=tuple(range(num_pairs)))  # fmt: skip

    def peak(per_token: bool) -> int:
        hidden = hidden0.clone().requires_grad_(True)
        with LiveBytes() as live:
            if not per_token:
                loss = chunked_cross_entropy_sum(hidden, weight, labels, chunk) if chunk else F.cross_entropy(
                    F.linear(hidden, weight), labels, reduction="sum")
            else:
                token_losses = chunked_cross_entropy_tokens(hidden, weight, labels, chunk) if chunk else F.cross_entropy(
                    F.linear(hidden, weight), labels, reduction="none")
                sums, counts = pair_loss.completion_sums(-token_losses, mb, None, torch.device("cpu"))
                scores = pair_loss.pair_scores(sums, counts, mb.pairs, np.zeros((num_pairs, 2)))
                loss, _ = pair_loss.micro_loss(Objective("dpo", 0.1), scores, 1.0)
            loss.backward()
        return live.peak

    extra = peak(True) - peak(False)
    # The pairs' own sums, counts and losses are a few fp64 values per completion, not per token.
    assert 0 < extra <= TOKEN_LOSS_BYTES * tokens + 64 * 2 * num_pairs, extra / tokens


# --- the reference pass ------------------------------------------------------------------------


def test_the_reference_pass_by_hand() -> None:
    p, h, rotary = 2, 64, 4 * T * 16
    norm = T * (4 + 2 * p) * h  # the RMSNorm's fp32 input, normalized output and output
    work = T * ((4 + 2 * p) * h + (16 + 6 * p) * 32)  # the attention's working set, ring of 2
    attention = T * p * h + norm + T * p * (64 + 2 * 32) + work
    loss = T * p * h + T * 1000 * (p + 4 + 4) + 8 * T  # logits, fp32 copy, log-softmax; token losses
    assert (attention, loss) == (460_800, 2_027_200)
    assert reference_activations(SMALL, RING2, 400, p, flash=True) == rotary + loss == 2_040_000

    chunked = dataclasses.replace(RING2, loss_chunk=16)
    assert reference_activations(SMALL, chunked, 400, p, flash=True) == rotary + attention == 473_600
    wide = dataclasses.replace(SMALL, ffn_dim=1024)
    mlp = 2 * T * p * h + norm + T * 4 * p * 1024  # the residual twice, the norm, w1 w3 silu product
    assert reference_activations(wide, chunked, 400, p, flash=True) == rotary + mlp == 1_804_800
    tiled = dataclasses.replace(chunked, mlp_tiles=4)
    assert reference_activations(wide, tiled, 400, p, flash=True) == rotary + mlp - 3 * T * 4 * p * 1024 // 4 == 576_000
    # fp32 logits are not copied to fp32 again.
    assert reference_activations(SMALL, RING2, 400, 4, flash=True) == rotary + T * 4 * h + T * 1000 * 8 + 8 * T
    # One row, whatever the micro batch.
    assert reference_activations(SMALL, dataclasses.replace(RING2, micro_batch=4), 400, p, flash=True) == 2_040_000


@pytest.mark.parametrize("objective", ["lm", "dpo", "ipo", "simpo", "orpo"])
def test_an_objective_in_the_estimate(objective: str) -> None:
    lm = estimate(Workload(SMALL, 400), RING2)
    got = estimate(Workload(SMALL, 400, objective=objective), RING2)
    preference = objective != "lm"
    assert got.token_losses == (TOKEN_LOSS_BYTES * T if preference else 0)
    assert got.logits_and_loss - lm.logits_and_loss == got.token_losses
    want_reference = reference_activations(SMALL, RING2, 400, 2, flash=True) if objective in ("dpo", "ipo") else 0
    assert got.reference_pass == want_reference
    step = activations(SMALL, RING2, 400, 2, flash=True, per_token=preference).peak
    assert got.activations == max(step, want_reference) == step


@pytest.mark.parametrize("model", [PRESETS["llama3-8b"], PRESETS["llama3-70b"], SMALL], ids=lambda m: m.name)
def test_the_reference_pass_never_peaks_above_the_step(model: ModelSpec) -> None:
    """Forward only under no_grad, of one row: below the step's peak in every layout the search
    tries (recomputation or none, every saver, ZeRO stage, Ulysses, unfused kernel, fp32)."""
    worst = 0.0
    for seq in (8192, 1 << 20):
        for fused, flash, act_bytes in ((False, True, 2), (True, True, 2), (False, False, 2), (False, True, 4)):
            workload = Workload(model, seq, flash=flash, global_batch=8, fused=fused, objective="dpo")
            for layout in layouts(workload, Cluster(H100, 8)):
                step = activations(model, layout, seq, act_bytes, flash=flash, fused=fused, per_token=True).peak
                worst = max(worst, reference_activations(model, layout, seq, act_bytes, flash=flash, fused=fused) / step)
    assert 0 < worst <= 1, worst


# --- ringtrain plan --objective ----------------------------------------------------------------


def _run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="ringtrain")
    command.add_arguments(parser)
    return command.run(parser.parse_args(argv))


def test_the_longest_dpo_pair_of_llama3_8b_on_8_h100s(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--model", "llama3-8b", "--gpus", "8", "--max-seq-len", "--objective", "dpo", "--top", "3"]
    assert _run([*argv, "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    row = record["max_seq_len"]
    assert record["objective"] == "dpo" and row >= 128 * 1024
    assert record["longest_pair"] == {"row_tokens": row, "completion_tokens": 1024,
                                      "prompt_tokens_shared": row - 2049, "prompt_tokens_two_documents": (row - 2048) // 2}  # fmt: skip
    best = record["layouts"][0]
    memory = best["memory_bytes"]
    assert best["longest_pair"] == record["longest_pair"] and best["fits"]
    assert 0 < memory["reference_pass"] < memory["activations"] and memory["token_losses"] == 8 * row // best["layout"]["cp"]

    assert _run([*argv, "--completion-tokens", "4096"]) == 0
    out = capsys.readouterr().out
    assert "prompt, shared" in out and f"longest pair: a {row:,}-token row, a {row - 8193:,}-token prompt" in out
    assert f"run: ringtrain run JOB.yaml train.objective=dpo data.seq_len={row} " in out and "reference pass:" in out


def test_simpo_takes_no_reference_pass_and_a_job_file_its_own_objective(capsys: pytest.CaptureFixture[str]) -> None:
    assert _run(["--model", "llama3-8b", "--gpus", "8", "--seq-len", "65536", "--objective", "simpo", "--json", "--top", "1"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["objective"] == "simpo" and record["longest_pair"]["prompt_tokens_shared"] == 65536 - 2049
    assert record["layouts"][0]["memory_bytes"]["reference_pass"] == 0

    from tests.unit.test_planner import QUICKSTART

    assert _run([str(QUICKSTART), "train.objective=ipo", "--gpus", "4", "--json", "--top", "1"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["objective"] == "ipo" and record["job_layout"]["memory_bytes"]["reference_pass"] > 0
    assert _run([str(QUICKSTART), "--gpus", "4", "--top", "1"]) == 0
    assert "objective" not in capsys.readouterr().out


@pytest.mark.parametrize("given", [["--objective", "dpo"], ["--completion-tokens", "512"]])
def test_a_parameter_count_plans_no_pair_and_names_the_flag_given(given: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert _run(["--params", "8B", *given]) == 2
    assert capsys.readouterr().err == (f"ringtrain: config error: {given[0]}: plans activations, which --params leaves out: "
                                       "give a job file or --model\n")  # fmt: skip
