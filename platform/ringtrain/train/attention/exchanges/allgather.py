"""All-gathered K/V: a ring's ranks gather the whole sequence's K and V at once and attend their
own queries to it, for short blocks on rings of four ranks or more (``call.choose_exchange``).

A ring of R ranks passes K/V blocks R - 1 times, and each step costs a kernel launch, a merge and
a P2P round trip whatever the block's length; at a few thousand tokens per rank those fixed costs
outweigh the attention itself (bench/attention.py on an H200, 2K tokens a rank on a ring of 8:
the ring's forward at 0.17 of a monolithic call's speed, gathered K/V's at 0.30). Gathering K/V
first, as Llama 3's context parallelism does (Dubey et al. 2024, "The Llama 3 Herd of Models",
section 3.3.2), takes the same bytes in one collective (under GQA K/V are a fraction of Q), after
which each rank runs a fixed number of kernel calls however many ranks there are:

- causal: rank r holds zigzag chunks r and 2R-1-r of L tokens. Chunk c's queries see keys
  [0, cL) in full and keys [cL, (c+1)L) causally: one causal block of the chunk's rows against
  keys [0, (c+1)L), its rows the last of its columns. Two kernel calls a rank and no merge where
  the kernel runs such a block at once (flash-attn at any length unless documents or a window
  cut it, a mask on a short block); otherwise the plan splits it into the square diagonal and the
  prefix (``plan``): a call and a merge more for each chunk but the sequence's first.
- non-causal: the local queries against every key, one call.

The backward accumulates dK/dV over the whole gathered sequence, and a reduce-scatter hands each
rank the sum for its own shard.

Shape legend: B batch, K key/value heads, S local sequence (two zigzag chunks of L = S/2), N the
whole sequence (R S), D head dim, R ranks in the ring; the sequence dim is the kernel's.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator

import torch

from ringtrain.topology import zigzag_chunks
from ringtrain.train.attention.accumulator import VisitAccumulator
from ringtrain.train.attention.blocks import ALL, Block
from ringtrain.train.attention.block_kernel import accumulation_dtype
from ringtrain.train.attention.exchanges.base import ALL_SOURCES, KV, Exchange, Tensor, VisitBackward, VisitSpec


def allgather_blocks(rank: int, world: int, seq_local: int, *, causal: bool) -> list[Block]:
    """The blocks rank ``rank`` computes, rows of its shard against columns of the gathered
    sequence: under a causal mask each chunk's rows against every key up to its own last."""
    if not causal:
        return [Block(ALL, ALL, causal=False)]
    half = seq_local // 2
    return [Block(slice(i * half, (i + 1) * half), slice(0, (chunk + 1) * half), causal=True)
            for i, chunk in enumerate(zigzag_chunks(world, rank))]


@functools.lru_cache(maxsize=64)
def _chunk_order(world: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """(sequence order, its inverse) of the 2R chunks as gathered, rank by rank, two each: the
    gathered chunk at ``order[c]`` is sequence chunk c."""
    held = [c for rank in range(world) for c in zigzag_chunks(world, rank)]
    order = torch.tensor([held.index(c) for c in range(2 * world)], device=device)
    return order, torch.argsort(order)


class AllGatherExchange(Exchange):
    def visits(self) -> list[VisitSpec]:
        call = self.call
        blocks = allgather_blocks(call.rank, call.world, call.seq_local, causal=call.causal)
        return [VisitSpec(ALL_SOURCES, tuple(blocks), call.whole_side())]

    def _seq(self) -> int:
        """The sequence dim of a stacked ``[2, ...]`` K/V."""
        return self.call.kernel.seq_dim + 1

    def forward(self, k: Tensor, v: Tensor) -> Iterator[KV]:
        assert self.call.transport is not None
        kv = torch.stack((k, v))  # K and V in one collective
        gathered = self.call.transport.all_gather(kv)
        order, _ = _chunk_order(self.call.world, kv.device)
        # [R, 2, ..., S, ...] -> [2, ..., R S, ...], the chunks in gathered order, then in sequence order.
        seq = self._seq()
        whole = self._chunks_in(gathered.movedim(0, seq).flatten(seq, seq + 1), order)
        self.kept = (whole,)
        yield whole.unbind(0)

    def _chunks_in(self, x: Tensor, order: Tensor) -> Tensor:
        """``x`` (the sequence its dim) with its 2R chunks taken in ``order``: one gather."""
        seq = self._seq()
        chunks = x.unflatten(seq, (2 * self.call.world, -1))
        return chunks.index_select(seq, order).flatten(seq, seq + 1)

    def backward(self, kept: tuple[Tensor, ...], visit_backward: VisitBackward) -> Tensor:
        assert self.call.transport is not None
        whole = kept[0]
        dkv_whole = torch.zeros(whole.shape, dtype=accumulation_dtype(whole.dtype), device=whole.device)
        k, v = whole.unbind(0)
        visit_backward(0, k, v, VisitAccumulator.into(dkv_whole))
        # Every rank's share of each rank's K/V gradient, by owner; summed on its owner.
        _, inverse = _chunk_order(self.call.world, whole.device)
        seq = self._seq()
        by_owner = self._chunks_in(dkv_whole, inverse).unflatten(seq, (self.call.world, -1)).movedim(seq, 0)
        if not self.call.kernel.head_major:
            return self.call.transport.reduce_scatter(by_owner.contiguous())
        # Each share sequence-major ([R, 2, B, S, K, D]) in the one copy the collective needs anyway:
        # this rank's dK/dV then reach autograd as contiguous BSHD, with no copy there.
        mine = self.call.transport.reduce_scatter(by_owner.transpose(3, 4).contiguous())
        return mine.transpose(2, 3)
