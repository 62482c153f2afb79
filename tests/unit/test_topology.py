"""The dp x cp grid: coordinates, process-group membership, and the sequence layout of a CP group."""

from __future__ import annotations

import itertools

import pytest

from ringtrain.topology import Topology, sequence_positions, sequence_spans, zigzag_chunks

SHAPES = [(1, 1, 1), (2, 1, 1), (1, 4, 1), (2, 4, 1), (3, 4, 2), (2, 4, 4), (2, 8, 2), (4, 6, 3), (1, 6, 2)]
SHAPE_IDS = [f"dp{dp}-cp{cp}-u{u}" for dp, cp, u in SHAPES]
shapes = pytest.mark.parametrize(("dp", "cp", "ulysses"), SHAPES, ids=SHAPE_IDS)


def _is_partition(groups: list[list[int]], world: int) -> bool:
    flat = [r for g in groups for r in g]
    return sorted(flat) == list(range(world)) and len(flat) == world


@shapes
def test_coords_round_trip(dp: int, cp: int, ulysses: int) -> None:
    topo = Topology(dp, cp, ulysses)
    assert topo.ring * topo.ulysses == cp
    assert topo.world_size == dp * cp
    seen = set()
    for rank in range(topo.world_size):
        c = topo.coord(rank)
        assert c.rank == rank
        assert 0 <= c.replica < dp and 0 <= c.ring_pos < cp
        assert 0 <= c.ring_idx < topo.ring and 0 <= c.ulysses_idx < ulysses
        assert c.ring_pos == c.ring_idx * ulysses + c.ulysses_idx
        assert topo.rank_of(c.replica, c.ring_pos) == rank
        seen.add((c.replica, c.ring_idx, c.ulysses_idx))
    assert len(seen) == topo.world_size


def test_rank_order_puts_one_replica_on_consecutive_ranks() -> None:
    topo = Topology(dp=2, cp=4, ulysses=2)
    assert topo.replica_ranks(1) == [4, 5, 6, 7]
    c = topo.coord(6)
    assert (c.replica, c.ring_pos, c.ring_idx, c.ulysses_idx) == (1, 2, 1, 0)
    assert topo.ulysses_groups() == [[0, 1], [2, 3], [4, 5], [6, 7]]  # all-to-all on neighbours
    assert topo.ring_groups() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert topo.dp_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]


@shapes
@pytest.mark.parametrize("kind", ["cp_groups", "dp_groups", "ring_groups", "ulysses_groups"])
def test_each_group_kind_partitions_the_world(dp: int, cp: int, ulysses: int, kind: str) -> None:
    topo = Topology(dp, cp, ulysses)
    groups = getattr(topo, kind)()
    expected_size = {"cp_groups": cp, "dp_groups": dp, "ring_groups": topo.ring, "ulysses_groups": ulysses}[kind]
    assert _is_partition(groups, topo.world_size)
    assert all(len(g) == expected_size for g in groups)


@shapes
def test_ring_and_ulysses_groups_nest_inside_cp_groups(dp: int, cp: int, ulysses: int) -> None:
    topo = Topology(dp, cp, ulysses)
    cp_sets = [set(g) for g in topo.cp_groups()]
    for group in topo.ring_groups() + topo.ulysses_groups():
        assert sum(set(group) <= s for s in cp_sets) == 1
    # a ring group and a Ulysses group of one replica meet in exactly one rank
    for ring_group, uly_group in itertools.product(topo.ring_groups(), topo.ulysses_groups()):
        same_replica = topo.coord(ring_group[0]).replica == topo.coord(uly_group[0]).replica
        assert len(set(ring_group) & set(uly_group)) == (1 if same_replica else 0)


@shapes
def test_dp_groups_hold_the_same_ring_pos(dp: int, cp: int, ulysses: int) -> None:
    topo = Topology(dp, cp, ulysses)
    for group in topo.dp_groups():
        assert len({topo.coord(r).ring_pos for r in group}) == 1
        assert sorted(topo.coord(r).replica for r in group) == list(range(dp))


@shapes
def test_ring_neighbours_form_one_cycle_per_ring_group(dp: int, cp: int, ulysses: int) -> None:
    topo = Topology(dp, cp, ulysses)
    for group in topo.ring_groups():
        start = group[0]
        visited, rank = [], start
        for _ in range(len(group)):
            visited.append(rank)
            prev, nxt = topo.ring_neighbours(rank)
            assert topo.ring_neighbours(nxt)[0] == rank  # next's previous is me
            assert topo.ring_neighbours(prev)[1] == rank  # previous's next is me
            rank = nxt
        assert rank == start  # back home after len(group) hops
        assert sorted(visited) == sorted(group)  # every member, once


def test_ring_of_one_is_its_own_neighbour() -> None:
    topo = Topology(dp=2, cp=2, ulysses=2)
    assert topo.ring_neighbours(3) == (3, 3)


