"""Fault policy: which failure a step's outcomes show, and which recovery each failure gets.

Most decisions are for a dp=4 x cp=2 grid: replica d holds ranks 2d and 2d + 1, so rank 3 is
in replica 1 and rank 6 in replica 3.
"""

from __future__ import annotations

import math
from typing import Optional

import pytest

from ringtrain.policies.faults import (
    Action,
    Capacity,
    Decision,
    Failure,
    Kind,
    Outcome,
    RankOutcome,
    classify,
    decide,
    is_peer_failure,
    non_finite,
)

PEER_ERROR = "RuntimeError: [gloo] Connection closed by peer"
OWN_ERROR = "ValueError: input_ids has 3 dims, expected 2"


def ok(rank: int) -> RankOutcome:
    return RankOutcome(rank, Outcome.OK)


def died(rank: int, *, node_alive: bool = True) -> RankOutcome:
    return RankOutcome(rank, Outcome.DIED, node_alive=node_alive)


def lost(rank: int) -> RankOutcome:
    return RankOutcome(rank, Outcome.LOST)


def error(rank: int, text: str) -> RankOutcome:
    return RankOutcome(rank, Outcome.ERROR, error=text)


# --- classify ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "outcomes",
    [[], [ok(0)], [ok(0), ok(1), ok(2), ok(3)]],
    ids=["no-ranks", "one-rank", "four-ranks"],
)
def test_every_rank_finished_means_no_failure(outcomes: list[RankOutcome]) -> None:
    assert classify(outcomes) is None


def test_a_dead_process_is_a_crash_and_its_peers_errors_are_looked_through() -> None:
    failure = classify([ok(0), error(1, PEER_ERROR), died(2), error(3, PEER_ERROR)])

    assert failure is not None
    assert (failure.kind, failure.ranks) == (Kind.CRASH, (2,))


def test_ranks_still_stuck_when_a_rank_died_are_lost_with_it() -> None:
    # Died 5 and lost 1, 3 in no particular order: the failed ranks are all three, sorted.
    failure = classify([lost(3), ok(0), died(5), ok(2), lost(1), ok(4)])

    assert failure is not None
    assert (failure.kind, failure.ranks) == (Kind.CRASH, (1, 3, 5))
    assert "[1, 3, 5]" in failure.reason


def test_a_dead_rank_whose_node_is_gone_is_a_node_loss_that_takes_the_lost_ranks_too() -> None:
    failure = classify([died(0, node_alive=False), died(1, node_alive=False), lost(2), ok(3)])

    assert failure is not None
    assert (failure.kind, failure.ranks) == (Kind.NODE_LOST, (0, 1, 2))


def test_one_dead_rank_on_a_lost_node_makes_the_whole_failure_a_node_loss() -> None:
    failure = classify([died(1, node_alive=True), died(3, node_alive=False), ok(0), ok(2)])

    assert failure is not None
    assert (failure.kind, failure.ranks) == (Kind.NODE_LOST, (1, 3))


def test_ranks_that_stop_answering_without_a_death_are_a_hang() -> None:
    failure = classify([ok(0), lost(2), error(1, PEER_ERROR), lost(3)])

    assert failure is not None
    assert (failure.kind, failure.ranks) == (Kind.HANG, (2, 3))


def test_an_own_exception_among_peer_failures_names_only_the_rank_that_raised() -> None:
    failure = classify([error(0, PEER_ERROR), error(1, PEER_ERROR), error(2, OWN_ERROR), error(3, PEER_ERROR)])

    assert failure is not None
    assert (failure.kind, failure.ranks) == (Kind.ERROR, (2,))
    assert OWN_ERROR in failure.reason and "rank 2" in failure.reason


def test_two_own_exceptions_name_both_ranks() -> None:
    failure = classify([error(3, "KeyError: 'labels'"), ok(0), error(1, OWN_ERROR), error(2, PEER_ERROR)])

    assert failure is not None
    assert (failure.kind, failure.ranks) == (Kind.ERROR, (1, 3))


def test_only_peer_failures_blame_every_rank_that_reported_one() -> None:
    # Nobody raised first-hand (a collective timed out everywhere): no rank can be singled out.
    failure = classify([ok(0), error(1, "TimeoutError: timed out"), error(2, PEER_ERROR)])

    assert failure is not None
    assert (failure.kind, failure.ranks) == (Kind.ERROR, (1, 2))


