"""Chat training is exact under every layout: a packed chat batch trains as transformers' model
on each conversation alone.

A tiny transformers Llama (saved locally) and a chat dataset of random conversations with
assistant-turn masks are trained for one step by the real Trainer on gloo ranks, under dp x cp
layouts, ZeRO stages and gradient accumulation. The step's loss and the full gradient of every
parameter (gathered before the optimizer step) must equal the reference: transformers' forward
on each conversation of the global batch alone, labels -100 outside its mask, combined as
``train.loss_norm`` says (token: each conversation's summed loss over all trained tokens;
sequence: the mean of the conversations' token means), fp32 within 1e-5.

``ringtrain eval``'s scoring of a chat dataset (whole conversations, trained tokens) is checked
the same way under ring cp2 and hybrid cp4: its loss and trained-token count equal transformers'.

A second dataset is rendered by ``ringtrain prepare``'s renderer from records with tools and
weight-0 assistant turns, by a template with generation markers and by its twin without: both
give transformers' own assistant mask of a reference template that marks only the trained turns,
and that dataset trains as transformers does under cp1, ring cp2 and hybrid cp4.

Several layouts run in one process group per world size, so the file costs three groups.
"""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from ringtrain_dev.chat_data import chat_samples, random_conversations, write_chat
from ringtrain_dev.ranks import gloo_rank, run_ranks
from tests.hf_models import VOCAB, save_model

pytestmark = [pytest.mark.dist, pytest.mark.slow]

SEQ, GLOBAL_BATCH, SEED = 32, 4, 3
# name -> (world size, overrides)
LAYOUTS: dict[str, tuple[int, list[str]]] = {
    "dp1-cp1": (1, ["mesh.dp=1", "mesh.cp=1", "zero.stage=0", "train.micro_batch=4"]),
    "dp1-cp1-chunked-loss": (1, ["mesh.dp=1", "mesh.cp=1", "zero.stage=0", "train.micro_batch=2",
                                 "train.loss_chunk_tokens=16"]),
    "ring-cp2-zero2": (2, ["mesh.cp=2", "attention.impl=ring", "zero.stage=2", "train.micro_batch=4"]),
    "ulysses-cp2-zero3": (2, ["mesh.cp=2", "attention.impl=ulysses", "zero.stage=3", "train.micro_batch=2"]),
    "dp2-accum-zero2": (2, ["mesh.dp=2", "mesh.cp=1", "zero.stage=2", "train.micro_batch=1"]),
    "ring-cp4-allgather": (4, ["mesh.cp=4", "attention.impl=ring", "attention.kv_exchange=allgather",
                               "zero.stage=2", "train.micro_batch=4"]),
    "hybrid-cp4-zero3": (4, ["mesh.cp=4", "mesh.ulysses=2", "attention.impl=hybrid", "zero.stage=3",
                             "train.micro_batch=4"]),
    "dp2-ring-cp2-accum": (4, ["mesh.dp=2", "mesh.cp=2", "attention.impl=ring", "zero.stage=2",
                               "train.micro_batch=1"]),
}
NORMS = ("token", "sequence")
EVAL_LAYOUTS = ("ring-cp2-zero2", "hybrid-cp4-zero3")
NUM_CONVERSATIONS = 40
# The rendered dataset: a real tokenizer's vocabulary and conversations of 20 to 124 tokens.
RENDERED_LAYOUTS, RENDERED_SEQ, RENDERED_VOCAB = ("dp1-cp1", "ring-cp2-zero2", "hybrid-cp4-zero3"), 128, 320
# Resume: the snapshot of step RESUME_CUT restored, training on to RESUME_STEPS, mid-epoch and
# across an epoch's end (the dataset packs into a few steps' rows, first-fit decreasing).
RESUME_LAYOUT, RESUME_STEPS, RESUME_CUT = "ring-cp2-zero2", 6, 3


def _overrides(folder: str, root: str, layout: list[str], norm: str, seq: int = SEQ) -> list[str]:
    return [f"model.hf={folder}", f"data.path={root}", "data.packing=doc", f"data.seq_len={seq}",
            f"train.global_batch={GLOBAL_BATCH}", f"train.seed={SEED}", "train.steps=2", "train.warmup_steps=0",
            "train.grad_clip=0", "train.fused_ops=false", "checkpoint.snapshot_every=0", f"train.loss_norm={norm}",
            *layout]


