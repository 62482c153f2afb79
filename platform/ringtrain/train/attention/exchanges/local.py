"""One rank, no context parallelism: the rank's own K/V, one visit.

The attention Ulysses runs over its gathered sequence, and the "local" implementation.
"""

from __future__ import annotations

from collections.abc import Iterator

from ringtrain.train.attention.accumulator import VisitAccumulator
from ringtrain.train.attention.blocks import ALL, Block
from ringtrain.train.attention.exchanges.base import KV, Exchange, Tensor, VisitBackward, VisitGradients, VisitSpec


class LocalExchange(Exchange):
    def visits(self) -> list[VisitSpec]:
        return [VisitSpec(0, (Block(ALL, ALL, causal=self.call.causal),), self.call.shard_side(0))]

    def forward(self, k: Tensor, v: Tensor) -> Iterator[KV]:
        self.kept = (k, v)  # nothing travels
        yield k, v

    def backward(self, kept: tuple[Tensor, ...], visit_backward: VisitBackward) -> VisitGradients:
        dkv = VisitAccumulator.fresh(kept[0])
        visit_backward(0, kept[0], kept[1], dkv)
        return dkv.grads()  # a lone block's own dK and dV, as they are