@pytest.mark.parametrize(
    "text",
    [
        "RuntimeError: Connection closed by peer",
        "ConnectionResetError: [Errno 104] Connection reset by peer",
        "ConnectionRefusedError: [Errno 111] Connection refused",
        "BrokenPipeError: [Errno 32] Broken pipe",
        "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:598] Read error [10.0.0.2]:51234",
        "DistBackendError: NCCL communicator was aborted on rank 3",
        "RuntimeError: Timed out waiting 1800000ms for send operation to complete",
        "DistStoreError: Socket Timeout",
        "RuntimeError: ProcessGroup is shut down",
    ],
)
def test_errors_of_a_collective_that_lost_a_peer(text: str) -> None:
    assert is_peer_failure(text)


@pytest.mark.parametrize(
    "text",
    [
        "",
        OWN_ERROR,
        "ZeroDivisionError: division by zero",
        "KeyError: 'input_ids'",
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB",
        "AssertionError: sequence length 1000 is not divisible by 8",
    ],
)
def test_errors_of_a_rank_s_own_code(text: str) -> None:
    assert not is_peer_failure(text)


@pytest.mark.parametrize(
    "kind, lost_workers",
    [(Kind.CRASH, True), (Kind.NODE_LOST, True), (Kind.HANG, True), (Kind.ERROR, False), (Kind.NAN, False), (Kind.SDC, True)],
)
def test_which_failures_leave_seats_to_fill(kind: Kind, lost_workers: bool) -> None:
    assert Failure(kind, (0,), "").lost_workers is lost_workers


def test_a_corrupting_rank_is_evicted_like_a_lost_one() -> None:
    spare = decide_for(Failure(Kind.SDC, (2,), "gemm"), spares=1)
    shrink = decide_for(Failure(Kind.SDC, (2,), "gemm"), dp=4, min_dp=1)

    assert (spare.action, spare.spares_used, spare.dp_after) == (Action.REPLACE, 1, 4)
    assert (shrink.action, shrink.dp_after, shrink.evict_replicas) == (Action.SHRINK, 3, (1,))  # cp=2


def test_a_scan_that_names_no_rank_rolls_back_in_place() -> None:
    failure = Failure(Kind.SDC, (), "every rank changed alike")
    decision = decide_for(failure, spares=2)

    assert not failure.lost_workers
    assert (decision.action, decision.dp_after, decision.spares_used, decision.skip_batch) == (Action.ROLLBACK, 4, 0, False)
    assert "last clean scan" in decision.reason


# --- non_finite -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "losses, ranks",
    [
        ({0: 2.5, 1: math.nan}, (1,)),
        ({2: math.inf, 0: -math.inf, 1: 3.0}, (0, 2)),
        ({0: math.nan, 1: math.nan}, (0, 1)),
        ({0: 2.5, 1: 0.0, 2: -1.0}, None),
        ({}, None),
    ],
    ids=["one-nan", "both-infinities-sorted", "all-nan", "all-finite", "no-ranks"],
)
def test_non_finite_names_the_ranks_whose_own_loss_went_bad(losses: dict[int, float], ranks: Optional[tuple[int, ...]]) -> None:
    failure = non_finite(losses, step=7)

    if ranks is None:
        assert failure is None
    else:
        assert failure is not None
        assert (failure.kind, failure.ranks) == (Kind.NAN, ranks)
        assert "step 7" in failure.reason


# --- decide -----------------------------------------------------------------------------


def crash(*ranks: int, kind: Kind = Kind.CRASH) -> Failure:
    return Failure(kind, ranks, "test")


def decide_for(
    failure: Failure,
    *,
    dp: int = 4,
    cp: int = 2,
    min_dp: int = 1,
    spares: int = 0,
    free_slots: int = 0,
    recoveries: int = 0,
    max_recoveries: int = 20,
    on_nan: str = "skip",
) -> Decision:
    return decide(
        failure,
        dp=dp,
        cp=cp,
        min_dp=min_dp,
        capacity=Capacity(spares, free_slots),
        recoveries=recoveries,
        max_recoveries=max_recoveries,
        on_nan=on_nan,
    )


