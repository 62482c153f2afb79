"""Sliding-window attention: which tiles of a block a window leaves, and which ranks' K/V a rank needs.

A window of W tokens lets the query at sequence position p see the keys at positions
p - W < q <= p (itself and the W - 1 before it, as transformers' ``sliding_window``). A block
of rows and columns is laid on a grid of ``tile`` positions (the same grid for both, so a
tile's rows and columns line up with the band's diagonals), and each tile is one of:

- left out: every key after every query, or before every query's window;
- ``full``: every key at or before every query and inside every query's window: unmasked;
- ``causal``: the same positions on both sides, wholly inside the window: a square causal call;
- ``upper``: a square whose rows start a whole window after its columns: row r sees the columns
  after r, a strict upper triangle, which is a causal square once both sides are reversed
  (``blocks`` runs it so, on the layer's own kernel);
- ``masked``: the band's edge passes through it otherwise: a call with an explicit mask of the tile.

With the tile the window itself (from ``MIN_TILE`` on) each row of tiles is its causal diagonal
and the upper triangle before it: a layer costs S W score entries against S^2 / 2, on the fast
kernel throughout (``blocks`` runs the equal tiles down the diagonal as one batch). Adjacent
full tiles of a row are one call. Positions come from the layout (a zigzag shard holds two runs
of consecutive positions), never from data.

Under context parallelism a rank needs the K/V of only the ranks whose tokens fall in some of
its queries' windows (``needed_sources``): with a window no longer than a zigzag chunk that is its
two neighbours, so the K/V go to them directly instead of around the whole ring.

Shape legend: Q / K a block's rows / columns, R ranks in the ring, L a zigzag chunk's length.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from ringtrain.topology import sequence_positions

FULL, CAUSAL, UPPER, MASKED = "full", "causal", "upper", "masked"
MIN_TILE = 64  # tiles below this cost more in kernel launches than their masks save


@dataclass(frozen=True)
class Tile:
    """Rows and columns (local slices of the block) and how they are computed."""

    rows: slice
    cols: slice
    kind: str  # FULL | CAUSAL | UPPER | MASKED


def tile_size(window: int) -> int:
    """The grid a window's blocks are cut on: the window itself, not below ``MIN_TILE``."""
    return max(window, MIN_TILE)


@functools.lru_cache(maxsize=256)
def shard_positions(world: int, rank: int, seq_local: int) -> np.ndarray:
    """The sequence positions of ring rank ``rank``'s zigzag shard, in its local order: the
    topology's (``topology.sequence_positions``), as a read-only array."""
    positions = np.array(sequence_positions(world * seq_local, world, 1, rank, 0))
    positions.setflags(write=False)
    return positions


def position_runs(positions: np.ndarray) -> list[tuple[int, int, int]]:
    """``(local start, position, length)`` of each stretch of consecutive positions."""
    if positions.size == 0:
        return []
    cuts = np.flatnonzero(np.diff(positions) != 1) + 1
    starts = np.concatenate(([0], cuts))
    stops = np.concatenate((cuts, [positions.size]))
    return [(int(a), int(positions[a]), int(b - a)) for a, b in zip(starts, stops)]


def _grid(local: int, pos: int, length: int, tile: int) -> list[tuple[int, int, int]]:
    """A run cut where its positions cross a multiple of ``tile``: (local start, position, length)."""
    pieces, end = [], pos + length
    while pos < end:
        stop = min(end, (pos // tile + 1) * tile)
        pieces.append((local, pos, stop - pos))
        local, pos = local + stop - pos, stop
    return pieces


def _kind(q_pos: int, q_len: int, k_pos: int, k_len: int, window: int) -> str | None:
    q_last, k_last = q_pos + q_len - 1, k_pos + k_len - 1
    if k_pos > q_last or k_last <= q_pos - window:
        return None
    if k_last <= q_pos and k_pos > q_last - window:
        return FULL
    if q_pos == k_pos and q_len == k_len and window >= q_len:
        return CAUSAL
    if q_pos - k_pos == window and q_len == k_len == window:
        return UPPER
    return MASKED


def window_tiles(q_positions: np.ndarray, k_positions: np.ndarray, window: int) -> list[Tile]:
    """The tiles of a block, rows at ``q_positions`` and columns at ``k_positions``, that a
    causal window of ``window`` tokens does not leave out; adjacent full tiles of a row merged."""
    tile = tile_size(window)
    rows = [p for run in position_runs(q_positions) for p in _grid(*run, tile)]
    cols = [p for run in position_runs(k_positions) for p in _grid(*run, tile)]
    col_starts = np.array([pos for _, pos, _ in cols]) if cols else np.zeros(0, dtype=np.int64)
    order = np.argsort(col_starts, kind="stable")
    tiles: list[Tile] = []
    for q_local, q_pos, q_len in rows:
        # Only columns that can reach this row's window: positions in (q_pos - window, q_last].
        lo = np.searchsorted(col_starts[order], q_pos - window - tile, side="left")
        hi = np.searchsorted(col_starts[order], q_pos + q_len, side="left")
        row: list[Tile] = []
        for index in sorted(order[lo:hi], key=lambda i: cols[i][0]):
            k_local, k_pos, k_len = cols[index]
            kind = _kind(q_pos, q_len, k_pos, k_len, window)
            if kind is None:
                continue
            tile_cols = slice(k_local, k_local + k_len)
            last = row[-1] if row else None
            if kind == FULL and last is not None and last.kind == FULL and last.cols.stop == k_local:
                row[-1] = Tile(last.rows, slice(last.cols.start, k_local + k_len), FULL)
            else:
                row.append(Tile(slice(q_local, q_local + q_len), tile_cols, kind))
        tiles.extend(row)
    return tiles


def band_mask(q_positions: np.ndarray, k_positions: np.ndarray, window: int) -> np.ndarray:
    """``[Q, S]``: True where the key is inside the query's causal window (a masked tile's mask)."""
    gap = q_positions[:, None] - k_positions[None, :]
    return (gap >= 0) & (gap < window)


@functools.lru_cache(maxsize=64)
def tile_mask(offset: int, q_len: int, k_len: int, window: int, device: torch.device) -> torch.Tensor:
    """``band_mask`` of a tile whose rows start ``offset`` positions after its columns (a tile's
    positions are consecutive), on ``device``: tiles on the same grid share it, so it is made
    once, not per tile and layer."""
    mask = band_mask(np.arange(q_len) + offset, np.arange(k_len), window)
    return torch.as_tensor(mask, device=device)


def needed_sources(world: int, seq_local: int, window: int) -> list[list[int]]:
    """For each rank, the ring ranks whose K/V some of its queries see through the window
    (itself included), in rank order."""
    positions = [shard_positions(world, r, seq_local) for r in range(world)]
    return [
        [j for j in range(world) if window_tiles(positions[r], positions[j], window)]
        for r in range(world)
    ]


@functools.lru_cache(maxsize=None)
def needs(world: int, seq_local: int, window: int) -> tuple[tuple[int, ...], ...]:
    """``needed_sources``, kept: every layer of every step asks the same."""
    return tuple(tuple(sources) for sources in needed_sources(world, seq_local, window))


def sparse(world: int, seq_local: int, window: int) -> bool:
    """Whether some rank needs fewer than all ranks' K/V: then sending them to those alone beats
    the ring."""
    return any(len(sources) < world for sources in needs(world, seq_local, window))
