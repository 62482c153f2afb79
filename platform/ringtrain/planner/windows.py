"""What a sliding window saves: the keys a query attends to, and which ring ranks' K/V it reads.

A window of W tokens lets the query at position p see the keys at p - W < q <= p. Over a causal
sequence of S tokens the queries see sum over p of min(p + 1, W) keys in all; a full causal layer
is counted S^2 / 2 by the planner's convention (``throughput``), so a window counts at most that.

Under context parallelism (``train/attention/exchanges/neighbours.py``) a zigzag ring of R ranks cuts the
sequence into 2R chunks of L = S / 2R tokens, rank r holding chunks r and 2R - 1 - r. The query
chunk a reads key chunk b <= a when its nearest pair, (a - b - 1) L + 1 positions apart, lies
inside the window. When some rank reads fewer than all ranks, each rank sends its K/V once to
each rank that reads them (its readers) and gets back their dK/dV, instead of passing every
block around the ring; a rank then keeps the K/V it received (its sources) for the backward.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

# train/attention/window.py cuts a windowed block on a grid of max(W, this) positions: the
# unfused kernel's largest call is one tile of that side.
MIN_TILE = 64


def attended_keys(seq_len: int, window: Optional[int]) -> float:
    """Keys a query attends to, on average over a causal sequence of ``seq_len`` tokens."""
    full = seq_len / 2
    if window is None or window >= seq_len:
        return full
    in_window = window * (window + 1) / 2 + (seq_len - window) * window  # sum over p of min(p + 1, W)
    return min(full, in_window / seq_len)


@dataclass(frozen=True)
class WindowRanks:
    """The most K/V blocks any rank of the ring sends (readers) and receives (sources) per
    windowed layer, others than its own; None from ``window_ranks`` when every rank reads every
    rank, and the ring passes K/V as for a full layer."""

    readers: int
    sources: int


def _owner(chunk: int, ring: int) -> int:
    return chunk if chunk < ring else 2 * ring - 1 - chunk


@functools.lru_cache(maxsize=None)
def window_ranks(ring: int, seq_len: int, window: Optional[int]) -> Optional[WindowRanks]:
    """How a windowed layer's K/V travel on a zigzag ring of ``ring`` ranks over ``seq_len``
    tokens (the ring's whole sequence); None for a full layer or a window every rank sees past."""
    if window is None or ring == 1:
        return None
    chunk_len = seq_len // (2 * ring)
    sources: list[set[int]] = []
    for rank in range(ring):
        mine = (rank, 2 * ring - 1 - rank)
        # Chunks reachable from the start of query chunk a: its nearest pair must be < W apart.
        seen = {b for a in mine for b in range(a + 1) if b == a or (a - b - 1) * chunk_len + 1 < window}
        sources.append({_owner(b, ring) for b in seen} - {rank})
    if all(len(s) == ring - 1 for s in sources):
        return None
    readers = [sum(rank in s for s in sources) for rank in range(ring)]
    return WindowRanks(readers=max(readers), sources=max(len(s) for s in sources))


def score_side(seq_local: int, window: Optional[int], every_layer_windowed: bool) -> int:
    """The side of the unfused kernel's largest block: a rank's whole block when some layer is
    full, else one tile of the window's grid."""
    if window is None or not every_layer_windowed:
        return seq_local
    return min(seq_local, max(window, MIN_TILE))