@pytest.mark.parametrize("kind", [Kind.CRASH, Kind.NODE_LOST, Kind.HANG])
@pytest.mark.parametrize(
    "ranks, dp, min_dp, spares, free_slots, action, dp_after, evict, spares_used",
    [
        # One lost rank, one spare: the spare takes the seat even though dp could shrink.
        ((3,), 4, 1, 1, 0, Action.REPLACE, 4, (), 1),
        # Two lost ranks of two replicas, two spares: still a replace.
        ((1, 6), 4, 1, 2, 0, Action.REPLACE, 4, (), 2),
        # Two lost ranks of one replica (2 // 2 = 3 // 2 = 1) and one spare: not enough, shrink by one.
        ((2, 3), 4, 1, 1, 0, Action.SHRINK, 3, (1,), 0),
        # Ranks 1 and 6 break replicas 0 and 3: 4 - 2 = 2 >= min_dp 2, free slots are not needed.
        ((1, 6), 4, 2, 0, 8, Action.SHRINK, 2, (0, 3), 0),
        # Shrinking to exactly min_dp is allowed.
        ((3,), 2, 1, 0, 0, Action.SHRINK, 1, (1,), 0),
        # dp=2 cannot lose a replica under min_dp=2: one free slot starts a new worker.
        ((3,), 2, 2, 0, 1, Action.REPLACE, 2, (), 0),
        # Two lost seats: the one spare and one new worker fill them.
        ((2, 3), 2, 2, 1, 1, Action.REPLACE, 2, (), 1),
        # dp=4 - 2 broken = 2 < min_dp 3; 1 spare + 0 free < 2 lost: no way forward.
        ((1, 6), 4, 3, 1, 0, Action.ABORT, 4, (), 0),
        # Nothing at all to replace the seat with and no room to shrink.
        ((3,), 2, 2, 0, 0, Action.ABORT, 2, (), 0),
    ],
    ids=[
        "spare-beats-shrink",
        "spares-for-two-replicas",
        "too-few-spares-shrink",
        "shrink-two-replicas-beats-new-workers",
        "shrink-to-min-dp",
        "new-worker-at-min-dp",
        "spare-plus-new-worker",
        "abort-too-few-of-both",
        "abort-nothing",
    ],
)
def test_lost_workers_priority_spares_then_shrink_then_new_workers_then_abort(
    kind: Kind,
    ranks: tuple[int, ...],
    dp: int,
    min_dp: int,
    spares: int,
    free_slots: int,
    action: Action,
    dp_after: int,
    evict: tuple[int, ...],
    spares_used: int,
) -> None:
    decision = decide_for(crash(*ranks, kind=kind), dp=dp, min_dp=min_dp, spares=spares, free_slots=free_slots)

    assert (decision.action, decision.dp_after, decision.evict_replicas, decision.spares_used) == (
        action,
        dp_after,
        evict,
        spares_used,
    )
    assert decision.skip_batch is False


def test_a_shrink_and_an_abort_say_which_setting_bounds_them() -> None:
    shrink = decide_for(crash(3), dp=4, min_dp=2)
    abort = decide_for(crash(3), dp=2, min_dp=2)

    assert "mesh.min_dp=2" in shrink.reason and "dp 4 -> 3" in shrink.reason
    assert "mesh.min_dp=2" in abort.reason


def test_a_rank_s_own_exception_rolls_back_in_place_whatever_the_capacity() -> None:
    decision = decide_for(Failure(Kind.ERROR, (2,), "ValueError"), spares=4, free_slots=4)

    assert (decision.action, decision.dp_after, decision.spares_used, decision.skip_batch) == (Action.ROLLBACK, 4, 0, False)


@pytest.mark.parametrize(
    "on_nan, action, skip",
    [("skip", Action.ROLLBACK, True), ("retry", Action.ROLLBACK, False), ("abort", Action.ABORT, False)],
)
def test_a_non_finite_loss_follows_on_nan(on_nan: str, action: Action, skip: bool) -> None:
    decision = decide_for(Failure(Kind.NAN, (1,), "nan"), on_nan=on_nan, spares=1)

    assert (decision.action, decision.skip_batch, decision.dp_after) == (action, skip, 4)
    assert f"controllers.on_nan={on_nan}" in decision.reason


@pytest.mark.parametrize(
    "failure",
    [crash(3), crash(3, kind=Kind.NODE_LOST), crash(3, kind=Kind.HANG), Failure(Kind.ERROR, (0,), ""), Failure(Kind.NAN, (0,), "")],
    ids=lambda f: f.kind.value,
)
@pytest.mark.parametrize(
    "recoveries, max_recoveries, aborts",
    [(0, 0, True), (2, 3, False), (3, 3, True), (5, 3, True)],
    ids=["none-allowed", "one-left", "used-up", "beyond"],
)
def test_max_recoveries_caps_every_kind_of_failure(failure: Failure, recoveries: int, max_recoveries: int, aborts: bool) -> None:
    # Spares and room to shrink are plenty: only the cap can abort.
    decision = decide_for(failure, spares=4, free_slots=4, recoveries=recoveries, max_recoveries=max_recoveries)

    assert (decision.action is Action.ABORT) is aborts
    if aborts:
        assert f"controllers.max_recoveries={max_recoveries}" in decision.reason
