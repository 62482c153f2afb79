"""bench/attention.py's and bench/attention_launches.py's code paths on the CPU: every exchange
of the worst rank's ring, the packed-document case, auto's pick against the best exchange, the
JSON each writes (timings on a CPU are no measurement); and the auto check itself against times
given, with the product's rule for the pick."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

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
    rows = _run_on_a_cpu("attention_launches.py", tmp_path / "attention_launches.json")["rows"]
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
