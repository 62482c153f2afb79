"""The one loop of context-parallel attention: visit by visit, block by block, merged by LSE.

Every layout runs here. The exchange (``exchanges``) yields each visit's K/V as it arrives; the
plan (``plan``) says which blocks of this rank's rows each visit holds and how each runs; each
block's output merges into its rows' accumulator through the LSEs (``merge.merge_into_``).
The backward walks the same plan with the merged output and LSE, adds each block's dQ to its
rows and its dK/dV to the visit's accumulator the exchange hands it (``accumulator``), and the
exchange brings the dK/dV home. A call of one block that nothing cuts (one rank's own K/V, as Ulysses' gathered
sequence and a run without context parallelism have, with no documents and no window:
``AttentionCall.one_block``) is the kernel's one call, forward and backward: no plan to walk,
no rows to merge, nothing to exchange, and no round trip through the fp32 accumulators.

Tensors stay in the block kernel's layout from the first op to the last (``to_layout``: BHSD for
torch's fused ops), so no block transposes anything; outputs and LSEs are kept as the kernel
gave them where a block covers every row, and merged in place otherwise. ``ContextParallel`` is
the autograd function of every layout but Ulysses'; ``attend_forward``/``attend_backward`` are
its halves, callable without autograd: Ulysses runs them inside its own function (``ulysses``),
and the tests' one-process emulator runs every rank's in threads.

Shape legend: B batch, S local sequence, H query heads, K key/value heads, D head dim; the
sequence dim is the kernel's (``AttentionKernel.seq_dim``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any, Optional, TypeVar

import torch

from ringtrain.train.attention.accumulator import VisitAccumulator
from ringtrain.train.attention.block_kernel import AttentionKernel, BlockOutput, Grads, accumulation_dtype
from ringtrain.train.attention.blocks import block_backward, block_forward
from ringtrain.train.attention.call import AttentionCall
from ringtrain.train.attention.exchanges.base import Exchange
from ringtrain.train.attention.merge import merge_into_
from ringtrain.train.attention.plan import EMPTY, MASKED, PIECES, WHOLE, PlannedBlock, Visit, exchange_for, plan

Tensor = torch.Tensor
_T = TypeVar("_T")


def _narrow(x: Tensor, dim: int, span: tuple[int, int], whole: bool) -> Tensor:
    return x if whole else x.narrow(dim, span[0], span[1] - span[0])


def _block_forward(kernel: AttentionKernel, blk: PlannedBlock, q: Tensor, k: Tensor, v: Tensor,
                   scale: float) -> BlockOutput:
    if blk.how == PIECES:  # the pieces run through the kernel's own interface, BSHD
        res = block_forward(kernel, *kernel.from_layout(q, k, v), causal=blk.causal, scale=scale, cut=blk.cut,
                            pieces=blk.pieces)
        return BlockOutput(kernel.to_layout(res.out_BQHD)[0], res.lse_BHQ, res.aux)
    mask = blk.mask if blk.how == MASKED else None
    return kernel.forward_in_layout(q, k, v, causal=blk.causal, scale=scale, visible=mask)


def _block_backward(kernel: AttentionKernel, blk: PlannedBlock, dout: Tensor, q: Tensor, k: Tensor, v: Tensor,
                    out: Tensor, lse: Tensor, aux: Any, scale: float) -> Grads:
    if blk.how == PIECES:
        grads = block_backward(kernel, *kernel.from_layout(dout, q, k, v, out), lse, aux, causal=blk.causal,
                               scale=scale, cut=blk.cut, pieces=blk.pieces)
        return kernel.to_layout(*grads)  # type: ignore[return-value]
    mask = blk.mask if blk.how == MASKED else None
    return kernel.backward_in_layout(dout, q, k, v, out, lse, aux, causal=blk.causal, scale=scale, visible=mask)


class _Rows:
    """Per-rows partial results: a block's own tensors where it starts a set of rows, merged (or,
    for gradients, added) in place by every later block of those rows or of a part of them."""

    def __init__(self, seq_dim: int, seq_local: int) -> None:
        self.seq_dim, self.seq_local = seq_dim, seq_local
        self.parts: dict[tuple[int, int], tuple[Tensor, ...]] = {}

    def merge(self, rows: tuple[int, int], out: Tensor, lse_BHQ: Tensor, may_be_empty: bool) -> None:
        """A block's output and LSE into its rows'."""
        held = _holder(self.parts, rows)
        if held is None:
            self.parts[rows] = (out if out.dtype == accumulation_dtype(out.dtype) else out.float(), lse_BHQ)
            return
        span, whole, (acc_out, acc_lse) = held
        merge_into_(_narrow(acc_out, self.seq_dim, span, whole), _narrow(acc_lse, 2, span, whole), out, lse_BHQ,
                    seq_dim=self.seq_dim, may_be_empty=may_be_empty)

    def add(self, rows: tuple[int, int], grad: Tensor) -> None:
        """A block's gradient into its rows'."""
        held = _holder(self.parts, rows)
        if held is None:
            self.parts[rows] = (grad if grad.dtype == accumulation_dtype(grad.dtype) else grad.float(),)
            return
        span, whole, (acc,) = held
        _narrow(acc, self.seq_dim, span, whole).add_(grad)

    def joined(self, empty: Callable[[], Tensor]) -> Tensor:
        """Every row's output (or gradient): the parts joined, and where they leave rows that no
        block reached, written into ``empty()`` (zeros)."""
        if len(self.parts) == 1:  # one set of rows, as a local call or a ring's diagonal has: no sorting
            ((span, parts),) = self.parts.items()
            if span == (0, self.seq_local):
                return parts[0]
        spans = sorted(self.parts)
        tiled = bool(spans) and spans[0][0] == 0 and spans[-1][1] == self.seq_local and all(
            a[1] == b[0] for a, b in zip(spans, spans[1:]))
        if tiled:
            firsts = [self.parts[span][0] for span in spans]
            return firsts[0] if len(firsts) == 1 else torch.cat(firsts, dim=self.seq_dim)
        blank = empty()
        for span, parts in self.parts.items():
            _narrow(blank, self.seq_dim, span, False).copy_(parts[0])
        return blank


def _holder(parts: Mapping[tuple[int, int], _T], rows: tuple[int, int]) -> Optional[tuple[tuple[int, int], bool, _T]]:
    """The part whose rows hold ``rows``: ``rows`` relative to it, whether they are all of it, the part."""
    part = parts.get(rows)
    if part is not None:
        return (0, rows[1] - rows[0]), True, part
    for (start, stop), part in parts.items():
        if start <= rows[0] and rows[1] <= stop:
            return (rows[0] - start, rows[1] - start), rows == (start, stop), part
    return None


def attend_forward(ctx: Any, call: AttentionCall, q_BSHD: Tensor, k_BSKD: Tensor, v_BSKD: Tensor, *,
                   in_layout: bool = False) -> Tensor:
    """This rank's output ``[B, S, H, D]`` in q's dtype; what the backward needs goes on ``ctx``.
    ``in_layout``: q, k, v and the output are in the kernel's layout instead (Ulysses gathers its
    sequence straight into it)."""
    kernel = call.kernel
    q, k, v = (q_BSHD, k_BSKD, v_BSKD) if in_layout else kernel.to_layout(q_BSHD, k_BSKD, v_BSKD)
    exchange: Optional[Exchange] = None
    visits: tuple[Visit, ...] = ()
    if call.one_block:
        # The kernel's one call is the whole result: no plan to walk, no rows to merge, no K/V
        # to exchange (the K/V are the backward's as they are).
        res = kernel.forward_in_layout(q, k, v, causal=call.causal, scale=call.scale)
        out, lses, auxes, kept = res.out_BQHD, {(0, call.seq_local): res.lse_BHQ}, [res.aux], (k, v)
    else:
        exchange = exchange_for(call)
        visits = plan(call, exchange, q.shape[0], q.device)
        out, lses, auxes = _visits_forward(call, exchange, visits, q, k, v)
        kept, exchange.kept = exchange.kept, ()
    # In q's dtype, and contiguous where it leaves in BSHD; cast only where it is not (a cast that
    # changes nothing is still a dispatch).
    if in_layout:
        out_BSHD = out if out.dtype == q.dtype else out.to(q.dtype)
    else:
        (out_BSHD,) = kernel.from_layout(out)
        if out_BSHD.dtype != q.dtype or not out_BSHD.is_contiguous():
            out_BSHD = out_BSHD.to(q.dtype, memory_format=torch.contiguous_format)
    # The LSEs as merged, a tensor a set of rows: the backward reads each set's own. q is kept in
    # the kernel's layout (a view of the input), so the backward lays out only dout and out.
    ctx.save_for_backward(q, out_BSHD, *lses.values(), *kept)
    ctx.call, ctx.exchange, ctx.visits, ctx.auxes = call, exchange, visits, auxes
    ctx.kv_dtype = k_BSKD.dtype
    ctx.lse_spans, ctx.in_layout = list(lses), in_layout
    return out_BSHD


def _visits_forward(call: AttentionCall, exchange: Exchange, visits: tuple[Visit, ...], q: Tensor, k_l: Tensor,
                    v_l: Tensor) -> tuple[Tensor, dict[tuple[int, int], Tensor], list[Any]]:
    """The loop's forward: every rank's output (accumulation dtype), the LSE of each set of rows,
    and each block's kernel state, in the kernel's layout."""
    kernel, seq = call.kernel, call.kernel.seq_dim
    rows = _Rows(seq, call.seq_local)
    auxes: list[Any] = []
    q_rows: dict[tuple[int, int], Tensor] = {}  # each set of rows cut once, for every block of it
    for visit, (k, v) in zip(visits, exchange.forward(k_l, v_l), strict=True):
        for blk in visit.blocks:
            if blk.how == EMPTY:
                continue
            if blk.rows not in q_rows:
                q_rows[blk.rows] = _narrow(q, seq, blk.rows, blk.all_rows)
            k_b, v_b = (k, v) if blk.all_cols else exchange.cut((k, v), seq, blk.cols)
            res = _block_forward(kernel, blk, q_rows[blk.rows], k_b, v_b, call.scale)
            auxes.append(res.aux)
            rows.merge(blk.rows, res.out_BQHD, res.lse_BHQ, may_be_empty=blk.how != WHOLE)
    out = rows.joined(lambda: torch.zeros(q.shape, dtype=accumulation_dtype(q.dtype), device=q.device))
    return out, {span: parts[1] for span, parts in rows.parts.items()}, auxes


def attend_backward(ctx: Any, dout_BSHD: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(dq, dk, dv)`` of this rank's shard, in the inputs' dtypes (and in the kernel's layout,
    as ``dout`` is, where the forward was ``in_layout``)."""
    q, out_BSHD, *saved = ctx.saved_tensors
    lses = dict(zip(ctx.lse_spans, saved))
    kept = saved[len(ctx.lse_spans):]
    call: AttentionCall = ctx.call
    kernel, in_layout = call.kernel, ctx.in_layout
    dout, out = (dout_BSHD, out_BSHD) if in_layout else kernel.to_layout(dout_BSHD, out_BSHD)
    if call.one_block:  # the forward's one call
        (lse,) = lses.values()
        dq, dk, dv = kernel.backward_in_layout(dout, q, kept[0], kept[1], out, lse, ctx.auxes[0], causal=call.causal,
                                               scale=call.scale)
    else:
        dq, dk, dv = _visits_backward(call, ctx.exchange, ctx.visits, iter(ctx.auxes), dout, q, out, lses,
                                      tuple(kept))
    # A cast is a copy: where one is made, it also lays a BSHD gradient out contiguous, as the
    # input's own gradient must be (autograd, or the projection's backward, would copy it again).
    layout = torch.preserve_format if in_layout else torch.contiguous_format
    if not in_layout:
        dq, dk, dv = kernel.from_layout(dq, dk, dv)
    if dq.dtype != q.dtype:
        dq = dq.to(q.dtype, memory_format=layout)
    if dk.dtype != ctx.kv_dtype:
        dk, dv = dk.to(ctx.kv_dtype, memory_format=layout), dv.to(ctx.kv_dtype, memory_format=layout)
    return dq, dk, dv


