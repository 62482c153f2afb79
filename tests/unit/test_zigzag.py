"""The zigzag layout and the ring's block decomposition, as pure functions."""

from __future__ import annotations

import pytest
import torch

from ringtrain.topology import sequence_positions
from ringtrain.train.attention.exchanges.ring import zigzag_block
from ringtrain.train.attention.zigzag import causal_work, cp_shard, cp_unshard, zigzag_shard, zigzag_unshard


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_zigzag_round_trip_and_chunk_order(world: int) -> None:
    x = torch.arange(2 * world * 3).reshape(1, -1)
    shards = [zigzag_shard(x, dim=1, world=world, rank=r) for r in range(world)]
    assert torch.equal(zigzag_unshard(shards, dim=1), x)
    for r, shard in enumerate(shards):
        first, second = shard[0, :3], shard[0, 3:]
        assert first.tolist() == list(range(3 * r, 3 * r + 3))
        assert second.tolist() == list(range(3 * (2 * world - 1 - r), 3 * (2 * world - r)))


@pytest.mark.parametrize(("ring", "ulysses"), [(1, 1), (4, 1), (1, 4), (2, 2), (3, 2), (2, 4)])
def test_cp_shard_is_the_topology_layout(ring: int, ulysses: int) -> None:
    seq = 2 * ring * ulysses * 3
    x = torch.arange(seq)[None, :, None]
    shards = []
    for cp_rank in range(ring * ulysses):
        shard = cp_shard(x, dim=1, ring=ring, ulysses=ulysses, cp_rank=cp_rank)
        ring_idx, ulysses_idx = divmod(cp_rank, ulysses)
        assert shard[0, :, 0].tolist() == sequence_positions(seq, ring, ulysses, ring_idx, ulysses_idx)
        shards.append(shard)
    assert torch.equal(cp_unshard(shards, dim=1, ring=ring, ulysses=ulysses), x)


def test_uneven_lengths_are_refused() -> None:
    with pytest.raises(ValueError, match="2x3"):
        zigzag_shard(torch.zeros(1, 10), dim=1, world=3, rank=0)
    with pytest.raises(ValueError, match="odd"):
        zigzag_unshard([torch.zeros(1, 3)], dim=1)


@pytest.mark.parametrize("world", [2, 4, 8])
def test_zigzag_balances_causal_work(world: int) -> None:
    work = causal_work(1024, world)
    assert max(work) == min(work)
    assert sum(work) == 1024 * 1025 // 2
    contiguous = causal_work(1024, world, zigzag=False)
    assert sum(contiguous) == sum(work) and max(contiguous) / min(contiguous) > 2 * world - 2


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("causal", [True, False])
def test_ring_blocks_cover_each_visible_pair_exactly_once(world: int, causal: bool) -> None:
    seq_local = 4
    seq = seq_local * world
    positions = [zigzag_shard(torch.arange(seq), dim=0, world=world, rank=r).tolist() for r in range(world)]
    covered = torch.zeros(seq, seq, dtype=torch.long)
    for rank in range(world):
        for step in range(world):
            source = (rank - step) % world
            blk = zigzag_block(source, rank, seq_local, causal=causal)
            rows, cols = positions[rank][blk.rows], positions[source][blk.cols]
            for i, qp in enumerate(rows):
                for j, kp in enumerate(cols):
                    visible = not blk.causal or j <= i  # top-left causal inside the block
                    covered[qp, kp] += int(visible)
    want = torch.ones(seq, seq, dtype=torch.long)
    if causal:
        want = want.tril()
    assert torch.equal(covered, want)


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_ring_blocks_are_balanced(world: int) -> None:
    seq_local = 8
    for rank in range(world):
        cells = 0
        for step in range(world):
            blk = zigzag_block((rank - step) % world, rank, seq_local, causal=True)
            rows = len(range(seq_local)[blk.rows])
            cols = len(range(seq_local)[blk.cols])
            cells += rows * cols // (2 if blk.causal else 1)
        assert cells == seq_local * seq_local // 2 + (world - 1) * seq_local * seq_local // 2
