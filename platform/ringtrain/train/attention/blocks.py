"""One attention block through a block kernel, cut into pieces where documents or a sliding window
make only part of it visible.

Without documents or a window a block is one kernel call. Otherwise it is cut on the host:

- packed documents: a query sees only keys of its own document, so the block is one rectangle
  per document (``documents.segments``), each unmasked; a row whose document has no key here
  (padding included) keeps output 0 and LSE -inf;
- a sliding window: by sequence position, into tiles that are left out, full, causal squares, or
  masked where the band's edge crosses them (``window.window_tiles``); a masked tile runs on a
  kernel that takes masks (``kernels.mask_kernel``), with a mask of that tile only.

With both, each document's rectangle is cut by the window. Pieces that share rows merge through
their LSEs. No [Q, S] mask of the whole block is ever made, and the block's own kernel runs every
piece it can. The backward cuts the same way, each piece against the merged output and LSE of its
rows.

A rectangle of a causal block without a window is square and on its diagonal: a causal block's
rows and columns are the same positions, so a document's runs in both are the same slice.

Shape legend: B batch, Q query length of the block, S key length of the block, H query heads,
K key/value heads, D head dim.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch

from ringtrain.train.attention.block_kernel import AttentionKernel, BlockOutput, Grads
from ringtrain.train.attention.documents import segments
from ringtrain.train.attention.kernels import mask_kernel
from ringtrain.train.attention.merge import merge_into_
from ringtrain.train.attention.window import CAUSAL, MASKED, tile_mask, window_tiles

Tensor = torch.Tensor


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

    @property
    def whole(self) -> bool:
        return self.q_docs_BQ is None and self.window is None


@dataclass(frozen=True)
class Piece:
    b: slice
    rows: slice
    cols: slice
    causal: bool
    band: Optional[tuple[int, int]] = None  # a masked piece's (rows' offset after its columns, window)


def _pieces(batch: int, q_len: int, k_len: int, causal: bool, cut: Cut) -> list[Piece]:
    if cut.q_docs_BQ is not None and cut.k_docs_BS is not None:
        rects = [(slice(s.b, s.b + 1), s.rows, s.cols) for s in segments(cut.q_docs_BQ, cut.k_docs_BS)]
    else:
        rects = [(slice(0, batch), slice(0, q_len), slice(0, k_len))]
    if cut.window is None:
        if causal and any(rows != cols for _, rows, cols in rects):
            raise ValueError("a causal block's documents must sit on its diagonal: its rows and columns are one range")
        return [Piece(b, rows, cols, causal) for b, rows, cols in rects]
    if cut.q_positions is None or cut.k_positions is None:
        raise ValueError("a windowed block needs its rows' and columns' positions")
    pieces = []
    for b, rows, cols in rects:
        q_pos, k_pos = cut.q_positions[rows], cut.k_positions[cols]
        for t in window_tiles(q_pos, k_pos, cut.window):
            band = (int(q_pos[t.rows.start] - k_pos[t.cols.start]), cut.window) if t.kind == MASKED else None
            pieces.append(Piece(b, _shift(t.rows, rows.start), _shift(t.cols, cols.start), t.kind == CAUSAL, band))
    return pieces


def _shift(index: slice, by: int) -> slice:
    return slice(index.start + by, index.stop + by)


def _run_kernel(kernel: AttentionKernel, piece: Piece, like: Tensor) -> tuple[AttentionKernel, Optional[Tensor]]:
    if piece.band is None:
        return kernel, None
    offset, window = piece.band
    mask_QS = tile_mask(offset, piece.rows.stop - piece.rows.start, piece.cols.stop - piece.cols.start, window,
                        like.device)
    return mask_kernel(kernel, like), mask_QS[None].expand(piece.b.stop - piece.b.start, -1, -1)


def block_forward(
    kernel: AttentionKernel,
    q_BQHD: Tensor,
    k_BSKD: Tensor,
    v_BSKD: Tensor,
    *,
    causal: bool,
    scale: float,
    cut: Cut = Cut(),
) -> BlockOutput:
    """The block's output and LSE, cut as ``cut`` says (see the module doc)."""
    if cut.whole:
        return kernel.forward(q_BQHD, k_BSKD, v_BSKD, causal=causal, scale=scale)
    B, Q, H, _ = q_BQHD.shape
    fp64 = q_BQHD.dtype == torch.float64
    acc = torch.float64 if fp64 else torch.float32  # as the kernels give the LSE
    out_BQHD = torch.zeros(q_BQHD.shape, dtype=acc, device=q_BQHD.device)
    lse_BHQ = torch.full((B, H, Q), -math.inf, dtype=acc, device=q_BQHD.device)
    written: set[tuple[int, int, int]] = set()
    auxes = []
    for piece in _pieces(B, Q, k_BSKD.shape[1], causal, cut):
        run, visible = _run_kernel(kernel, piece, q_BQHD)
        b, rows, cols = piece.b, piece.rows, piece.cols
        res = run.forward(q_BQHD[b, rows], k_BSKD[b, cols], v_BSKD[b, cols], causal=piece.causal, scale=scale,
                          visible_BQS=visible)
        auxes.append(res.aux)
        key = (b.start, rows.start, rows.stop)
        if key in written:  # another piece of the same rows: merge through the LSEs
            merge_into_(out_BQHD[b, rows], lse_BHQ[b, :, rows], res.out_BQHD, res.lse_BHQ)
        else:
            out_BQHD[b, rows] = res.out_BQHD
            lse_BHQ[b, :, rows] = res.lse_BHQ
            written.add(key)
    return BlockOutput(out_BQHD.to(q_BQHD.dtype), lse_BHQ if fp64 else lse_BHQ.float(), auxes)


