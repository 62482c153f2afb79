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
turns. The backward sends K/V around again, and with them the fp32 dK/dV accumulator of each
block, which reaches its owner after a full turn.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Optional

from ringtrain.train.attention.blocks import ALL, Block
from ringtrain.train.attention.exchanges.base import KV, Exchange, Tensor, VisitGrads, VisitSpec, stacked
from ringtrain.train.attention.transport import Pending

# One tag per stream of transfers (see ``transport``); a stream of n tensors uses tag..tag+n-1.
_KV_TAG = 0
_DKV_TAG = 8


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


class RingExchange(Exchange):
    def visits(self) -> list[VisitSpec]:
        call = self.call
        sources = [(call.rank - step) % call.world for step in range(call.world)]
        return [VisitSpec(j, (zigzag_block(j, call.rank, call.seq_local, causal=call.causal),), call.shard_side(j))
                for j in sources]

    def _turn(self, kv: KV) -> Iterator[KV]:
        """Every rank's K/V in ring order, starting with ``kv``, each passed on while it is used."""
        nxt, prev = self.ring_peers()
        assert self.call.transport is not None
        free: Optional[KV] = None  # a visitor's buffers, once used and passed on
        for step in range(self.call.world):
            pending: Optional[Pending] = None
            if step + 1 < self.call.world:
                incoming = free or (kv[0].new_empty(kv[0].shape), kv[1].new_empty(kv[1].shape))
                pending = self.call.transport.send_recv({nxt: kv}, {prev: incoming}, tag=_KV_TAG)
            yield kv
            if pending is not None:
                pending.wait()
                free = kv if step > 0 else None  # never the rank's own, which the backward keeps
                kv = incoming

    def forward(self, k: Tensor, v: Tensor) -> Iterator[KV]:
        own = self.own_kv(k, v)
        self.kept = own
        yield from self._turn(own)

    def backward(self, kept: tuple[Tensor, ...], visit_grads: VisitGrads) -> Tensor:
        assert self.call.transport is not None
        nxt, prev = self.ring_peers()
        pending: Optional[Pending] = None
        arrived = sent = None

        def into() -> Optional[Tensor]:
            # The accumulator of this K/V block, from the previous rank (which added its share one
            # step earlier); the diagonal step starts a fresh one.
            if pending is None:
                return None
            pending.wait()
            return arrived

        for step, (k, v) in enumerate(self._turn((kept[0], kept[1]))):
            dkv = stacked(visit_grads(step, k, v, into))
            # Passed on; after the last step the accumulator belongs to the next rank, and this
            # send brings it home. It arrives in the one sent a step ago, which has gone by now.
            incoming = sent if sent is not None else dkv.new_empty(dkv.shape)
            pending = self.call.transport.send_recv({nxt: [dkv]}, {prev: [incoming]}, tag=_DKV_TAG)
            arrived, sent = incoming, dkv
        assert pending is not None
        pending.wait()
        assert arrived is not None
        return arrived
