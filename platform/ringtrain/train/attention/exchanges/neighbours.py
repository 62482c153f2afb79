"""Sliding-window context parallelism: each rank's K/V go straight to the ranks whose windows
reach them, not around the ring.

Under a window of W tokens a query sees only keys within W positions before it. On a zigzag
ring a rank's two chunks then see into few other ranks' shards (``window.needed_sources``; with
W no longer than a chunk, its two ring neighbours), so passing every K/V block around all R
ranks would move and wait for blocks nobody reads. Here a rank sends its K and V once to each
rank that needs them and receives from each rank it needs, in one group launch, and attends its
own block while they are in flight. Documents in families add the ranks holding the parents'
keys that a child sees by position id where those lie further back than the neighbours
(``call.AttentionCall.window_sources``): still only the ranks the data needs, where a ring would
visit every rank. The backward sends each visiting block's dK/dV home to its owner, which adds
them to its own.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from ringtrain.train.attention.accumulator import VisitAccumulator
from ringtrain.train.attention.blocks import ALL, Block
from ringtrain.train.attention.exchanges.base import KV, Exchange, Tag, Tensor, VisitBackward, VisitSpec


class NeighbourExchange(Exchange):
    def _peers(self) -> tuple[list[int], list[int]]:
        """(the ranks whose K/V this rank reads, the ranks that read this rank's)."""
        call = self.call
        reads = call.window_sources()
        sources = [j for j in reads[call.rank] if j != call.rank]
        readers = [r for r in range(call.world) if r != call.rank and call.rank in reads[r]]
        return sources, readers

    def visits(self) -> list[VisitSpec]:
        sources, _ = self._peers()
        # Each visit is one whole block; the window cuts it.
        return [VisitSpec(j, (Block(ALL, ALL, causal=True),), self.call.shard_side(j))
                for j in (self.call.rank, *sources)]

    def forward(self, k: Tensor, v: Tensor) -> Iterator[KV]:
        assert self.call.transport is not None
        sources, readers = self._peers()
        own = self.own_kv(k, v)
        visiting = {j: (torch.empty_like(own[0]), torch.empty_like(own[1])) for j in sources}
        pending = self.call.transport.send_recv({r: own for r in readers}, visiting, tag=Tag.NEIGHBOUR_KV)
        self.kept = (*own, *(t for j in sources for t in visiting[j]))
        yield own  # its own block first, while the others' K/V travel
        pending.wait()
        yield from (visiting[j] for j in sources)

    def backward(self, kept: tuple[Tensor, ...], visit_backward: VisitBackward) -> Tensor:
        assert self.call.transport is not None
        sources, readers = self._peers()
        dkv = [self._visit_dkv(i, kept, visit_backward) for i in range(1 + len(sources))]
        # Every visiting block's gradients home to its owner; the readers' shares of ours here.
        arriving = {r: [torch.empty_like(dkv[0])] for r in readers}
        self.call.transport.send_recv({j: [dkv[1 + i]] for i, j in enumerate(sources)}, arriving, tag=Tag.NEIGHBOUR_DKV).wait()
        for (share,) in arriving.values():
            dkv[0] += share
        return dkv[0]

    @staticmethod
    def _visit_dkv(index: int, kept: tuple[Tensor, ...], visit_backward: VisitBackward) -> Tensor:
        """Visit ``index``'s dK/dV, stacked to travel (each visit's go home on their own)."""
        k, v = kept[2 * index], kept[2 * index + 1]
        dkv = VisitAccumulator.fresh(k)
        visit_backward(index, k, v, dkv)
        return dkv.stacked()