def _rank(rank: int, world: int, store: str, runs: list[tuple[str, list[str]]], evalset: Any, results: mp.Queue) -> None:
    with gloo_rank(rank, world, store, results):
        import torch.distributed as dist
        from deepspeed.utils import safe_get_full_grad

        from ringtrain import config
        from ringtrain.evaluation.tally import merge_all
        from ringtrain.hf import resolve_job
        from ringtrain.hf.names import to_hf
        from ringtrain.train.evaluator import Evaluator
        from ringtrain.train.trainer import Trainer

        out: dict[str, Any] = {}
        for name, overrides in runs:
            trainer = Trainer(resolve_job(config.load(None, overrides)), rank=rank, device=torch.device("cpu"))
            if name.endswith("/resume"):
                out[name] = _resume(trainer, lambda: Trainer(resolve_job(config.load(None, overrides)), rank=rank,
                                                             device=torch.device("cpu")), world)
                continue
            if name.endswith("/eval"):
                tallies: list[Any] = [None] * world
                dist.all_gather_object(tallies, Evaluator.of(trainer).losses(evalset, 8))
                merged = merge_all(tallies)
                out[name] = {"loss": merged.loss, "tokens": merged.tokens, "sequence_loss": merged.sequence_loss}
                trainer.prefetcher.close()
                continue
            grads: dict[str, np.ndarray] = {}
            step = trainer.engine.step

            def capture(*args: Any, _step: Any = step, _trainer: Trainer = trainer, _grads: dict = grads, **kw: Any) -> Any:
                # At the accumulation boundary, before the optimizer: the step's whole gradient
                # (collective under ZeRO-3: every rank asks for every parameter).
                if _trainer.engine.is_gradient_accumulation_boundary():
                    for pname, p in _trainer.model.named_parameters():
                        _grads[to_hf(pname)] = safe_get_full_grad(p).detach().numpy().copy()
                return _step(*args, **kw)

            trainer.engine.step = capture
            report = trainer.train_step()
            trainer.prefetcher.close()
            tokens = torch.tensor([report.num_tokens, report.trained_tokens], dtype=torch.float64)
            dist.all_reduce(tokens)
            out[name] = {"loss": report.loss, "grads": grads, "tokens": [int(t) for t in tokens.tolist()]}
        if rank == 0:
            results.put(out)


def _resume(first: Any, fresh: Any, world: int) -> dict[str, Any]:
    """Train RESUME_STEPS steps while snapshotting step RESUME_CUT, then restore that snapshot
    into a fresh Trainer and train on: (losses, parameters) of both runs."""
    import torch.distributed as dist

    losses, blob = [], None
    while first.step < RESUME_STEPS:
        losses.append(first.train_step().loss)
        if first.step == RESUME_CUT:
            blob = bytes(first.snapshot(RESUME_CUT).blob)
    params = {k: v.numpy() for k, v in first.parameters_fp32().items()}
    first.prefetcher.close()
    blobs: list[Any] = [None] * world
    dist.all_gather_object(blobs, blob)
    second = fresh()
    assert second.restore(blobs) == RESUME_CUT
    resumed = []
    while second.step < RESUME_STEPS:
        resumed.append(second.train_step().loss)
    out = {"losses": losses, "resumed": resumed, "params": params,
           "resumed_params": {k: v.numpy() for k, v in second.parameters_fp32().items()},
           "batches": first.data.order.epoch_size if first.data.source is None else first.data.source.orders[0].epoch_size}
    second.prefetcher.close()
    return out


def _reference(folder: Path, root: Path, convs: list[tuple[np.ndarray, np.ndarray]], seq: int = SEQ) -> dict[str, Any]:
    """transformers on each conversation of step 1's global batch alone, combined both ways; the
    step's tokens (attended, trained)."""
    from transformers import AutoModelForCausalLM

    samples = chat_samples(root, seq_len=seq, seed=SEED)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    means, counts, attended = [], [], 0
    for sample in range(GLOBAL_BATCH):
        row, taken = samples.rows[0].row(samples.orders[0].window(sample))  # type: ignore[attr-defined]
        attended += int(taken.sum())
        for c, n in zip(row, taken):
            tokens, mask = convs[int(c)]
            tokens, mask = tokens[:n], mask[:n]
            if not mask[1:].any():
                continue  # trains nothing: in neither mean
            ids = torch.as_tensor(tokens)[None]
            labels = torch.as_tensor(np.where(mask == 1, tokens, -100))[None]
            means.append(model(input_ids=ids, labels=labels).loss)  # transformers shifts the labels itself
            counts.append(int(mask[1:].sum()))
    samples.close()  # type: ignore[attr-defined]
    n = torch.tensor(counts, dtype=torch.float32)
    out: dict[str, Any] = {}
    with torch.no_grad():  # every conversation alone, as `ringtrain eval` scores a chat dataset
        sums, tokens, conversation_means = 0.0, 0, []
        for ids, mask in convs:
            labels = torch.as_tensor(np.where(mask == 1, ids, -100))[None]
            trained = int(mask[1:].sum())
            if trained:
                conversation_means.append(float(model(input_ids=torch.as_tensor(ids)[None], labels=labels).loss))
                sums += conversation_means[-1] * trained
                tokens += trained
        out["eval"] = {"loss": sums / tokens, "tokens": tokens, "sequence_loss": float(np.mean(conversation_means))}
    for norm, loss in (("token", (torch.stack(means) * n).sum() / n.sum()), ("sequence", torch.stack(means).mean())):
        grads = torch.autograd.grad(loss, list(model.parameters()), retain_graph=True)
        out[norm] = {"loss": float(loss.detach()), "grads": {k: g.numpy() for (k, _), g in zip(model.named_parameters(), grads)},
                     "conversations": len(means), "tokens": [attended, sum(counts)]}
    return out


