"""What every K/V exchange is: the visits it makes, and how K/V and dK/dV travel for them.

Shape legend: B batch, S local sequence, K key/value heads, D head dim; K/V are in the block
kernel's layout (``AttentionKernel.to_layout``) throughout, dK/dV stacked ``[2, ...]`` in the
accumulation dtype (fp32; fp64 for fp64 inputs).
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from ringtrain.train.attention.accumulator import KV, VisitAccumulator, VisitGradients
from ringtrain.train.attention.blocks import Block
from ringtrain.train.attention.call import AttentionCall, Side

Tensor = torch.Tensor
# The loop's backward of one visit: (visit index, its K, its V, the accumulator its dK/dV add to).
VisitBackward = Callable[[int, Tensor, Tensor, VisitAccumulator], None]

# A visit's source that is every rank of the ring at once (all-gathered K/V).
ALL_SOURCES = -1

# How many tags one stream of transfers takes: a stream sends at most this many tensors to a peer
# in one ``send_recv`` (tensor i with tag ``tag + i``).
TAGS_PER_STREAM = 8


class Tag(enum.IntEnum):
    """The streams of point-to-point transfers, each on tags of its own (``transport``'s
    ``ProcessGroupTransport`` says why): a stream's tag and the ``TAGS_PER_STREAM - 1`` after it."""

    RING_KV = 0 * TAGS_PER_STREAM
    RING_DKV = 1 * TAGS_PER_STREAM
    NEIGHBOUR_KV = 2 * TAGS_PER_STREAM
    NEIGHBOUR_DKV = 3 * TAGS_PER_STREAM


@dataclass(frozen=True)
class VisitSpec:
    """One visit: whose K/V (a ring rank, or ``ALL_SOURCES``), the blocks of this rank's rows against them, and
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
    def backward(self, kept: tuple[Tensor, ...], visit_backward: VisitBackward) -> VisitGradients:
        """Run ``visit_backward`` on every visit in order, each with the accumulator its dK/dV
        add to (``accumulator``); return this rank's own dK/dV."""

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
