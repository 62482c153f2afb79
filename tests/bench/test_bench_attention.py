"""bench/attention.py's and bench/attention_launches.py's code paths on the CPU: every exchange
of the worst rank's ring, the packed-document case, the JSON each writes (timings on a CPU are
no measurement)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.bench.bench_script import run_bench


def _run_on_a_cpu(script: str, out: Path) -> dict:
    """``bench/<script> --device cpu --tiny``, its JSON."""
    run_bench(script, "--device", "cpu", "--tiny", "--out", str(out), timeout=300)
    return json.loads(out.read_text())


@pytest.mark.slow
def test_the_attention_bench_runs_its_whole_path_on_a_cpu(tmp_path: Path) -> None:
    result = _run_on_a_cpu("attention.py", tmp_path / "attention.json")
    rows = result["timings"]
    assert {(r["ring"], r["exchange"]) for r in rows} == {(2, "ring"), (2, "allgather"), (4, "ring"), (4, "allgather")}
    assert all(r["rank_fwd_ms"] > 0 and r["rank_bwd_ms"] > 0 for r in rows)
    packed = result["packed"]
    assert packed["docs"] == 4 and packed["packed"]["fwd_ms"] > 0 and packed["unpacked"]["bwd_ms"] > 0


@pytest.mark.slow
def test_the_launches_bench_runs_its_whole_path_on_a_cpu(tmp_path: Path) -> None:
    # bench/attention_launches.py: the GPU-busy and graphed columns need CUDA; the rest runs here.
    rows = _run_on_a_cpu("attention_launches.py", tmp_path / "attention_launches.json")["rows"]
    assert {(r["ring"], r["exchange"]) for r in rows} == {(4, "ring"), (4, "allgather")}
    assert all(r["rank_fwd_bwd_ms"] > 0 and r["ratio"] > 0 for r in rows)