def _rendered(base: Path) -> list[tuple[np.ndarray, np.ndarray]]:
    """Records with tools and weight-0 assistant turns rendered by the marked tools template and
    by its twin without markers: the same ids and masks, transformers' own mask of the reference
    template (which marks the trained turns only) on every one. Those of 20 to 124 tokens."""
    from ringtrain.prepare import chat_template
    from ringtrain.prepare.chat_records import Conversation, read_chat
    from ringtrain.prepare.chat_render import ChatRenderer, ChatSpec
    from tests.prepare.test_chat_policy import tool_records, with_template
    from ringtrain_dev.tiny_tokenizer import TOOLS_MARKED_TEMPLATE, TOOLS_TEMPLATE, TOOLS_WEIGHTED_REFERENCE, save_chat_tokenizer

    chatml = save_chat_tokenizer(base / "tokenizer", "chatml", vocab_size=RENDERED_VOCAB)
    renderers = [ChatRenderer(ChatSpec(chat_template.find(str(with_template(chatml, base / name, text))), "assistant",
                                       "messages", RENDERED_VOCAB))
                 for name, text in (("marked", TOOLS_MARKED_TEMPLATE), ("unmarked", TOOLS_TEMPLATE))]  # fmt: skip
    out = []
    for record in tool_records(200, seed=5):
        chat = read_chat(Conversation(record), "messages", frozenset({"tools"}))
        if not any(f is not False and m["role"] == "assistant" for m, f in zip(chat.messages, chat.flags)):
            continue
        (ids, mask), (other_ids, other_mask) = (r.render(chat) for r in renderers)
        assert ids.tolist() == other_ids.tolist() and mask.tolist() == other_mask.tolist()
        want = renderers[0]._tok.apply_chat_template(record["messages"], tools=record.get("tools"), return_dict=True,
                                                     chat_template=TOOLS_WEIGHTED_REFERENCE, return_assistant_tokens_mask=True)  # fmt: skip
        assert ids.tolist() == list(want["input_ids"]) and mask[1:].tolist() == list(want["assistant_masks"])[1:]
        if 20 <= len(ids) <= RENDERED_SEQ - 4:
            out.append((ids, mask))
    assert len(out) >= 24 and any(m.sum() for _, m in out)
    return out[:NUM_CONVERSATIONS]


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    base = tmp_path_factory.mktemp("chat_loss")
    folder = save_model(base / "model", "llama")
    convs = random_conversations(NUM_CONVERSATIONS, vocab_size=VOCAB, min_len=6, max_len=14, seed=7)
    write_chat(base / "data", convs, vocab_size=VOCAB)
    ref = _reference(folder, base / "data", convs)
    rendered = _rendered(base)
    write_chat(base / "rendered", rendered, vocab_size=RENDERED_VOCAB)
    big = save_model(base / "model-320", "llama", vocab_size=RENDERED_VOCAB)
    rendered_ref = _reference(big, base / "rendered", rendered, RENDERED_SEQ)
    from ringtrain.train.evalset import load_eval_set

    evalset = load_eval_set(str(base / "data"), seq_len=SEQ, vocab_size=VOCAB, max_rows=NUM_CONVERSATIONS)
    assert evalset.num_rows == NUM_CONVERSATIONS
    results: dict[str, Any] = {}
    for world in sorted({w for w, _ in LAYOUTS.values()}):
        runs = [(f"{name}/{norm}", _overrides(str(folder), str(base / "data"), layout, norm))
                for name, (w, layout) in LAYOUTS.items() if w == world for norm in NORMS]
        if LAYOUTS[RESUME_LAYOUT][0] == world:
            runs.append((f"{RESUME_LAYOUT}/resume", [*_overrides(str(folder), str(base / "data"), LAYOUTS[RESUME_LAYOUT][1],
                                                                  "sequence"), "checkpoint.snapshot_every=1",
                                                     "data.chat_packing=first_fit",
                                                     f"train.steps={RESUME_STEPS}"]))
        runs += [(f"{name}/eval", _overrides(str(folder), str(base / "data"), LAYOUTS[name][1], "token"))
                 for name in EVAL_LAYOUTS if LAYOUTS[name][0] == world]
        runs += [(f"{name}/rendered", _overrides(str(big), str(base / "rendered"), LAYOUTS[name][1], "token", RENDERED_SEQ))
                 for name in RENDERED_LAYOUTS if LAYOUTS[name][0] == world]
        results.update(run_ranks(_rank, world, base, runs, evalset))
    return {"ref": ref, "rendered_ref": rendered_ref, "runs": results, "root": base / "data"}


