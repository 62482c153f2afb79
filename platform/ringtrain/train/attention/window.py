"""Sliding-window attention: which tiles of a block a window leaves, and which ranks' K/V a rank needs.

A window of W tokens lets the query at position p see the keys at positions p - W < q <= p
(itself and the W - 1 before it, as transformers' ``sliding_window``), by position id. A block
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
of consecutive positions), never from the data, but for one thing: a document in a family
continues its parent's position ids, not the sequence's, so its tokens sit its lag earlier
(``documents.position_lags``, from the documents alone; ``blocks`` tiles by what is left).

Under context parallelism a rank needs the K/V of only the ranks whose tokens fall in some of
its queries' windows (``needed_sources``): with a window no longer than a zigzag chunk that is its
two neighbours, so the K/V go to them directly instead of around the whole ring. Documents in
families change that where a child lies far from its parent in the sequence: its queries see
the parent's keys by position id (``documents.position_lags``), which may lie on a rank further
back than the neighbours. ``family_sources`` adds those ranks, from the ring's documents, so the
K/V go to the neighbours alone wherever the families keep within them, and to the ranks the
families reach besides where they do not.

Shape legend: Q / K a block's rows / columns, R ranks in the ring, L a zigzag chunk's length.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from ringtrain.topology import sequence_positions
from ringtrain.train.attention.documents import child_runs

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
    """``[..., Q, S]``: True where the key is inside the query's causal window (a masked tile's
    mask); positions ``[..., Q]`` and ``[..., S]`` (a batch row's each, where they differ)."""
    gap = q_positions[..., :, None] - k_positions[..., None, :]
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


def family_sources(world: int, seq_local: int, window: int, ids_BN: np.ndarray,
                   family: int) -> tuple[tuple[int, ...], ...]:
    """``needs`` and, for each rank, the ranks holding parent keys that its children's queries see
    through the window by position id (which lag their places: ``documents.child_runs``), from
    the ring's whole sequence's documents ``ids_BN``, the same on every rank."""
    reads = [set(sources) for sources in needs(world, seq_local, window)]
    # Every rank's stretches of consecutive positions, in sequence order: who holds a span.
    held = sorted((pos, pos + length, rank) for rank in range(world)
                  for _, pos, length in position_runs(shard_positions(world, rank, seq_local)))
    starts = np.array([start for start, _, _ in held])

    def holders(start: int, stop: int) -> Iterator[tuple[int, int, int]]:
        """The stretches holding some of positions [start, stop): (first position, end, rank)."""
        for stretch in held[max(int(np.searchsorted(starts, start, side="right")) - 1, 0):]:
            if stretch[0] >= stop:
                return
            if stretch[1] > start:
                yield stretch

    for b in range(ids_BN.shape[0]):
        for start, stop, parent_start, parent_stop, lag in child_runs(ids_BN[b], family):
            for run_start, _, rank in holders(start, stop):
                # The run's first query reaches furthest back: to keys at positions from its own,
                # less its lag, less the window, plus one.
                lowest = max(parent_start, max(start, run_start) - lag - window + 1)
                if lowest < parent_stop:
                    reads[rank].update(holder for _, _, holder in holders(lowest, parent_stop))
    return tuple(tuple(sorted(sources)) for sources in reads)
