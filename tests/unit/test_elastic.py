"""Elastic policy: which dp sizes a global batch allows, who sits where after a resize, and
when growth is allowed (a gate with hysteresis, fed clock values by the test)."""

from __future__ import annotations

import itertools
from typing import Optional

import pytest

from ringtrain.policies.elastic import GrowGate, allowed_dps, evicted, reseat, target_dp

# --- allowed_dps / target_dp ------------------------------------------------------------


@pytest.mark.parametrize(
    "global_batch, micro_batch, min_dp, max_dp, dps",
    [
        # 12 = dp x 1 x accum: the divisors of 12 up to 8 (5, 7 and 8 do not divide it).
        (12, 1, 1, 8, [1, 2, 3, 4, 6]),
        # dp x 2 must divide 12: dp 1, 2, 3, 6 (dp 4 needs 8 | 12, which fails).
        (12, 2, 1, 8, [1, 2, 3, 6]),
        # The bounds are inclusive at both ends.
        (8, 1, 2, 4, [2, 4]),
        (8, 1, 4, 8, [4, 8]),
        # No dp in [5, 7] divides 8.
        (8, 1, 5, 7, []),
        # A micro-batch that does not divide the global batch allows nothing.
        (6, 4, 1, 4, []),
        (4, 1, 3, 2, []),  # min_dp > max_dp
        (4, 1, 1, 1, [1]),
    ],
)
def test_allowed_dps_divide_the_global_batch_into_whole_micro_batches(
    global_batch: int, micro_batch: int, min_dp: int, max_dp: int, dps: list[int]
) -> None:
    assert allowed_dps(global_batch=global_batch, micro_batch=micro_batch, min_dp=min_dp, max_dp=max_dp) == dps


@pytest.mark.parametrize(
    "replicas, min_dp, max_dp, dp",
    [
        (5, 1, 8, 4),  # allowed for 12: 1 2 3 4 6; 6 does not fit in 5
        (6, 1, 8, 6),
        (100, 1, 4, 4),  # capped by max_dp
        (3, 1, 8, 3),
        (1, 1, 8, 1),
        (1, 2, 8, None),  # below min_dp
        (0, 1, 8, None),
        (5, 5, 5, None),  # 5 does not divide 12
    ],
)
def test_target_dp_is_the_largest_allowed_dp_that_fits(replicas: int, min_dp: int, max_dp: int, dp: Optional[int]) -> None:
    assert target_dp(replicas, global_batch=12, micro_batch=1, min_dp=min_dp, max_dp=max_dp) == dp


# --- reseat / evicted -------------------------------------------------------------------

N = None


@pytest.mark.parametrize(
    "dp, cp, lost, new_dp, seats",
    [
        (2, 2, set(), 2, [0, 1, 2, 3]),
        # Replace: the broken replica keeps its survivor in place, the lost seat is empty.
        (2, 2, {3}, 2, [0, 1, 2, N]),
        (2, 2, {2, 3}, 2, [0, 1, N, N]),
        # Shrink by one: the broken replica 1 goes, 0, 2 and 3 keep their rings.
        (4, 2, {3}, 3, [0, 1, 4, 5, 6, 7]),
        # Shrink with nothing lost: the highest-numbered replicas go.
        (4, 2, set(), 2, [0, 1, 2, 3]),
        # Shrink by two with one broken (replica 1): it goes first, then the highest, replica 3.
        (4, 2, {2}, 2, [0, 1, 4, 5]),
        # Two broken (1 and 2), one goes: the keep order is healthy 0, 3, then broken 1, 2; the
        # first three (0, 3, 1) are seated in replica order, broken 1 with its lost seat empty.
        (4, 2, {2, 5}, 3, [0, 1, N, 3, 6, 7]),
        # Growth: old replicas first, the new replicas' seats appended empty.
        (2, 2, set(), 4, [0, 1, 2, 3, N, N, N, N]),
        (2, 2, {1}, 3, [0, N, 2, 3, N, N]),
        # No context parallelism: one rank per replica.
        (3, 1, {1}, 2, [0, 2]),
        (3, 1, {1}, 3, [0, N, 2]),
        (1, 4, {2}, 1, [0, 1, N, 3]),
    ],
)
def test_reseat(dp: int, cp: int, lost: set[int], new_dp: int, seats: list[Optional[int]]) -> None:
    assert reseat(dp=dp, cp=cp, lost=frozenset(lost), new_dp=new_dp) == seats


@pytest.mark.parametrize(
    "dp, cp, lost, new_dp, gone",
    [
        (2, 2, {3}, 2, []),  # replace: nobody alive leaves
        (4, 2, {3}, 3, [2]),  # rank 3's ring partner goes with the broken replica
        (4, 2, {2}, 2, [3, 6, 7]),  # the broken replica's survivor and the whole of replica 3
        (4, 2, set(), 2, [4, 5, 6, 7]),
        (2, 2, set(), 4, []),  # growth evicts nobody
        (2, 2, {2, 3}, 1, []),  # the broken replica had no survivor
    ],
)
def test_evicted_are_the_live_ranks_without_a_seat(dp: int, cp: int, lost: set[int], new_dp: int, gone: list[int]) -> None:
    seats = reseat(dp=dp, cp=cp, lost=frozenset(lost), new_dp=new_dp)

    assert evicted(dp=dp, cp=cp, seats=seats, lost=frozenset(lost)) == gone