def _visits_backward(call: AttentionCall, exchange: Exchange, visits: tuple[Visit, ...], auxes: Iterator[Any],
                     dout: Tensor, q: Tensor, out: Tensor, lses: Mapping[tuple[int, int], Tensor],
                     kept: tuple[Tensor, ...]) -> tuple[Tensor, Tensor, Tensor]:
    """The loop's backward: dQ, dK and dV in the kernel's layout (dQ in the accumulation dtype,
    dK/dV as the exchange brings them home)."""
    kernel, seq, scale = call.kernel, call.kernel.seq_dim, call.scale
    acc = accumulation_dtype(q.dtype)
    # Each set of rows cut once, for every block of it: dout, q, out, and the LSE contiguous (as
    # the kernels' backward ops take it).
    by_rows: dict[tuple[int, int], tuple[Tensor, ...]] = {}
    dq_rows = _Rows(seq, call.seq_local)

    def lse_of(rows: tuple[int, int]) -> Tensor:
        held = _holder(lses, rows)
        assert held is not None, f"no block of rows {rows} in the forward"
        span, whole, lse_BHQ = held
        return _narrow(lse_BHQ, 2, span, whole).contiguous()

    def visit_backward(index: int, k: Tensor, v: Tensor, dkv: VisitAccumulator) -> None:
        for blk in visits[index].blocks:
            if blk.how == EMPTY:
                continue
            if blk.rows not in by_rows:
                by_rows[blk.rows] = (*(_narrow(x, seq, blk.rows, blk.all_rows) for x in (dout, q, out)),
                                     lse_of(blk.rows))
            dout_b, q_b, out_b, lse_b = by_rows[blk.rows]
            k_b, v_b = (k, v) if blk.all_cols else exchange.cut((k, v), seq, blk.cols)
            dq, dk, dv = _block_backward(kernel, blk, dout_b, q_b, k_b, v_b, out_b, lse_b, next(auxes), scale)
            dq_rows.add(blk.rows, dq)
            dkv.add(dk, dv, blk.cols, blk.all_cols, seq)

    dkv = exchange.backward(kept, visit_backward)
    dq = dq_rows.joined(lambda: torch.zeros(q.shape, dtype=acc, device=q.device))
    dk, dv = dkv.unbind(0) if isinstance(dkv, Tensor) else dkv
    return dq, dk, dv


class ContextParallel(torch.autograd.Function):
    """The autograd function of every layout but Ulysses' and the hybrid's (``ulysses`` runs the
    halves inside its own): ``attend_forward`` and ``attend_backward``."""

    @staticmethod
    def forward(ctx: Any, q_BSHD: Tensor, k_BSKD: Tensor, v_BSKD: Tensor, call: AttentionCall) -> Tensor:  # type: ignore[override]
        return attend_forward(ctx, call, q_BSHD, k_BSKD, v_BSKD)

    @staticmethod
    def backward(ctx: Any, dout_BSHD: Tensor) -> tuple[Optional[Tensor], ...]:  # type: ignore[override]
        return (*attend_backward(ctx, dout_BSHD), None)


def attend(call: AttentionCall, q_BSHD: Tensor, k_BSKD: Tensor, v_BSKD: Tensor) -> Tensor:
    """``call`` on this rank's shards, through autograd."""
    out: Tensor = ContextParallel.apply(q_BSHD, k_BSKD, v_BSKD, call)
    return out
