"""Zigzag ring: K/V blocks travel around the ring while each rank attends to them.

Each of the R ranks holds a zigzag shard of the sequence (chunks r and 2R-1-r, see ``zigzag``)
for its queries, keys and values. At step i rank r holds the K/V of source j = (r - i) mod R
and computes one block (ring-flash-attention's zigzag decomposition; its names below):

- j == r: its own K/V, causal over both local chunks (the concatenation is in global order);
- j <  r: every local query sees all of the source's first chunk and none of its second;
- j >  r: only the local second chunk sees anything, and it sees all of the source's K/V.

Every rank thus does one diagonal block plus R-1 half blocks: balanced. The next K/V block is in
flight while the current one computes; K and V go as two messages of one group launch,
unexpanded (K heads, not H: the kernel handles GQA), into one of two receive buffers that take
turns; the buffers and the column views blocks take of them are kept for the next call
(``VisitorBuffers``), so a layer allocates and slices nothing for its visitors. The backward sends
K/V around again, and with them the fp32 dK/dV accumulator of each block, which reaches its owner
after a full turn.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterator
from typing import Optional

import torch
from torch._subclasses.fake_tensor import FakeTensor

from ringtrain.train.attention.accumulator import VisitAccumulator
from ringtrain.train.attention.blocks import ALL, Block
from ringtrain.train.attention.exchanges.base import KV, Exchange, Tag, Tensor, VisitBackward, VisitSpec
from ringtrain.train.attention.transport import Pending


def zigzag_block(source: int, rank: int, seq_local: int, *, causal: bool) -> Block:
    """The block rank ``rank`` computes against the K/V shard of ring rank ``source``."""
    if not causal:
        return Block(ALL, ALL, causal=False)
    half = seq_local // 2
    if source == rank:
        return Block(ALL, ALL, causal=True)
    if source < rank:
        return Block(ALL, slice(0, half), causal=False)
    return Block(slice(half, seq_local), ALL, causal=False)


class VisitorBuffers:
    """The two buffers of one shape that visiting K/V take in turn, and the column views blocks
    take of them, each cut once: kept from call to call.

    A rank's calls run one after another in its thread (a backward's recomputed forward ends
    before its ring turns again), and what a visitor brings is read within the call, so the next
    call may write them again; on a GPU the transfer that does is ordered after the kernels that
    read them (a process group's launch waits on the current stream).
    """

    def __init__(self, k: Tensor, v: Tensor) -> None:
        self.pairs: tuple[KV, ...] = tuple((torch.empty_like(k), torch.empty_like(v)) for _ in range(2))
        self._views: dict[tuple[int, int, int, int], KV] = {}

    def cut(self, kv: KV, dim: int, cols: tuple[int, int]) -> Optional[KV]:
        """``kv`` cut to ``cols`` along ``dim`` if it is one of these buffers' pairs, else None."""
        for i, pair in enumerate(self.pairs):
            if pair[0] is kv[0]:
                key = (i, dim, *cols)
                if key not in self._views:
                    self._views[key] = Exchange.narrowed(pair, dim, cols)
                return self._views[key]
        return None


_thread = threading.local()
_SHAPES_KEPT = 4  # a model's layers share one shape; a few more serve evaluation and tests


def visitor_buffers(k: Tensor, v: Tensor) -> Optional[VisitorBuffers]:
    """This thread's buffers for visitors shaped as ``k`` and ``v`` (None for fake tensors, which
    belong to their mode alone)."""
    if isinstance(k, FakeTensor):
        return None
    kept: OrderedDict[tuple[object, ...], VisitorBuffers] = _thread.__dict__.setdefault("buffers", OrderedDict())
    key = (k.shape, k.stride(), v.shape, v.stride(), k.dtype, k.device, torch.is_inference_mode_enabled())
    found = kept.get(key)
    if found is None:
        found = kept[key] = VisitorBuffers(k, v)
        while len(kept) > _SHAPES_KEPT:
            kept.popitem(last=False)
    else:
        kept.move_to_end(key)
    return found


class RingExchange(Exchange):
    _buffers: Optional[VisitorBuffers] = None

    def visits(self) -> list[VisitSpec]:
        call = self.call
        sources = [(call.rank - step) % call.world for step in range(call.world)]
        return [VisitSpec(j, (zigzag_block(j, call.rank, call.seq_local, causal=call.causal),), call.shard_side(j))
                for j in sources]

    def _turn(self, kv: KV) -> Iterator[KV]:
        """Every rank's K/V in ring order, starting with ``kv``, each passed on while it is used."""
        nxt, prev = self.ring_peers()
        assert self.call.transport is not None
        self._buffers = visitor_buffers(*kv) if self.call.world > 1 else None
        turns = self._buffers.pairs if self._buffers is not None else None
        for step in range(self.call.world):
            pending: Optional[Pending] = None
            if step + 1 < self.call.world:
                # Visitors take the two buffers in turn (never the rank's own K/V: the backward keeps it).
                incoming = turns[step % 2] if turns else (torch.empty_like(kv[0]), torch.empty_like(kv[1]))
                pending = self.call.transport.send_recv({nxt: kv}, {prev: incoming}, tag=Tag.RING_KV)
            yield kv
            if pending is not None:
                pending.wait()
                kv = incoming

    def cut(self, kv: KV, dim: int, cols: tuple[int, int]) -> KV:
        views = self._buffers.cut(kv, dim, cols) if self._buffers is not None else None
        return views if views is not None else super().cut(kv, dim, cols)

    def forward(self, k: Tensor, v: Tensor) -> Iterator[KV]:
        own = self.own_kv(k, v)
        self.kept = own
        yield from self._turn(own)

    def backward(self, kept: tuple[Tensor, ...], visit_backward: VisitBackward) -> Tensor:
        assert self.call.transport is not None
        nxt, prev = self.ring_peers()
        pending: Optional[Pending] = None
        arrived = sent = None
        for step, (k, v) in enumerate(self._turn((kept[0], kept[1]))):
            # The accumulator of this K/V block arrives from the previous rank, which added its
            # share one step earlier; the diagonal step (the rank's own K/V) starts a fresh one.
            if pending is None or arrived is None:
                accumulator = VisitAccumulator.fresh(k)
            else:
                accumulator = VisitAccumulator.arriving(arrived, pending)
            visit_backward(step, k, v, accumulator)
            dkv = accumulator.stacked()
            # Passed on; after the last step the accumulator belongs to the next rank, and this
            # send brings it home. It arrives in the one sent a step ago, which has gone by now.
            incoming = sent if sent is not None else torch.empty_like(dkv)
            pending = self.call.transport.send_recv({nxt: [dkv]}, {prev: [incoming]}, tag=Tag.RING_DKV)
            arrived, sent = incoming, dkv
        assert pending is not None
        pending.wait()
        assert arrived is not None
        return arrived