def block_backward(
    kernel: AttentionKernel,
    dout_BQHD: Tensor,
    q_BQHD: Tensor,
    k_BSKD: Tensor,
    v_BSKD: Tensor,
    out_BQHD: Tensor,
    lse_BHQ: Tensor,
    aux: Any,
    *,
    causal: bool,
    scale: float,
    cut: Cut = Cut(),
) -> Grads:
    """The block's gradients for the merged ``out``/``lse`` of its rows; cut as the forward was."""
    if cut.whole:
        return kernel.backward(dout_BQHD, q_BQHD, k_BSKD, v_BSKD, out_BQHD, lse_BHQ, aux, causal=causal, scale=scale)
    # fp32 (fp64 for fp64 inputs): several pieces add into the same rows and columns.
    acc = torch.float64 if q_BQHD.dtype == torch.float64 else torch.float32
    dq_BQHD = torch.zeros(q_BQHD.shape, dtype=acc, device=q_BQHD.device)
    dk_BSKD = torch.zeros(k_BSKD.shape, dtype=acc, device=k_BSKD.device)
    dv_BSKD = torch.zeros(v_BSKD.shape, dtype=acc, device=v_BSKD.device)
    pieces = _pieces(q_BQHD.shape[0], q_BQHD.shape[1], k_BSKD.shape[1], causal, cut)
    for piece, piece_aux in zip(pieces, aux):
        run, visible = _run_kernel(kernel, piece, q_BQHD)
        b, rows, cols = piece.b, piece.rows, piece.cols
        dq, dk, dv = run.backward(
            dout_BQHD[b, rows], q_BQHD[b, rows], k_BSKD[b, cols], v_BSKD[b, cols], out_BQHD[b, rows],
            lse_BHQ[b, :, rows], piece_aux, causal=piece.causal, scale=scale, visible_BQS=visible,
        )
        dq_BQHD[b, rows] += dq
        dk_BSKD[b, cols] += dk
        dv_BSKD[b, cols] += dv
    return dq_BQHD.to(q_BQHD.dtype), dk_BSKD.to(k_BSKD.dtype), dv_BSKD.to(v_BSKD.dtype)
