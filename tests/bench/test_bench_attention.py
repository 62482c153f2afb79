"""bench/attention.py's and bench/attention_launches.py's code paths on the CPU: every exchange
of the worst rank's ring, the packed-document case, auto's pick against the best exchange, the
JSON each writes (timings on a CPU are no measurement); the auto check itself against times
given, with the product's rule for the pick; and what the launches bench makes of what a CPU
cannot run (a failed CUDA graph capture, the profiler's device events) and of a SIGINT."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from bench import attention, attention_launches
from ringtrain.train.attention import call
from ringtrain.train.attention.call import choose_exchange
from ringtrain_dev.ring_targets import AUTO_SLOWER_MAX, auto_checks
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
    _assert_auto_checked(result, rows)


@pytest.mark.slow
def test_the_launches_bench_runs_its_whole_path_on_a_cpu(tmp_path: Path) -> None:
    # bench/attention_launches.py: the GPU-busy and graphed columns need CUDA; the rest runs here.
    result = _run_on_a_cpu("attention_launches.py", tmp_path / "attention_launches.json")
    rows = result["rows"]
    assert {(r["ring"], r["exchange"]) for r in rows} == {(4, "ring"), (4, "allgather")}
    assert all(r["rank_fwd_bwd_ms"] > 0 and r["ratio"] > 0 for r in rows)
    _assert_auto_checked(result, rows)


def _assert_auto_checked(result: dict, rows: list[dict]) -> None:
    """One auto check a size, naming the product's pick there and an exchange timed there."""
    sizes = {(r["seq"], r["ring"]) for r in rows}
    assert {(c["seq"], c["ring"]) for c in result["auto"]} == sizes
    for check in result["auto"]:
        assert check["pick"] == choose_exchange("auto", check["ring"], check["tokens_per_rank"], None)
        assert check["best"] in {r["exchange"] for r in rows}


