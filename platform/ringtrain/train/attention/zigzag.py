"""The zigzag sequence layout of a context-parallel group, as tensor operations.

The sequence is cut into ``2 * world`` equal chunks and ring rank r holds chunks r and
``2*world-1-r``, concatenated in that order. Under a causal mask an early chunk sees few keys
and a late chunk many; pairing them gives every rank the same amount of work. With Ulysses
inside the ring (``cp = ring x ulysses``), each ring shard is then split contiguously into
``ulysses`` parts (see ``ringtrain.topology``, which owns the index arithmetic).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ringtrain.topology import zigzag_chunks


def zigzag_shard(x: torch.Tensor, *, dim: int, world: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s zigzag shard of the full sequence ``x`` along ``dim``."""
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} outside a ring of {world}")
    if x.shape[dim] % (2 * world):
        raise ValueError(f"sequence length {x.shape[dim]} does not split into 2x{world} zigzag chunks")
    chunks = x.chunk(2 * world, dim=dim)
    first, second = zigzag_chunks(world, rank)
    return torch.cat((chunks[first], chunks[second]), dim=dim)


def zigzag_unshard(shards: Sequence[torch.Tensor], *, dim: int) -> torch.Tensor:
    """Restore the original order from every rank's zigzag shard (``shards[r]`` from rank r)."""
    world = len(shards)
    chunks: list[torch.Tensor] = [torch.empty(0)] * (2 * world)
    for rank, shard in enumerate(shards):
        if shard.shape[dim] % 2:
            raise ValueError(f"shard of rank {rank} has odd length {shard.shape[dim]}; a zigzag shard has two halves")
        first, second = zigzag_chunks(world, rank)
        chunks[first], chunks[second] = shard.chunk(2, dim=dim)
    return torch.cat(chunks, dim=dim)


def cp_shard(x: torch.Tensor, *, dim: int, ring: int, ulysses: int, cp_rank: int) -> torch.Tensor:
    """CP rank ``cp_rank = ring_idx * ulysses + ulysses_idx``'s part of the full sequence ``x``."""
    ring_idx, ulysses_idx = divmod(cp_rank, ulysses)
    ring_shard = zigzag_shard(x, dim=dim, world=ring, rank=ring_idx)
    if ring_shard.shape[dim] % ulysses:
        raise ValueError(f"ring shard of length {ring_shard.shape[dim]} does not split into {ulysses} Ulysses parts")
    return ring_shard.chunk(ulysses, dim=dim)[ulysses_idx]


def cp_unshard(shards: Sequence[torch.Tensor], *, dim: int, ring: int, ulysses: int) -> torch.Tensor:
    """Inverse of ``cp_shard``: ``shards[c]`` is CP rank c's part."""
    if len(shards) != ring * ulysses:
        raise ValueError(f"{len(shards)} shards for a {ring}x{ulysses} CP group")
    ring_shards = [torch.cat(list(shards[r * ulysses : (r + 1) * ulysses]), dim=dim) for r in range(ring)]
    return zigzag_unshard(ring_shards, dim=dim)


def causal_work(seq_len: int, world: int, *, zigzag: bool = True) -> list[int]:
    """Visible (query, key) pairs under a causal mask that each rank's queries own.

    Query at position p sees p + 1 keys. A chunk of length L starting at cL therefore owns
    L*cL + L(L+1)/2 pairs; zigzag pairs chunk r with 2W-1-r, so every rank owns
    L^2 (2W-1) + L(L+1): exactly balanced. ``zigzag=False`` gives the contiguous split for comparison.
    """
    if seq_len % (2 * world):
        raise ValueError(f"sequence length {seq_len} does not split into 2x{world} chunks")

    def pairs(start: int, length: int) -> int:
        return length * start + length * (length + 1) // 2

    if not zigzag:
        part = seq_len // world
        return [pairs(r * part, part) for r in range(world)]
    chunk = seq_len // (2 * world)
    return [sum(pairs(c * chunk, chunk) for c in zigzag_chunks(world, r)) for r in range(world)]
