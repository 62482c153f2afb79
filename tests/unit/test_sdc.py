"""SDC verdicts from hand-built digest rounds: majority outliers, golden values, ties, shared drift."""

from __future__ import annotations

import pytest

from ringtrain.policies.faults import Kind
from ringtrain.policies.sdc import SdcScanner, SdcVerdict, scan_due, sdc_failure

GOOD = {"gemm_float32": "g0", "attention_cpu_flash_float32": "a0", "all_reduce_x4": "c0"}


def round_of(num_ranks: int, **changed: dict[str, str]) -> dict[int, dict[str, str]]:
    """Every rank reports GOOD, except ranks named ``r<N>`` with some probes changed."""
    out = {r: dict(GOOD) for r in range(num_ranks)}
    for name, probes in changed.items():
        out[int(name.removeprefix("r"))].update(probes)
    return out


def test_clean_rounds_set_golden_values_and_give_no_verdict() -> None:
    scanner = SdcScanner()
    for step in (0, 100, 200):
        assert scanner.check(step, round_of(4)) is None
    assert scanner.golden == {r: GOOD for r in range(4)}


def test_a_rank_disagreeing_with_the_majority_is_named_with_its_probe() -> None:
    scanner = SdcScanner()
    scanner.check(0, round_of(4))
    v = scanner.check(100, round_of(4, r3={"gemm_float32": "bad"}))
    assert v is not None and v.kind == "outlier"
    assert (v.step, v.ranks, v.probes) == (100, (3,), ("gemm_float32",))
    (f,) = v.findings
    assert (f.rank, f.digest, f.expected, f.basis) == (3, "bad", "g0", "majority")
    assert "rank 3: gemm_float32 differ from the other ranks" in v.explanation
    assert scanner.golden[3]["gemm_float32"] == "g0"  # a corrupt round never becomes golden


def test_two_ranks_that_disagree_are_resolved_by_their_golden_values() -> None:
    scanner = SdcScanner()
    scanner.check(0, round_of(2))
    v = scanner.check(100, round_of(2, r1={"attention_cpu_flash_float32": "bad"}))
    assert v is not None and v.kind == "outlier" and v.ranks == (1,)
    assert v.findings[0].basis == "golden" and v.findings[0].expected == "a0"
    assert "its golden value" in v.explanation


def test_an_even_split_is_resolved_by_the_golden_values() -> None:
    scanner = SdcScanner()
    scanner.check(0, round_of(4))
    v = scanner.check(100, round_of(4, r2={"gemm_float32": "x"}, r3={"gemm_float32": "x"}))
    assert v is not None and v.ranks == (2, 3) and {f.basis for f in v.findings} == {"golden"}


def test_a_disagreement_without_majority_or_golden_is_unresolved() -> None:
    v = SdcScanner().check(0, round_of(2, r1={"gemm_float32": "other"}))
    assert v is not None and v.kind == "unresolved" and v.ranks == (0, 1)
    assert "no majority and no golden value" in v.explanation


def test_a_rank_bad_from_the_start_is_caught_and_its_corruption_never_becomes_golden() -> None:
    scanner = SdcScanner()
    v = scanner.check(0, round_of(3, r2={"gemm_float32": "bad"}))
    assert v is not None and v.ranks == (2,)
    assert "gemm_float32" not in scanner.golden[2] and scanner.golden[2]["all_reduce_x4"] == "c0"
    # Later, two ranks left: rank 0, still at its golden value, vouches for it.
    v = scanner.check(100, {0: dict(GOOD), 2: dict(GOOD, gemm_float32="bad")})
    assert v is not None and v.kind == "outlier" and v.ranks == (2,)
    assert v.findings[0].expected == "g0" and v.findings[0].basis == "golden"


def test_every_rank_changing_alike_is_shared_not_one_rank() -> None:
    scanner = SdcScanner()
    scanner.check(0, round_of(4))
    v = scanner.check(100, {r: dict(GOOD, all_reduce_x4="c1") for r in range(4)})
    assert v is not None and v.kind == "shared" and v.ranks == (0, 1, 2, 3)
    assert v.probes == ("all_reduce_x4",) and "what they share" in v.explanation


