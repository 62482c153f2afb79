"""Snapshot policy: which copy of the state a restore uses, and which steps are persisted."""

from __future__ import annotations

import itertools

import pytest

from typing import Optional

from ringtrain.checkpoint.retention import retained
from ringtrain.policies.snapshots import (
    Candidate,
    Holding,
    RestorePlan,
    Source,
    choose_restore_point,
    persist_due,
    plan_restore,
)


def candidate(source: Source, step: int, ranks: range | set[int] = range(4), world_size: int = 4) -> Candidate:
    return Candidate(source, step, frozenset(ranks), world_size, f"{source.name.lower()}@{step}")


@pytest.mark.parametrize(
    "ranks, world_size, complete",
    [(range(4), 4, True), ({0, 1, 3}, 4, False), (set(), 2, False), ({0, 1, 2}, 2, False), (range(2), 2, True)],
    ids=["all", "one-missing", "none", "a-rank-beyond-the-world", "smaller-world"],
)
def test_complete_means_every_rank_of_the_writing_world(ranks: set[int], world_size: int, complete: bool) -> None:
    assert candidate(Source.PEER, 3, ranks, world_size).complete is complete


def test_the_newest_complete_step_wins_over_a_cheaper_older_one() -> None:
    older_peer = candidate(Source.PEER, 9)
    newer_durable = candidate(Source.DURABLE, 10)

    assert choose_restore_point([older_peer, newer_durable]) == newer_durable


@pytest.mark.parametrize("order", list(itertools.permutations(Source)), ids=lambda o: "-".join(s.name for s in o))
def test_at_equal_steps_the_cheapest_source_wins(order: tuple[Source, ...]) -> None:
    chosen = choose_restore_point([candidate(source, 10) for source in order])

    assert chosen is not None and chosen.source is Source.PEER


@pytest.mark.parametrize(
    "sources, expected",
    [((Source.NODE, Source.DURABLE), Source.NODE), ((Source.DURABLE,), Source.DURABLE)],
    ids=["node-before-durable", "durable-alone"],
)
def test_the_cheapest_source_that_has_the_step(sources: tuple[Source, ...], expected: Source) -> None:
    chosen = choose_restore_point([candidate(s, 10) for s in reversed(sources)])

    assert chosen is not None and chosen.source is expected


def test_incomplete_candidates_are_ignored_however_new_or_cheap() -> None:
    partial_peer = candidate(Source.PEER, 12, ranks={0, 1, 2})
    partial_node = candidate(Source.NODE, 11, ranks={1, 2, 3})
    durable = candidate(Source.DURABLE, 10)

    assert choose_restore_point([partial_peer, partial_node, durable]) == durable


@pytest.mark.parametrize(
    "candidates",
    [[], [candidate(Source.PEER, 5, ranks={0}), candidate(Source.DURABLE, 4, ranks={1, 2, 3})]],
    ids=["no-candidates", "only-incomplete"],
)
def test_no_complete_candidate_means_no_restore_point(candidates: list[Candidate]) -> None:
    assert choose_restore_point(candidates) is None


def test_candidates_may_come_from_a_one_shot_iterator() -> None:
    best = candidate(Source.NODE, 7)

    assert choose_restore_point(iter([candidate(Source.DURABLE, 7), best])) == best


@pytest.mark.parametrize(
    "step, persist_every, final_step, due",
    [
        (50, 50, 150, True),
        (100, 50, 150, True),
        (49, 50, 150, False),
        (51, 50, 150, False),
        (150, 50, 150, True),  # a multiple and the final step
        (7, 5, 7, True),  # the final step, not a multiple
        (6, 5, 7, False),
        (1, 1, 10, True),
        (5, 0, 10, False),  # 0: only the final step
        (10, 0, 10, True),
    ],
)
def test_persist_every_n_steps_and_always_the_final_one(
    step: int, persist_every: int, final_step: int, due: bool
) -> None:
    assert persist_due(step, persist_every=persist_every, final_step=final_step) is due


def test_persist_every_zero_persists_exactly_the_final_step() -> None:
    due = [s for s in range(1, 21) if persist_due(s, persist_every=0, final_step=20)]

    assert due == [20]


def test_persist_every_n_over_a_run() -> None:
    due = [s for s in range(1, 24) if persist_due(s, persist_every=5, final_step=23)]

    assert due == [5, 10, 15, 20, 23]


# --- plan_restore: shard by shard, across holdings --------------------------------------


def holding(source: Source, location: str, shards: dict[int, set[int] | range], worlds: Optional[dict[int, int]] = None) -> Holding:
    """``shards``: step -> the ranks held; ``worlds``: step -> world size (default 4 for each step held)."""
    pairs = frozenset((step, rank) for step, ranks in shards.items() for rank in ranks)
    sizes = worlds if worlds is not None else {step: 4 for step in shards}
    return Holding(source, location, pairs, tuple(sorted(sizes.items())))