def _rows(times_ms: dict[tuple[int, int, str], float]) -> list[dict]:
    return [{"seq": seq, "ring": ring, "tokens_per_rank": seq // ring, "exchange": exchange, "ms": ms}
            for (seq, ring, exchange), ms in times_ms.items()]


def test_auto_is_held_to_the_best_exchange_within_five_percent() -> None:
    rows = _rows({
        (16384, 8, "ring"): 3.00, (16384, 8, "allgather"): 3.20,  # 2K a rank on 8: auto gathers, 6.7% slower
        (16384, 2, "ring"): 8.00, (16384, 2, "allgather"): 9.00,  # 8K a rank on 2: auto passes K/V around, the best
        (65536, 4, "ring"): 10.50, (65536, 4, "allgather"): 10.00,  # 16K a rank on 4: the ring, 5% slower exactly
        (8192, 4, "ring"): 1.00,  # auto would gather here, which was not timed: no check
    })
    checks = auto_checks(rows, lambda row: row["ms"])
    by_size = {(c.tokens_per_rank, c.ring): c for c in checks}
    assert list(by_size) == [(2048, 8), (8192, 2), (16384, 4)]  # by tokens a rank
    two_k, eight_k, sixteen_k = by_size.values()
    assert (two_k.pick, two_k.best, two_k.met) == ("allgather", "ring", False)
    assert two_k.slower == pytest.approx(3.20 / 3.00)
    assert two_k.line(smoke=False).startswith("MISS: auto at 2048 tokens a rank (ring 8) picks allgather")
    assert (eight_k.pick, eight_k.best, eight_k.met, eight_k.slower) == ("ring", "ring", True, 1.0)
    assert (sixteen_k.pick, sixteen_k.best) == ("ring", "allgather")
    assert sixteen_k.slower == pytest.approx(AUTO_SLOWER_MAX) and sixteen_k.met
    assert "cpu smoke" in two_k.line(smoke=True) and "MISS" not in two_k.line(smoke=True)


def test_the_auto_check_asks_the_products_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the rule's threshold moves, the pick the check holds to the best moves with it: it
    asks choose_exchange, it keeps no copy of the rule."""
    rows = _rows({(65536, 4, "ring"): 10.0, (65536, 4, "allgather"): 12.0})
    assert [c.pick for c in auto_checks(rows, lambda row: row["ms"])] == ["ring"]
    monkeypatch.setattr(call, "ALLGATHER_BELOW_TOKENS", 32768)
    moved = auto_checks(rows, lambda row: row["ms"])
    assert [(c.pick, c.met) for c in moved] == [("allgather", False)]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message a machine without CUDA gets")
@pytest.mark.parametrize("bench", [attention, attention_launches], ids=["attention", "launches"])
def test_without_cuda_a_gpu_bench_exits_2_with_a_message(bench: Any, capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.main([]) == 2
    assert f"bench/{bench.__name__.split('.')[-1]}.py needs a CUDA GPU" in capsys.readouterr().err


# ---- bench/attention_launches.py: what a CPU run cannot reach -------------------------------------


def _launch_row(seq: int, ring: int, exchange: str, **measured: Any) -> dict[str, Any]:
    return {"seq": seq, "ring": ring, "tokens_per_rank": seq // ring, "exchange": exchange, "kernel": "cudnn",
            "monolithic_fwd_bwd_ms": 8.0, "rank_fwd_bwd_ms": 2.0 + (exchange == "ring"),
            "target": attention_launches.ratio_target(seq // ring), "ratio": 0.5, **measured}


def test_the_profilers_device_events_count_kernels_apart_from_copies_and_fills() -> None:
    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
    events = [SimpleNamespace(name=name, device_type=device, self_device_time_total=us) for name, device, us in [
        ("cudnn_fwd_kernel", cuda, 1000.0), ("merge_lse_kernel", cuda, 200.0),
        ("Memcpy DtoD (Device -> Device)", cuda, 300.0), ("Memset (Device)", cuda, 100.0),
        ("aten::copy_", cpu, 5000.0),  # the host's side of a copy: no device time of its own
    ]] * 2  # two steps
    work = attention_launches.device_work(events, iters=2)
    assert (work.kernels, work.copies) == (2, 2)
    assert work.busy_ms == pytest.approx(1.6)


def test_a_failed_capture_fails_its_size_and_no_graph_is_captured_after_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """A capture that fails is a FAIL at its size, not a size left out; the next rows are not
    captured (the failed capture's pool and stream state would be theirs) and their sizes fail
    too, saying why."""
    captures: list[Any] = []

    def capture_fails(fn: Any, sample: Any, num_warmup_iters: int) -> Any:
        captures.append(fn)
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing")

    monkeypatch.setattr(torch.cuda, "make_graphed_callables", capture_fails)
    graphs = attention_launches.Graphs(warmup=1, iters=1)
    shard = [torch.zeros(1, 8, 2, 4) for _ in range(4)]
    rows = [_launch_row(16384, 8, "ring"), _launch_row(16384, 8, "allgather"),
            _launch_row(16384, 4, "ring"), _launch_row(16384, 4, "allgather")]
    for row in rows:
        graphs.measure(row, lambda q, k, v: q, shard, torch.device("cpu"))
    assert len(captures) == 1
    assert rows[0]["graph_error"].startswith("RuntimeError: CUDA error: operation not permitted")
    assert all(r["graph_skipped"] == "no graph captured after the capture at 2048 tokens a rank (ring 8, ring) failed"
               for r in rows[1:])
    found = attention_launches.verdicts(rows)
    assert [verdict for _, verdict in found] == ["FAIL", "FAIL"]
    assert "ring: graph capture failed: RuntimeError: CUDA error: operation not permitted" in found[1][0]


def test_a_captured_graph_is_timed_and_held_to_the_target(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "make_graphed_callables", lambda fn, sample, num_warmup_iters: fn)
    graphs = attention_launches.Graphs(warmup=1, iters=1)
    shard = [torch.ones(1, 8, 2, 4) for _ in range(4)]
    row = _launch_row(16384, 8, "ring")
    graphs.measure(row, lambda q, k, v: q * k * v, shard, torch.device("cpu"))
    assert row["graphed_fwd_bwd_ms"] > 0 and "graph_error" not in row
    assert row["graphed_ratio"] == pytest.approx(8.0 / 8 / row["graphed_fwd_bwd_ms"])
    rows = [{**row, "graphed_ratio": 0.69}, _launch_row(16384, 8, "allgather", graphed_ratio=0.71),
            _launch_row(32768, 4, "ring", graphed_ratio=0.99)]  # a size cut short: one exchange
    assert attention_launches.verdicts(rows) == [
        ("2048 tokens a rank (ring 8, allgather): graphed 0.71 (as run 0.50) >= 0.7", "PASS")]
    rows[1]["graphed_ratio"] = 0.6
    assert [verdict for _, verdict in attention_launches.verdicts(rows)] == ["MISS"]


def _launches_main(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, rows: Iterator[dict[str, Any]]) -> tuple[int, dict]:
    """bench/attention_launches.py's main on the CPU, its measuring replaced by ``rows``."""
    monkeypatch.setattr(attention_launches, "measure", lambda args, device: rows)
    out = tmp_path / "attention_launches.json"
    try:
        code = attention_launches.main(["--device", "cpu", "--tiny", "--out", str(out)])
    except KeyboardInterrupt:
        pytest.fail("the SIGINT escaped the bench: what it measured was not written")
    return code, json.loads(out.read_text())


def test_a_sigint_keeps_the_rows_measured_before_it(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    def cut() -> Iterator[dict[str, Any]]:
        yield _launch_row(16384, 8, "ring")
        yield _launch_row(16384, 8, "allgather")
        yield _launch_row(16384, 4, "ring")
        raise KeyboardInterrupt

    code, result = _launches_main(monkeypatch, tmp_path, cut())
    assert code == 1
    assert [(r["ring"], r["exchange"]) for r in result["rows"]] == [(8, "ring"), (8, "allgather"), (4, "ring")]
    assert result["interrupted"] == "interrupted (SIGINT) after 3 rows: the rest is not measured"
    assert [c["ring"] for c in result["auto"]] == [8]  # the size cut short has no verdict


def test_a_failed_capture_fails_the_run(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    rows = [_launch_row(16384, 8, "ring", graph_error="RuntimeError: capture failed\n"),
            _launch_row(16384, 8, "allgather", graph_skipped="no graph captured after the capture at ... failed")]
    code, result = _launches_main(monkeypatch, tmp_path, iter(rows))
    assert code == 1 and result["interrupted"] is None
    assert [(t["verdict"], t["met"]) for t in result["targets"]] == [("FAIL", False)]
    assert "FAIL: 2048 tokens a rank (ring 8): not graphed: ring: graph capture failed" in capsys.readouterr().out
