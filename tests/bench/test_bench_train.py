"""bench/train.py on a CPU: its FLOPs formula against the FLOPs the model runs, its input checks,
the ``--device cpu --tiny`` smoke run end to end (every variant of both shapes, in the spawned
processes the GPU run uses, written to the JSON), and a time box's SIGINT keeping what was measured.

The smoke run measures nothing; it proves that each variant trains the model it should: every
step time, loss and peak memory is there and finite, each loss is a per-token mean near ln(V)
(a summed loss, or a wrong vocabulary, lands far from it), and transformers' model has exactly
the parameters of ringtrain's.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from bench import train as bench
from tests.bench.bench_script import ENV, REPO, run_bench

STEPS = 3


@pytest.mark.parametrize("name", list(bench.SHAPES))
def test_flops_per_token_is_what_the_model_runs(name: str) -> None:
    """The 12 L d S convention is three times the forward's FLOPs with attention counted whole,
    which is what the math kernel computes (every score, the masked ones too); the causal
    formula is that less half the attention. Counted on the tiny shape, whose Qwen3 flavour has
    n_heads x head_dim != dim, so an attention width taken from dim fails here."""
    from ringtrain.topology import CPLayout
    from ringtrain.train.attention import build_attention
    from ringtrain.train.trainer import build_model

    case = bench.Case(shape=name, variant="plain", device="cpu", tiny=True, seq=64, warmup=0, steps=1, zero=2,
                      kernel="math", snapshot_every=0)
    job = bench.load_job(case)
    model = build_model(job, build_attention(CPLayout(1, 1), "math", ring_group=None, ulysses_group=None))
    input_ids = torch.zeros(1, case.seq, dtype=torch.long)
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(input_ids, torch.arange(case.seq)[None])
    flops = bench.flops_per_token(case.model, case.seq)
    assert flops["convention_12lds"] == 3 * counter.get_total_flops() / case.seq
    attention = 6 * case.model["n_layers"] * case.model["n_heads"] * case.model["head_dim"] * case.seq
    assert flops["causal"] == flops["convention_12lds"] - attention


def test_bad_input_exits_2_naming_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.main(["--device", "cpu"]) == 2
    assert "--tiny" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exited:
        bench.parse_args(["--device", "cpu", "--tiny", "--shapes", "tinyllama,gpt2"])
    assert exited.value.code == 2
    assert "--shapes: gpt2" in capsys.readouterr().err


@pytest.fixture(scope="module")
def smoke(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("bench") / "train.json"
    done = run_bench("train.py", "--device", "cpu", "--tiny", "--warmup", "1", "--steps", str(STEPS), "--out", str(out),
                     timeout=300)
    assert bench.SMOKE in done.stdout
    return {"record": json.loads(out.read_text()), "stdout": done.stdout}


def _expected_variants(name: str) -> set[str]:
    return set(bench.VARIANTS) if bench.SHAPES[name].snapshots else set(bench.VARIANTS) - {"trainer_snapshots"}


@pytest.mark.slow
def test_smoke_runs_every_variant_of_both_shapes(smoke: dict[str, Any]) -> None:
    record = smoke["record"]
    assert record["smoke"] is True and record["failed"] == []
    assert record["git"]["commit"] and record["device_type"] == "cpu"
    assert set(record["shapes"]) == set(bench.SHAPES)
    for name, shape in record["shapes"].items():
        assert set(shape["variants"]) == _expected_variants(name)
        ln_vocab = math.log(shape["model"]["vocab_size"])
        for variant, out in shape["variants"].items():
            where = f"{name}/{variant}"
            assert len(out["step_s"]) == STEPS and len(out["losses"]) == STEPS, where
            assert all(math.isfinite(t) and t > 0 for t in out["step_s"]), where
            assert all(0.5 * ln_vocab < loss < 1.5 * ln_vocab for loss in out["losses"]), (where, out["losses"])
            assert math.isfinite(out["tokens_per_s"]) and out["tokens_per_s"] > 0, where
            assert math.isfinite(out["mfu_causal"]) and out["mfu_12lds"] > out["mfu_causal"] > 0, where
            assert 0 < out["peak_memory_bytes"] < 2**40, where
            assert out["tokens_per_step"] == shape["seq"], where
        variants = shape["variants"]
        assert variants["hf"]["num_params"] == variants["plain"]["num_params"] == variants["trainer"]["num_params"]
        assert variants["trainer"]["checkpointing"] == variants["plain"]["checkpointing"] == "none"
    snapshot_s = record["shapes"]["tinyllama"]["variants"]["trainer_snapshots"]["snapshot_s"]
    assert any(s > 0 for s in snapshot_s)  # it snapshots indeed (a step may report before its copy ends)
    assert not any(record["shapes"]["tinyllama"]["variants"]["trainer"]["snapshot_s"])  # and the trainer does not
    # Each timed step's snapshot was profiled, and the time snapshots added is split into parts
    # that add up: the fence's wait, the capture's issue and wait for a buffer, and the rest.
    steps = record["shapes"]["tinyllama"]["variants"]["trainer_snapshots"]["snapshot_steps"]
    assert all(len(steps[key]) == STEPS for key in ("fence_wait_s", "issue_s", "copy_s", "checksum_s"))
    assert all(w is not None and w >= 0 for w in steps["fence_wait_s"]) and not any(steps["staged"])  # a CPU stages nothing
    assert steps["page_locked"] == [False] * STEPS  # and locks no pages: a thread copies
    assert all(n > 0 for n in steps["num_bytes"]) and steps["first_capture_alloc_s"] > 0
    split = record["shapes"]["tinyllama"]["snapshot_profile"]
    assert split["added_s"] == pytest.approx(sum(split[k] for k in ("fence_wait_s", "issue_s", "buffer_wait_s", "rest_s")))
    assert "snapshot_profile" not in record["shapes"]["qwen3"]


@pytest.mark.slow
def test_smoke_prints_every_target_unenforced(smoke: dict[str, Any]) -> None:
    targets = smoke["record"]["targets"]
    per_shape = {name: [t["what"] for t in targets if t["shape"] == name] for name in bench.SHAPES}
    assert per_shape == {
        "tinyllama": ["trainer MFU (causal)", "trainer / plain tokens/s", "trainer / hf tokens/s",
                      "trainer_snapshots / trainer step time"],
        "qwen3": ["trainer MFU (causal)", "trainer / plain tokens/s", "trainer / hf tokens/s"],
    }
    assert all(t["value"] is not None and math.isfinite(t["value"]) for t in targets)
    target_lines = [line for line in smoke["stdout"].splitlines() if "(target " in line]
    assert len(target_lines) == len(targets)
    assert all(line.endswith(bench.SMOKE) for line in target_lines)


@pytest.mark.slow
def test_a_sigint_keeps_what_was_measured(tmp_path: Path) -> None:
    """A time box stops the bench with SIGINT to its process group: the variant in flight is
    recorded as interrupted, the rest are not started, what was measured is written, and the
    bench exits 1. Started with SIGINT ignored, as a shell starts a background job (``cmd &``):
    the bench takes SIGINT all the same."""
    out = tmp_path / "train.json"
    proc = subprocess.Popen(
        [sys.executable, str(REPO / "bench" / "train.py"), "--device", "cpu", "--tiny", "--shapes", "tinyllama",
         "--variants", "plain,hf,trainer", "--warmup", "1", "--steps", "1", "--out", str(out)],
        cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.split()[:1] == ["tinyllama/plain"]:
                break
        os.killpg(proc.pid, signal.SIGINT)
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, stderr[-3000:]
    record = json.loads(out.read_text())
    assert record["interrupted"] is True
    variants = record["shapes"]["tinyllama"]["variants"]
    assert variants["plain"]["tokens_per_s"] > 0
    # The signal lands while hf runs, or (on a busy machine) just before it starts.
    assert set(variants) <= {"plain", "hf"}
    if "hf" in variants:
        assert variants["hf"]["interrupted"] is True and record["failed"] == ["tinyllama/hf"]
