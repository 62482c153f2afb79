"""What every K/V exchange is: the visits it makes, and how K/V and dK/dV travel for them.

Shape legend: B batch, S local sequence, K key/value heads, D head dim; K/V are in the block
kernel's layout (``AttentionKernel.to_layout``) throughout, dK/dV stacked ``[2, ...]`` in the
accumulation dtype (fp32; fp64 for fp64 inputs).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Optional, Union

import torch

from ringtrain.train.attention.block_kernel import accumulation_dtype
from ringtrain.train.attention.blocks import Block
from ringtrain.train.attention.call import AttentionCall, Side

Tensor = torch.Tensor
KV = tuple[Tensor, Tensor]
# A visit's dK/dV: the accumulator it was given, stacked, or where it was given none, its own
# (dK, dV) (``stacked`` makes one tensor of them where it must travel).
VisitGradients = Union[Tensor, KV]
# The loop's backward of one visit: (visit index, its K, its V, where its dK/dV accumulate) ->
# its dK/dV. ``into()`` gives the accumulator to add to (waiting for it if it travels), or None.
VisitGrads = Callable[[int, Tensor, Tensor, Callable[[], Optional[Tensor]]], VisitGradients]


def stacked(grads: VisitGradients) -> Tensor:
    """A visit's dK/dV as one ``[2, ...]`` tensor in the accumulation dtype."""
    if isinstance(grads, Tensor):
        return grads
    both = torch.stack(grads)
    return both if both.dtype == accumulation_dtype(both.dtype) else both.float()


@dataclass(frozen=True)
class VisitSpec:
    """One visit: whose K/V (a ring rank), the blocks of this rank's rows against them, and
    their columns' positions and documents."""

    source: int
    blocks: tuple[Block, ...]
    cols: Side


class Exchange(ABC):
    """One way K/V travel for an ``AttentionCall``. ``forward`` keeps in ``kept`` the tensors its
    ``backward`` needs (the loop saves them through autograd)."""

    def __init__(self, call: AttentionCall) -> None:
        self.call = call
        self.kept: tuple[Tensor, ...] = ()

    @abstractmethod
    def visits(self) -> list[VisitSpec]:
        """The visits, in the order ``forward`` yields their K/V."""

    @abstractmethod
    def forward(self, k: Tensor, v: Tensor) -> Iterator[KV]:
        """Each visit's K and V as they arrive, from this rank's own (all in the kernel's layout);
        the next is in flight while the loop computes."""

    @abstractmethod
    def backward(self, kept: tuple[Tensor, ...], visit_grads: VisitGrads) -> VisitGradients:
        """Run ``visit_grads`` on every visit in order; return this rank's own dK/dV."""

    @staticmethod
    def own_kv(k: Tensor, v: Tensor) -> KV:
        """This rank's K and V contiguous: what travels is sent as it is."""
        return k.contiguous(), v.contiguous()

    @staticmethod
    def narrowed(kv: KV, dim: int, cols: tuple[int, int]) -> KV:
        """K and V narrowed to ``cols`` along ``dim``."""
        start, length = cols[0], cols[1] - cols[0]
        return kv[0].narrow(dim, start, length), kv[1].narrow(dim, start, length)

    def cut(self, kv: KV, dim: int, cols: tuple[int, int]) -> KV:
        """A visit's K and V cut to a block's columns (an exchange whose buffers outlive the call
        keeps the cuts with them)."""
        return self.narrowed(kv, dim, cols)

    def ring_peers(self) -> tuple[int, int]:
        """(next, previous) rank of the ring."""
        rank, world = self.call.rank, self.call.world
        return (rank + 1) % world, (rank - 1) % world
