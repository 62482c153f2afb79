"""Snapshot policy: which copy of the state a restore uses, and which steps are persisted."""

from __future__ import annotations

import itertools

import pytest

from ringtrain.controllers.snapshots import Candidate, Source, choose_restore_point, persist_due


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