def test_one_holding_with_every_shard_of_a_step() -> None:
    plan = plan_restore([holding(Source.NODE, "node:a", {5: range(4)})])

    assert plan == RestorePlan(5, 4, ((0, "node:a"), (1, "node:a"), (2, "node:a"), (3, "node:a")))


def test_the_shards_of_one_step_may_come_from_different_places() -> None:
    # Survivors 0, 1, 2 hold their own shard; rank 3 died and only its node holder has its shard.
    peers = [holding(Source.PEER, f"peer:{r}", {7: {r}}) for r in range(3)]
    node = holding(Source.NODE, "node:b", {7: {2, 3}})

    plan = plan_restore([node, *peers])

    assert plan == RestorePlan(7, 4, ((0, "peer:0"), (1, "peer:1"), (2, "peer:2"), (3, "node:b")))


@pytest.mark.parametrize("order", list(itertools.permutations(Source)), ids=lambda o: "-".join(s.name for s in o))
def test_each_shard_comes_from_the_cheapest_place_that_has_it(order: tuple[Source, ...]) -> None:
    # PEER holds rank 0 only, NODE ranks 0-1, DURABLE all four: 0 from the peer, 1 from the
    # node, 2-3 from the durable store, whatever order the holdings come in.
    ranks = {Source.PEER: {0}, Source.NODE: {0, 1}, Source.DURABLE: set(range(4))}
    holdings = [holding(source, source.name.lower(), {3: ranks[source]}) for source in order]

    plan = plan_restore(holdings)

    assert plan is not None
    assert plan.fetch == ((0, "peer"), (1, "node"), (2, "durable"), (3, "durable"))


def test_the_newest_whole_step_wins_even_when_an_older_one_is_cheaper() -> None:
    peer = holding(Source.PEER, "peer", {4: range(4)})
    node = holding(Source.NODE, "node", {5: range(4)})

    plan = plan_restore([peer, node])

    assert plan is not None and (plan.step, {where for _, where in plan.fetch}) == (5, {"node"})


def test_a_step_missing_one_shard_everywhere_falls_back_to_an_older_whole_step() -> None:
    # Step 6: rank 2's shard is nowhere. Step 5 is whole across the two holders.
    a = holding(Source.NODE, "node:a", {6: {0, 1}, 5: {0, 1}})
    b = holding(Source.NODE, "node:b", {6: {3}, 5: {2, 3}})

    plan = plan_restore([a, b])

    assert plan == RestorePlan(5, 4, ((0, "node:a"), (1, "node:a"), (2, "node:b"), (3, "node:b")))


@pytest.mark.parametrize("newest, step", [(None, 9), (9, 9), (8, 7), (7, 7), (6, None)])
def test_newest_caps_the_step(newest: Optional[int], step: Optional[int]) -> None:
    node = holding(Source.NODE, "node", {7: range(4), 9: range(4)})

    plan = plan_restore([node], newest=newest)

    assert (plan.step if plan else None) == step


def test_a_step_s_world_size_is_the_one_its_snapshot_was_written_at() -> None:
    # Step 8 was written by 2 ranks (after a shrink), step 6 by 4: only ranks 0-1 of step 8 needed.
    node = holding(Source.NODE, "node", {8: {0, 1}, 6: range(4)}, worlds={8: 2, 6: 4})

    assert plan_restore([node]) == RestorePlan(8, 2, ((0, "node"), (1, "node")))


@pytest.mark.parametrize(
    "holdings",
    [
        [],
        [holding(Source.PEER, "peer:0", {5: {0}}), holding(Source.NODE, "node", {5: {1, 2}})],
        # Shards held, but no holding says how many ranks wrote step 5: it cannot be judged whole.
        [holding(Source.NODE, "node", {5: range(4)}, worlds={})],
    ],
    ids=["no-holdings", "rank-3-nowhere", "unknown-world-size"],
)
def test_no_whole_step_means_no_plan(holdings: list[Holding]) -> None:
    assert plan_restore(holdings) is None


def test_holdings_may_come_from_a_one_shot_iterator() -> None:
    plan = plan_restore(iter([holding(Source.DURABLE, "d", {2: range(4)}), holding(Source.PEER, "p", {2: range(4)})]))

    assert plan is not None and {where for _, where in plan.fetch} == {"p"}


@pytest.mark.parametrize(
    "steps, keep, pin, held",
    [
        ([1, 2, 3, 4], 2, None, {3, 4}),
        ([1, 2, 3, 4], 2, 1, {1, 3, 4}),
        ([2, 4, 6, 8], 2, 5, {4, 6, 8}),  # the newest at or before the pin
        ([2, 4, 6, 8], 2, 7, {6, 8}),  # already among the newest
        ([4, 6], 1, 3, {6}),  # nothing at or before the pin: nothing extra
        ([], 2, 3, set()),
    ],
)
def test_retention_keeps_the_newest_and_the_pinned_snapshot(steps: list[int], keep: int, pin: Optional[int], held: set[int]) -> None:
    assert retained(steps, keep=keep, pin=pin) == held
