"""The plan of a call: each visit's blocks, each with its cut, and how it runs, made once.

A block is rows of this rank's shard against columns of a visit's K/V (``blocks.Block``). Where
packed documents or a sliding window leave only part of it visible, the block has a ``Cut``
(``cut_of``, the one place a cut is built: the rows' and columns' documents and positions, sliced
to the block) and runs one of three ways:

- ``MASKED``: one call with the block's mask, on a kernel that takes masks, when the block is
  short (at most ``MASKED_BELOW_SCORES`` scores): there one call beats a call per piece, and the
  mask is small;
- ``PIECES``: cut into unmasked pieces (``blocks``): every longer block, and every block of a
  kernel that takes no mask;
- ``EMPTY``: nothing in it is visible: no call at all.

An uncut block is ``WHOLE``: one call. A causal block wider than tall (a chunk's rows against
its whole prefix and itself, as all-gathered K/V give them) is one call too where the kernel
aligns its causal mask bottom-right (flash-attn), and one masked call where the block is short
and the kernel takes masks; otherwise the plan splits it into its causal diagonal and the
prefix, which every kernel runs (two calls and a merge). The plan depends only on the layout
(and the documents, with which it is kept for the forward: every layer and the backward share
it), so it is made once, not per layer and again in the backward.

Shape legend: B batch, Q / S a block's rows / columns.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch
from torch._subclasses.fake_tensor import FakeTensor

from ringtrain.train.attention.block_kernel import BlockMask
from ringtrain.train.attention.blocks import Block, Cut, Piece, pieces_of
from ringtrain.train.attention.call import AttentionCall, Side
from ringtrain.train.attention.documents import doc_visibility
from ringtrain.train.attention.exchanges import EXCHANGES, Exchange
from ringtrain.train.attention.window import band_mask

WHOLE, MASKED, PIECES, EMPTY = "whole", "masked", "pieces", "empty"
# A block of at most this many scores takes one masked call rather than a call per piece.
MASKED_BELOW_SCORES = 128 * 128


@dataclass(frozen=True)
class PlannedBlock:
    rows: tuple[int, int]  # [start, stop) of this rank's rows
    cols: tuple[int, int]  # [start, stop) of the visit's columns
    all_rows: bool
    all_cols: bool
    causal: bool
    how: str
    cut: Cut = Cut()
    mask: Optional[BlockMask] = None
    pieces: Optional[list[Piece]] = None


@dataclass(frozen=True)
class Visit:
    source: int
    blocks: tuple[PlannedBlock, ...]


def cut_of(block: Block, rows: Side, cols: Side, window: Optional[int], family: int = 0) -> Cut:
    """What cuts ``block``: its rows' and columns' documents (and their families) and, under a
    window, their positions (and lags, with families)."""
    docs: dict[str, Any] = {}
    if rows.docs_BS is not None and cols.docs_BS is not None:
        docs = {"q_docs_BQ": rows.docs_BS[:, block.rows], "k_docs_BS": cols.docs_BS[:, block.cols], "family": family}
    if window is None:
        return Cut(**docs)
    if rows.lags_BS is not None and cols.lags_BS is not None:
        docs.update(q_lags_BQ=rows.lags_BS[:, block.rows], k_lags_BS=cols.lags_BS[:, block.cols])
    return Cut(**docs, window=window, q_positions=rows.positions[block.rows], k_positions=cols.positions[block.cols])


def cut_visibility(cut: Cut, causal: bool, batch: int, q_len: int, k_len: int) -> np.ndarray:
    """``[B, Q, S]``: which scores of a block ``cut`` leaves. Under a window the position ids say
    what is causal; otherwise a causal block's rows are the last of its columns (a square on the
    diagonal, and for a block wider than tall the prefix before it)."""
    visible = np.ones((1, q_len, k_len), dtype=bool)
    if causal and cut.window is None:
        visible &= np.tril(visible[0], k_len - q_len)[None]
    if cut.q_docs_BQ is not None and cut.k_docs_BS is not None:
        visible = visible & doc_visibility(cut.q_docs_BQ, cut.k_docs_BS, cut.family)
    if cut.window is not None:
        visible = visible & band_mask(*cut.position_ids(), cut.window)
    return np.broadcast_to(visible, (batch, q_len, k_len))


def _span(index: slice, length: int) -> tuple[int, int]:
    start, stop, _ = index.indices(length)
    return start, stop


def _planned_blocks(call: AttentionCall, block: Block, rows: Side, cols: Side, batch: int, k_len: int,
                    device: torch.device) -> tuple[PlannedBlock, ...]:
    """``block`` planned: one block, or for a wide causal block that no single call here runs, its
    causal diagonal and then its prefix (the diagonal first: its rows' LSE is finite from the start)."""
    one = _planned(call, block, rows, cols, batch, k_len, device)
    if one is not None:
        return (one,)
    (row_start, row_stop), (col_start, col_stop) = _span(block.rows, call.seq_local), _span(block.cols, k_len)
    diagonal = col_stop - (row_stop - row_start)
    parts = (Block(block.rows, slice(diagonal, col_stop), causal=True),
             Block(block.rows, slice(col_start, diagonal), causal=False))
    return tuple(b for part in parts for b in _planned_blocks(call, part, rows, cols, batch, k_len, device))


def _planned(call: AttentionCall, block: Block, rows: Side, cols: Side, batch: int, k_len: int,
             device: torch.device) -> Optional[PlannedBlock]:
    """``block`` as one planned block, or None for a wide causal block that no single call here runs."""
    row_span, col_span = _span(block.rows, call.seq_local), _span(block.cols, k_len)
    q_len, s_len = row_span[1] - row_span[0], col_span[1] - col_span[0]
    spans = dict(rows=row_span, cols=col_span, all_rows=q_len == call.seq_local, all_cols=s_len == k_len,
                 causal=block.causal)
    wide_causal = block.causal and s_len > q_len
    cut = cut_of(block, rows, cols, call.window, call.docs.family if call.docs is not None else 0)
    if cut.whole and (not wide_causal or call.kernel.aligns_causal_bottom_right):
        return PlannedBlock(**spans, how=WHOLE)
    if call.kernel.supports_mask and q_len * s_len <= MASKED_BELOW_SCORES:
        visible = cut_visibility(cut, block.causal, batch, q_len, s_len)
        if not visible.any():
            return PlannedBlock(**spans, how=EMPTY)
        # Causality is in the mask: the call itself is not causal.
        mask = BlockMask(torch.tensor(visible, device=device), any_unseen=not visible.any(axis=-1).all())
        return PlannedBlock(**{**spans, "causal": False}, how=MASKED, cut=cut, mask=mask)
    if wide_causal:
        return None
    pieces = pieces_of(batch, q_len, s_len, block.causal, cut)
    return PlannedBlock(**spans, how=PIECES if pieces else EMPTY, cut=cut, pieces=pieces)


def _make(call: AttentionCall, exchange: Exchange, batch: int, device: torch.device) -> tuple[Visit, ...]:
    rows = call.shard_side(call.rank)
    visits = []
    for spec in exchange.visits():
        k_len = len(spec.cols.positions)
        blocks = (p for b in spec.blocks for p in _planned_blocks(call, b, rows, spec.cols, batch, k_len, device))
        visits.append(Visit(spec.source, tuple(blocks)))
    return tuple(visits)


# Plans without documents depend on the layout alone: kept for the next forward, the least
# recently used first to go. More than one thread may plan (the tests' emulator runs each rank
# as one; on a GPU a backward's recomputed forward runs on autograd's device thread): a plan
# found is moved to the end under the lock, so that no other thread evicts it in between.
_LAYOUT_PLANS: OrderedDict[tuple[object, ...], tuple[Visit, ...]] = OrderedDict()
_LAYOUT_PLANS_KEPT = 256
_LAYOUT_PLANS_LOCK = threading.Lock()


def plan(call: AttentionCall, exchange: Exchange, batch: int, device: torch.device) -> tuple[Visit, ...]:
    """The visits of ``call``'s exchange, each block planned; kept with the documents (for the
    forward) or, without any, for the layout."""
    key = (*call.plan_key(), batch, device)
    if call.docs is not None:
        visits: tuple[Visit, ...] = call.docs.cached(("plan", *key), lambda: _make(call, exchange, batch, device))
        return visits
    with _LAYOUT_PLANS_LOCK:
        found = _LAYOUT_PLANS.get(key)
        if found is not None:
            _LAYOUT_PLANS.move_to_end(key)
            return found
    made = _make(call, exchange, batch, device)
    # A mask made under a fake-tensor mode (the tests' CUDA stand-in) belongs to that mode alone.
    if not any(isinstance(b.mask.visible_BQS, FakeTensor) for v in made for b in v.blocks if b.mask is not None):
        with _LAYOUT_PLANS_LOCK:
            _LAYOUT_PLANS[key] = made
            while len(_LAYOUT_PLANS) > _LAYOUT_PLANS_KEPT:
                _LAYOUT_PLANS.popitem(last=False)
    return made


def exchange_for(call: AttentionCall) -> Exchange:
    """The exchange ``call`` runs."""
    return EXCHANGES[call.exchange](call)