@pytest.mark.parametrize(
    ("dp", "cp", "ulysses"),
    [(0, 1, 1), (1, 0, 1), (1, 2, 0), (1, 4, 3), (-1, 2, 1), (1, 2, 4)],
    ids=["dp0", "cp0", "ulysses0", "ulysses-not-dividing", "dp-negative", "ulysses-above-cp"],
)
def test_invalid_topology_raises(dp: int, cp: int, ulysses: int) -> None:
    with pytest.raises(ValueError, match="invalid topology"):
        Topology(dp, cp, ulysses)


@pytest.mark.parametrize("rank", [-1, 8, 100])
def test_coord_outside_the_world_raises(rank: int) -> None:
    with pytest.raises(ValueError, match="outside world"):
        Topology(dp=2, cp=4).coord(rank)


LAYOUTS = list(itertools.product(range(1, 5), range(1, 5)))


def _seq_len(ring: int, ulysses: int, repeat: int = 3) -> int:
    return 2 * ring * ulysses * repeat


@pytest.mark.parametrize(("ring", "ulysses"), LAYOUTS, ids=[f"r{r}-u{u}" for r, u in LAYOUTS])
def test_cp_ranks_cover_every_position_exactly_once(ring: int, ulysses: int) -> None:
    seq_len = _seq_len(ring, ulysses)
    cp = ring * ulysses
    held = []
    for ring_idx, ulysses_idx in itertools.product(range(ring), range(ulysses)):
        positions = sequence_positions(seq_len, ring, ulysses, ring_idx, ulysses_idx)
        spans = sequence_spans(seq_len, ring, ulysses, ring_idx, ulysses_idx)
        assert positions == [p for a, b in spans for p in range(a, b)]
        assert all(a < b for a, b in spans)
        assert len(positions) == seq_len // cp  # balanced
        held.extend(positions)
    assert sorted(held) == list(range(seq_len))


@pytest.mark.parametrize("ring", [1, 2, 3, 4, 8])
def test_pure_ring_is_zigzag_chunks(ring: int) -> None:
    seq_len = 2 * ring * 5
    chunk = seq_len // (2 * ring)
    for r in range(ring):
        assert zigzag_chunks(ring, r) == (r, 2 * ring - 1 - r)
        first, second = zigzag_chunks(ring, r)
        assert sequence_spans(seq_len, ring, 1, r, 0) == [
            (first * chunk, (first + 1) * chunk),
            (second * chunk, (second + 1) * chunk),
        ]


@pytest.mark.parametrize("ulysses", [1, 2, 3, 4, 8])
def test_pure_ulysses_is_a_contiguous_split(ulysses: int) -> None:
    seq_len = 2 * ulysses * 5
    part = seq_len // ulysses
    for u in range(ulysses):
        assert sequence_positions(seq_len, 1, ulysses, 0, u) == list(range(u * part, (u + 1) * part))


def test_hybrid_splits_the_ring_shard_across_ulysses() -> None:
    # ring 2 x ulysses 2, seq 16: chunks of 4; ring 0 holds [0,4)+[12,16), ring 1 holds [4,12)
    assert sequence_positions(16, 2, 2, 0, 0) == [0, 1, 2, 3]
    assert sequence_positions(16, 2, 2, 0, 1) == [12, 13, 14, 15]
    assert sequence_positions(16, 2, 2, 1, 0) == [4, 5, 6, 7]
    assert sequence_positions(16, 2, 2, 1, 1) == [8, 9, 10, 11]
    # ulysses 4 cuts a part across the two zigzag chunks: spans, in order
    assert sequence_spans(24, 2, 4, 0, 1) == [(3, 6)]
    assert sequence_spans(16, 1, 4, 0, 1) == [(4, 8)]
    assert sequence_spans(8, 2, 1, 0, 0) == [(0, 2), (6, 8)]


def test_a_ulysses_part_can_straddle_both_zigzag_chunks() -> None:
    # ring 2 x ulysses 3, seq 12: chunks of 3, ring 0 holds [0,3)+[9,12); each part is 2 tokens
    assert sequence_spans(12, 2, 3, 0, 1) == [(2, 3), (9, 10)]
    assert sequence_positions(12, 2, 3, 0, 1) == [2, 9]


@pytest.mark.parametrize(
    ("seq_len", "ring", "ulysses"),
    [(10, 3, 1), (7, 1, 1), (12, 2, 4), (8, 1, 3)],
    ids=["not-2x-ring", "odd", "ring-shard-not-by-ulysses", "not-by-ulysses"],
)
def test_sequence_spans_refuse_uneven_lengths(seq_len: int, ring: int, ulysses: int) -> None:
    with pytest.raises(ValueError, match="does not split"):
        sequence_spans(seq_len, ring, ulysses, 0, 0)
