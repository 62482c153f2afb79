"""One attention block through a block kernel, cut into pieces where documents or a sliding window
make only part of it visible.

Without documents or a window a block is one kernel call. Otherwise it is cut on the host:

- packed documents: a query sees only keys of its own document (and of its parent's, where
  documents share a prefix), so the block is one rectangle per document (``documents.segments``),
  each unmasked; a row whose document has no key here (padding included) keeps output 0 and LSE
  -inf;
- a sliding window: by position id, into tiles that are left out, full, causal squares, or
  masked where the band's edge crosses them (``window.window_tiles``); a masked tile runs on a
  kernel that takes masks (``kernels.mask_kernel``), with a mask of that tile only. A position
  id is the sequence position, less a child document's lag where documents come in families
  (``documents.position_lags``).

With both, each document's rectangle is cut by the window, a child's against its parent too.
Pieces that share rows merge through their LSEs. No [Q, S] mask of the whole block is ever made,
and the block's own kernel runs every piece it can. The backward cuts the same way, each piece
against the merged output and LSE of its rows.

A rectangle of a causal block without a window is square and on its diagonal: a causal block's
rows and columns are the same positions, so a document's runs in both are the same slice (the
plan splits a causal block wider than tall into its diagonal and its prefix before it is cut).

Shape legend: B batch, Q query length of the block, S key length of the block, H query heads,
K key/value heads, D head dim.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch

from ringtrain.train.attention.block_kernel import AttentionKernel, BlockOutput, Grads, accumulation_dtype
from ringtrain.train.attention.documents import segments
from ringtrain.train.attention.kernels import mask_kernel
from ringtrain.train.attention.merge import merge_into_
from ringtrain.train.attention.window import CAUSAL, FULL, MASKED, UPPER, tile_mask, window_tiles

Tensor = torch.Tensor


ALL = slice(None)  # every row, or every column


@dataclass(frozen=True)
class Block:
    """Which local query rows attend to which columns of the K/V at hand (a ring's visiting
    block, or the whole gathered sequence), and how."""

    rows: slice
    cols: slice
    causal: bool


@dataclass(frozen=True)
class Cut:
    """What cuts a block: its rows' and columns' documents and positions (host arrays; each pair
    both or neither) and the window (None: none)."""

    q_docs_BQ: Optional[np.ndarray] = None
    k_docs_BS: Optional[np.ndarray] = None
    window: Optional[int] = None
    q_positions: Optional[np.ndarray] = None
    k_positions: Optional[np.ndarray] = None
    family: int = 0  # ``documents.Documents.family``: a child document sees its parent's keys
    # Under a window, with families: how far each token's position id falls behind its position
    # (``documents.position_lags``); None: nowhere.
    q_lags_BQ: Optional[np.ndarray] = None
    k_lags_BS: Optional[np.ndarray] = None

    @property
    def whole(self) -> bool:
        return self.q_docs_BQ is None and self.window is None

    def position_ids(self) -> tuple[np.ndarray, np.ndarray]:
        """The rows' and columns' position ids, ``[1, n]`` or, with lags, ``[B, n]``: what a
        window measures by (a child's continue its parent's, not the sequence's)."""
        assert self.q_positions is not None and self.k_positions is not None
        q_ids, k_ids = self.q_positions[None], self.k_positions[None]
        if self.q_lags_BQ is not None and self.k_lags_BS is not None:
            q_ids, k_ids = q_ids - self.q_lags_BQ, k_ids - self.k_lags_BS
        return q_ids, k_ids


@dataclass(frozen=True)
class Piece:
    b: slice
    rows: slice
    cols: slice
    causal: bool
    band: Optional[tuple[int, int]] = None  # a masked piece's (rows' offset after its columns, window)
    upper: bool = False  # a strict upper triangle: run reversed, as a causal square (see ``_upper_forward``)
    tiles: int = 1  # rows and columns are this many equal squares side by side, run as one batch


def _batched(pieces: list[Piece]) -> list[Piece]:
    """Runs of equal squares of one kind stepping down the diagonal (a window's causal tiles, its
    upper triangles) as one piece each: a kernel call over a batch of tiles instead of a call
    per tile (small calls run far below a kernel's speed)."""
    out: list[Piece] = []
    for piece in pieces:
        last = out[-1] if out else None
        size = piece.rows.stop - piece.rows.start
        if (
            last is not None
            and piece.band is None and last.band is None
            and (piece.causal, piece.upper, piece.b) == (last.causal, last.upper, last.b)
            and (piece.causal or piece.upper)
            and size == piece.cols.stop - piece.cols.start == (last.rows.stop - last.rows.start) // last.tiles
            and piece.rows.start == last.rows.stop and piece.cols.start == last.cols.stop
        ):
            out[-1] = Piece(last.b, slice(last.rows.start, piece.rows.stop), slice(last.cols.start, piece.cols.stop),
                            last.causal, upper=last.upper, tiles=last.tiles + 1)
        else:
            out.append(piece)
    return out


def pieces_of(batch: int, q_len: int, k_len: int, causal: bool, cut: Cut) -> list[Piece]:
    """The pieces ``cut`` cuts a block of ``q_len`` rows and ``k_len`` columns into."""
    if cut.q_docs_BQ is not None and cut.k_docs_BS is not None:
        found = segments(cut.q_docs_BQ, cut.k_docs_BS, cut.family)
        rects = [(slice(s.b, s.b + 1), s.rows, s.cols) for s in found if not s.parent]
        # A child's rows against its parent's columns: the parent comes first, so all are seen.
        parent_pieces = [Piece(slice(s.b, s.b + 1), s.rows, s.cols, causal=False) for s in found if s.parent]
    else:
        rects, parent_pieces = [(slice(0, batch), slice(0, q_len), slice(0, k_len))], []
    if cut.window is None:
        if causal and any(rows != cols for _, rows, cols in rects):
            raise ValueError("a causal block's documents must sit on its diagonal: its rows and columns are one range")
        return [Piece(b, rows, cols, causal) for b, rows, cols in rects] + parent_pieces
    if cut.q_positions is None or cut.k_positions is None:
        raise ValueError("a windowed block needs its rows' and columns' positions")
    # Tiled by position ids: a child's rows against its parent's columns are a band too, shifted
    # by the child's lag (its elder siblings' tokens between them count for nothing).
    q_ids, k_ids = (np.broadcast_to(ids, (batch, ids.shape[1])) for ids in cut.position_ids())
    rects += [(piece.b, piece.rows, piece.cols) for piece in parent_pieces]
    pieces = []
    for b, rows, cols in rects:
        q_pos, k_pos = q_ids[b.start, rows], k_ids[b.start, cols]
        tiles = window_tiles(q_pos, k_pos, cut.window)
        # By kind, so that each kind's tiles along the diagonal sit next to each other to batch.
        for kind in (CAUSAL, UPPER, FULL, MASKED):
            run = []
            for t in (t for t in tiles if t.kind == kind):
                band = (int(q_pos[t.rows.start] - k_pos[t.cols.start]), cut.window) if kind == MASKED else None
                run.append(Piece(b, _shift(t.rows, rows.start), _shift(t.cols, cols.start), kind == CAUSAL, band,
                                 upper=kind == UPPER))
            pieces.extend(_batched(run))
    return pieces


def _as_tiles(x_BS: Tensor, tiles: int) -> Tensor:
    """``[B, n T, ...]`` -> ``[B n, T, ...]``: a piece's squares as a batch."""
    return x_BS.reshape(x_BS.shape[0] * tiles, x_BS.shape[1] // tiles, *x_BS.shape[2:])


def _from_tiles(x_NT: Tensor, tiles: int) -> Tensor:
    """The inverse of ``_as_tiles``."""
    return x_NT.reshape(x_NT.shape[0] // tiles, x_NT.shape[1] * tiles, *x_NT.shape[2:])


def _lse_as_tiles(lse_BHS: Tensor, tiles: int) -> Tensor:
    B, H, S = lse_BHS.shape
    return lse_BHS.reshape(B, H, tiles, S // tiles).transpose(1, 2).reshape(B * tiles, H, S // tiles)


def _lse_from_tiles(lse_NHT: Tensor, tiles: int) -> Tensor:
    N, H, T = lse_NHT.shape
    return lse_NHT.reshape(N // tiles, tiles, H, T).transpose(1, 2).reshape(N // tiles, H, tiles * T)


def _shift(index: slice, by: int) -> slice:
    return slice(index.start + by, index.stop + by)


# A strict upper triangle (row r sees the columns after r) reversed on both sides is a strict lower
# one (row r' sees the columns before r'), which is a causal square on the rows from the second
# and the columns to the last but one; the first reversed row (the last row) sees nothing. So the
# layer's own kernel runs it, causal, on reversed copies of a tile's slices (a copy of T tokens
# against T^2 work), rather than a mask-capable kernel with a mask.


def _upper_forward(kernel: AttentionKernel, q: Tensor, k: Tensor, v: Tensor, scale: float) -> BlockOutput:
    q_r, k_r, v_r = q.flip(1), k.flip(1), v.flip(1)
    res = kernel.forward(q_r[:, 1:], k_r[:, :-1], v_r[:, :-1], causal=True, scale=scale)
    out_r = torch.cat((torch.zeros_like(res.out_BQHD[:, :1]), res.out_BQHD), dim=1)
    lse_r = torch.cat((torch.full_like(res.lse_BHQ[..., :1], -math.inf), res.lse_BHQ), dim=2)
    return BlockOutput(out_r.flip(1), lse_r.flip(2), res.aux)


def _upper_backward(
    kernel: AttentionKernel, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, aux: Any,
    scale: float,
) -> Grads:
    dout_r, q_r, k_r, v_r, out_r, lse_r = dout.flip(1), q.flip(1), k.flip(1), v.flip(1), out.flip(1), lse.flip(2)
    dq, dk, dv = kernel.backward(dout_r[:, 1:], q_r[:, 1:], k_r[:, :-1], v_r[:, :-1], out_r[:, 1:], lse_r[..., 1:],
                                 aux, causal=True, scale=scale)
    dq_r = torch.cat((torch.zeros_like(dq[:, :1]), dq), dim=1)
    dk_r, dv_r = torch.cat((dk, torch.zeros_like(dk[:, :1])), dim=1), torch.cat((dv, torch.zeros_like(dv[:, :1])), dim=1)
    return dq_r.flip(1), dk_r.flip(1), dv_r.flip(1)


def _run_kernel(kernel: AttentionKernel, piece: Piece, like: Tensor) -> tuple[AttentionKernel, Optional[Tensor]]:
    if piece.band is None:
        return kernel, None
    offset, window = piece.band
    mask_QS = tile_mask(offset, piece.rows.stop - piece.rows.start, piece.cols.stop - piece.cols.start, window,
                        like.device)
    return mask_kernel(kernel, like), mask_QS[None].expand(piece.b.stop - piece.b.start, -1, -1)


def block_forward(kernel: AttentionKernel, q_BQHD: Tensor, k_BSKD: Tensor, v_BSKD: Tensor, *, causal: bool,
                  scale: float, cut: Cut = Cut(), pieces: Optional[list[Piece]] = None) -> BlockOutput:
    """The block's output and LSE, cut as ``cut`` says (see the module doc); ``pieces``: the cut's
    pieces (``pieces_of``) where already known."""
    if cut.whole:
        return kernel.forward(q_BQHD, k_BSKD, v_BSKD, causal=causal, scale=scale)
    B, Q, H, _ = q_BQHD.shape
    acc = accumulation_dtype(q_BQHD.dtype)  # as the kernels give the LSE
    out_BQHD = torch.zeros(q_BQHD.shape, dtype=acc, device=q_BQHD.device)
    lse_BHQ = torch.full((B, H, Q), -math.inf, dtype=acc, device=q_BQHD.device)
    auxes = []
    if pieces is None:
        pieces = pieces_of(B, Q, k_BSKD.shape[1], causal, cut)
    for piece in pieces:
        run, visible = _run_kernel(kernel, piece, q_BQHD)
        b, rows, cols, n = piece.b, piece.rows, piece.cols, piece.tiles
        q, k, v = (_as_tiles(x[b, index], n) for x, index in ((q_BQHD, rows), (k_BSKD, cols), (v_BSKD, cols)))
        if piece.upper:
            res = _upper_forward(kernel, q, k, v, scale)
        else:
            res = run.forward(q, k, v, causal=piece.causal, scale=scale, visible_BQS=visible)
        auxes.append(res.aux)
        # Into the rows' accumulators, empty (0, -inf) or holding another piece's share: the merge
        # of a share with an empty row is the share.
        merge_into_(out_BQHD[b, rows], lse_BHQ[b, :, rows], _from_tiles(res.out_BQHD, n),
                    _lse_from_tiles(res.lse_BHQ, n))
    return BlockOutput(out_BQHD.to(q_BQHD.dtype), lse_BHQ, auxes)


def block_backward(kernel: AttentionKernel, dout_BQHD: Tensor, q_BQHD: Tensor, k_BSKD: Tensor, v_BSKD: Tensor,
                   out_BQHD: Tensor, lse_BHQ: Tensor, aux: Any, *, causal: bool, scale: float, cut: Cut = Cut(),
                   pieces: Optional[list[Piece]] = None) -> Grads:
    """The block's gradients for the merged ``out``/``lse`` of its rows; cut as the forward was."""
    if cut.whole:
        return kernel.backward(dout_BQHD, q_BQHD, k_BSKD, v_BSKD, out_BQHD, lse_BHQ, aux, causal=causal, scale=scale)
    # fp32 (fp64 for fp64 inputs): several pieces add into the same rows and columns.
    acc = accumulation_dtype(q_BQHD.dtype)
    dq_BQHD = torch.zeros(q_BQHD.shape, dtype=acc, device=q_BQHD.device)
    dk_BSKD = torch.zeros(k_BSKD.shape, dtype=acc, device=k_BSKD.device)
    dv_BSKD = torch.zeros(v_BSKD.shape, dtype=acc, device=v_BSKD.device)
    if pieces is None:
        pieces = pieces_of(q_BQHD.shape[0], q_BQHD.shape[1], k_BSKD.shape[1], causal, cut)
    for piece, piece_aux in zip(pieces, aux):
        run, visible = _run_kernel(kernel, piece, q_BQHD)
        b, rows, cols, n = piece.b, piece.rows, piece.cols, piece.tiles
        dout, q, out = (_as_tiles(x[b, rows], n) for x in (dout_BQHD, q_BQHD, out_BQHD))
        k, v = (_as_tiles(x[b, cols], n) for x in (k_BSKD, v_BSKD))
        lse = _lse_as_tiles(lse_BHQ[b, :, rows], n)
        if piece.upper:
            dq, dk, dv = _upper_backward(kernel, dout, q, k, v, out, lse, piece_aux, scale)
        else:
            dq, dk, dv = run.backward(dout, q, k, v, out, lse, piece_aux, causal=piece.causal, scale=scale,
                                      visible_BQS=visible)
        dq_BQHD[b, rows] += _from_tiles(dq, n)
        dk_BSKD[b, cols] += _from_tiles(dk, n)
        dv_BSKD[b, cols] += _from_tiles(dv, n)
    return dq_BQHD.to(q_BQHD.dtype), dk_BSKD.to(k_BSKD.dtype), dv_BSKD.to(v_BSKD.dtype)