def _cases() -> list[tuple[int, int, frozenset[int], int]]:
    out = []
    for dp, cp in itertools.product(range(1, 5), range(1, 4)):
        world = range(dp * cp)
        losses = [frozenset(c) for k in range(3) for c in itertools.combinations(world, k)]
        out += [(dp, cp, lost, new_dp) for lost in losses for new_dp in range(1, 6)]
    return out


def test_reseat_invariants_over_small_grids() -> None:
    """Every old rank is seated at most once, in its own ring position; no lost rank is seated;
    seated, evicted and lost ranks partition the old world; a shrink keeps whole replicas and
    gives up broken ones before healthy ones, and healthy ones from the highest number down."""
    for dp, cp, lost, new_dp in _cases():
        seats = reseat(dp=dp, cp=cp, lost=lost, new_dp=new_dp)
        seated = [r for r in seats if r is not None]
        gone = evicted(dp=dp, cp=cp, seats=seats, lost=lost)
        case = (dp, cp, sorted(lost), new_dp)

        assert len(seats) == new_dp * cp, case
        assert len(seated) == len(set(seated)) and not set(seated) & lost, case
        assert all(r % cp == i % cp for i, r in enumerate(seats) if r is not None), case
        assert sorted(seated + gone + sorted(lost)) == list(range(dp * cp)), case
        # Replicas keep their rings: the seats of a new replica come from one old replica.
        old_of_new = [{r // cp for r in seats[d * cp : (d + 1) * cp] if r is not None} for d in range(new_dp)]
        assert all(len(olds) <= 1 for olds in old_of_new), case
        kept = sorted(d for olds in old_of_new for d in olds)
        broken = {r // cp for r in lost}
        if new_dp <= dp:
            healthy = [d for d in range(dp) if d not in broken]
            kept_healthy = [d for d in kept if d not in broken]
            # The lowest-numbered healthy replicas stay, as many as fit ...
            assert kept_healthy == healthy[:new_dp], case
            # ... and a broken one stays only when every healthy one did.
            if any(d in broken for d in kept):
                assert kept_healthy == healthy, case
        else:
            assert seats[dp * cp :] == [None] * ((new_dp - dp) * cp), case


# --- GrowGate ---------------------------------------------------------------------------


def test_the_gate_opens_only_after_after_s_of_continuous_capacity() -> None:
    gate = GrowGate(after_s=10.0)

    assert gate.observe(100.0, current_dp=2, possible_dp=3) is None  # first seen at 100
    assert gate.observe(105.0, current_dp=2, possible_dp=3) is None
    assert gate.observe(109.5, current_dp=2, possible_dp=3) is None
    assert gate.observe(110.0, current_dp=2, possible_dp=3) == 3  # 110 - 100 = after_s exactly
    assert gate.observe(111.0, current_dp=2, possible_dp=3) == 3  # stays open while capacity stays


@pytest.mark.parametrize("gap", [None, 2, 1], ids=["no-capacity", "only-current-dp", "less-than-current"])
def test_a_gap_in_capacity_restarts_the_clock(gap: Optional[int]) -> None:
    gate = GrowGate(after_s=10.0)

    assert gate.observe(0.0, current_dp=2, possible_dp=3) is None
    assert gate.observe(9.0, current_dp=2, possible_dp=gap) is None  # the node flapped out
    assert gate.observe(10.0, current_dp=2, possible_dp=3) is None  # back: seen since 10, not 0
    assert gate.observe(19.0, current_dp=2, possible_dp=3) is None
    assert gate.observe(20.0, current_dp=2, possible_dp=3) == 3


def test_reset_restarts_the_clock() -> None:
    gate = GrowGate(after_s=5.0)
    assert gate.observe(0.0, current_dp=1, possible_dp=2) is None

    gate.reset()  # e.g. a recovery changed the world

    assert gate.observe(6.0, current_dp=1, possible_dp=2) is None  # would have opened without the reset
    assert gate.observe(10.0, current_dp=1, possible_dp=2) is None
    assert gate.observe(11.0, current_dp=1, possible_dp=2) == 2  # 11 - 6 = 5


def test_zero_after_s_opens_at_the_first_sight_of_capacity() -> None:
    gate = GrowGate(after_s=0.0)

    assert gate.observe(3.0, current_dp=1, possible_dp=1) is None
    assert gate.observe(3.0, current_dp=1, possible_dp=2) == 2


def test_less_capacity_than_before_restarts_the_clock_more_keeps_it() -> None:
    gate = GrowGate(after_s=10.0)

    assert gate.observe(0.0, current_dp=1, possible_dp=3) is None
    # Capacity for 4 replicas joins: growth was already pending since 0, the clock keeps running.
    assert gate.observe(4.0, current_dp=1, possible_dp=4) is None
    # Capacity shrinks to 2 (part of it went away): counted from 6 now.
    assert gate.observe(6.0, current_dp=1, possible_dp=2) is None
    assert gate.observe(10.0, current_dp=1, possible_dp=2) is None
    assert gate.observe(16.0, current_dp=1, possible_dp=2) == 2


def test_growth_pending_since_the_first_sight_opens_at_the_larger_size() -> None:
    gate = GrowGate(after_s=10.0)

    assert gate.observe(0.0, current_dp=1, possible_dp=2) is None
    assert gate.observe(5.0, current_dp=1, possible_dp=3) is None
    assert gate.observe(10.0, current_dp=1, possible_dp=3) == 3  # 10 - 0: the clock started at 0