def test_the_batch_holds_several_conversations_and_a_turn_across_a_shard_boundary(setup: dict[str, Any]) -> None:
    from ringtrain.train.data import IGNORE_INDEX, BatchPlan, ShardedData

    assert setup["ref"]["token"]["conversations"] >= 6
    samples = chat_samples(setup["root"], seq_len=SEQ, seed=SEED)
    data = ShardedData(samples, seq_len=SEQ, seed=SEED, plan=BatchPlan(GLOBAL_BATCH, 1, GLOBAL_BATCH), ring=4,  # type: ignore[arg-type]
                       ulysses=1, ring_idx=0, ulysses_idx=0, vocab_size=VOCAB)
    whole = ShardedData(samples, seq_len=SEQ, seed=SEED, plan=BatchPlan(GLOBAL_BATCH, 1, GLOBAL_BATCH), ring=1,  # type: ignore[arg-type]
                        ulysses=1, ring_idx=0, ulysses_idx=0, vocab_size=VOCAB).step_batches(0, 0)[0]
    mine = np.zeros(SEQ, dtype=bool)
    mine[data.positions] = True
    # A trained label at the last position a rank holds, predicting a token another rank holds.
    crossing = (whole.labels[:, :-1] != IGNORE_INDEX) & (mine[:-1] != mine[1:])
    assert crossing.any()


def _assert_step_equals(got: dict[str, Any], ref: dict[str, Any], name: str) -> None:
    assert got["tokens"] == ref["tokens"]  # attended (no padding) and trained tokens of the step
    assert got["loss"] == pytest.approx(ref["loss"], abs=1e-5, rel=0)
    assert got["grads"].keys() == ref["grads"].keys()
    scale = max(float(np.abs(g).max()) for g in ref["grads"].values())
    diff = max(float(np.abs(got["grads"][k] - ref["grads"][k]).max()) for k in ref["grads"])
    print(f"{name}: loss {got['loss']:.7f} ref {ref['loss']:.7f} max|dgrad| {diff:.2e} (scale {scale:.2e})")
    assert diff <= 1e-5 * max(1.0, scale)


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_packed_chat_step_equals_transformers_on_each_conversation(setup: dict[str, Any], layout: str, norm: str) -> None:
    _assert_step_equals(setup["runs"][f"{layout}/{norm}"], setup["ref"][norm], f"{layout}/{norm}")


@pytest.mark.parametrize("layout", RENDERED_LAYOUTS)
def test_rendered_tool_conversations_with_weights_train_as_transformers(setup: dict[str, Any], layout: str) -> None:
    _assert_step_equals(setup["runs"][f"{layout}/rendered"], setup["rendered_ref"]["token"], f"{layout}/rendered")


@pytest.mark.parametrize("layout", EVAL_LAYOUTS)
def test_eval_of_a_chat_dataset_equals_transformers_on_each_conversation(setup: dict[str, Any], layout: str) -> None:
    got, ref = setup["runs"][f"{layout}/eval"], setup["ref"]["eval"]
    assert got["tokens"] == ref["tokens"]
    assert got["loss"] == pytest.approx(ref["loss"], abs=1e-5, rel=0)
    # train.loss_norm: sequence scores the mean of the conversations' means, each whole across the ring.
    assert got["sequence_loss"] == pytest.approx(ref["sequence_loss"], abs=1e-5, rel=0)
    assert abs(ref["sequence_loss"] - ref["loss"]) > 1e-3


def test_resume_of_a_chat_run_mid_epoch_is_bitwise(setup: dict[str, Any]) -> None:
    got = setup["runs"][f"{RESUME_LAYOUT}/resume"]
    rows = got["batches"]
    # The cut falls inside an epoch and the run crosses an epoch's end.
    assert RESUME_CUT * GLOBAL_BATCH % rows != 0 and RESUME_STEPS * GLOBAL_BATCH > rows
    assert got["resumed"] == got["losses"][RESUME_CUT:]
    for name, value in got["params"].items():
        np.testing.assert_array_equal(got["resumed_params"][name], value, err_msg=name)