def test_several_ranks_and_probes_in_one_round() -> None:
    scanner = SdcScanner()
    scanner.check(0, round_of(5))
    v = scanner.check(7, round_of(5, r1={"gemm_float32": "b1"}, r4={"gemm_float32": "b4", "all_reduce_x4": "c9"}))
    assert v is not None and v.ranks == (1, 4) and v.probes == ("all_reduce_x4", "gemm_float32")
    d = v.to_dict()
    assert d["ranks"] == [1, 4] and len(d["findings"]) == 3 and d["kind"] == "outlier"


def test_heterogeneous_ranks_compare_only_with_themselves() -> None:
    scanner = SdcScanner(cross_rank=False)
    first = {0: dict(GOOD), 1: dict(GOOD, gemm_float32="other-gpu")}
    assert scanner.check(0, first) is None
    assert scanner.check(100, first) is None
    v = scanner.check(200, {0: dict(GOOD), 1: dict(GOOD, gemm_float32="moved")})
    assert v is not None and v.ranks == (1,) and v.findings[0].expected == "other-gpu"


def test_forgotten_ranks_take_new_golden_values() -> None:
    scanner = SdcScanner()
    scanner.check(0, round_of(2))
    scanner.forget([1])
    assert 1 not in scanner.golden
    # After a resize the collective probe's value is new on every rank: forget all, re-learn.
    scanner.forget([0])
    assert scanner.check(100, {r: dict(GOOD, all_reduce_x4="c-new") for r in range(2)}) is None
    assert scanner.golden[0]["all_reduce_x4"] == "c-new"


def test_a_probe_some_ranks_did_not_run_is_judged_among_those_that_did() -> None:
    scanner = SdcScanner()
    rounds = round_of(3)
    del rounds[0]["all_reduce_x4"]
    assert scanner.check(0, rounds) is None
    rounds[2]["all_reduce_x4"] = "bad"
    v = scanner.check(1, rounds)
    assert v is not None and v.ranks == (2,) and v.findings[0].basis == "golden"


def test_golden_values_move_with_their_workers_when_the_world_re_forms() -> None:
    scanner = SdcScanner()
    scanner.check(0, round_of(4))
    scanner.golden[3] = {"gemm_float32": "g3"}  # tell rank 3's worker apart
    # Old rank 1 was lost; 3 now sits at rank 1, a new worker at rank 3, and the world stays 4.
    scanner.reseat([0, 3, 2, None])

    assert scanner.golden == {0: GOOD, 1: {"gemm_float32": "g3"}, 2: GOOD}


@pytest.mark.parametrize(
    "step, every, last_step, due",
    [(0, 100, 1000, True), (100, 100, 1000, True), (150, 100, 1000, False), (1000, 100, 1000, True),
     (999, 100, 999, True), (998, 100, 999, False), (100, 0, 1000, False), (1000, 0, 1000, False)],
)
def test_scans_run_on_the_cadence_and_after_the_last_step(step: int, every: int, last_step: int, due: bool) -> None:
    assert scan_due(step, every=every, last_step=last_step) is due


def verdict(kind: str, ranks: tuple[int, ...]) -> SdcVerdict:
    return SdcVerdict(8, kind, ranks, ("gemm_float32",), (), f"step 8: {kind}")


NODES = {0: "a", 1: "a", 2: "b", 3: "b", 4: "c", 5: "c"}


@pytest.mark.parametrize(
    "found, evict_node, ranks",
    [
        (verdict("outlier", (2,)), False, (2,)),
        (verdict("outlier", (2,)), True, (2, 3)),
        (verdict("outlier", (1, 4)), True, (0, 1, 4, 5)),
        (verdict("shared", (0, 1, 2, 3, 4, 5)), True, ()),
        (verdict("unresolved", (0, 1)), False, ()),
    ],
    ids=["rank", "its-node", "two-nodes", "shared-names-none", "unresolved-names-none"],
)
def test_a_verdict_becomes_the_failure_to_recover_from(found: SdcVerdict, evict_node: bool, ranks: tuple[int, ...]) -> None:
    failure = sdc_failure(found, node_of=NODES, evict_node=evict_node)
    assert (failure.kind, failure.ranks, failure.reason) == (Kind.SDC, ranks, found.explanation)
