"""Merging partial attention results over disjoint key sets through their log-sum-exps.

With a = lse, b = blk_lse and m = max(a, b) (the online-softmax rescaling of Milakov &
Gimelshein 2018, as used by FlashAttention-2, Dao 2023, Sec. 3.1):

    lse' = m + log(e^(a-m) + e^(b-m))
    out' = (e^(a-m) out + e^(b-m) blk_out) / (e^(a-m) + e^(b-m))

Equivalent to the usual ``out - sigmoid(b - a) * (out - blk_out)``, but that form is NaN when
a = b = -inf (a query row with no visible key in either part). Here m is replaced by 0 on such
rows, both weights are 0, and the row stays at out 0, lse -inf.

Two forms: ``merge_partials`` returns new fp32 tensors (the reference), and ``merge_into_``
updates an fp32 accumulator in place, views included (a ring's half-block rows), so nothing is
copied out and back. On CUDA, where Triton runs, ``merge_into_`` is one kernel
(``merge_kernel``); elsewhere it is five or six in-place ops: the block's share of a row is
sigmoid(b - a), the output moves that far towards the block's (``lerp_``), and the LSE becomes
logaddexp(a, b) (which keeps -inf where both are).

Shape legend: B batch, Q query rows, H heads, D head dim.
"""

from __future__ import annotations

import functools
from types import ModuleType
from typing import Optional

import torch

Tensor = torch.Tensor


def merge_partials(
    out_BQHD: Tensor, lse_BHQ: Tensor, blk_out_BQHD: Tensor, blk_lse_BHQ: Tensor
) -> tuple[Tensor, Tensor]:
    """Combine two softmax-normalised partials ``(out, lse)``; returns ``(out, lse)`` in fp32, or
    fp64 where either LSE is."""
    dtype = torch.promote_types(torch.promote_types(lse_BHQ.dtype, blk_lse_BHQ.dtype), torch.float32)
    a, b = lse_BHQ.to(dtype), blk_lse_BHQ.to(dtype)
    m = torch.maximum(a, b)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    wa, wb = torch.exp(a - m), torch.exp(b - m)
    total = wa + wb
    merged_lse = m + torch.log(total)
    inv = torch.where(total > 0, 1.0 / total, torch.zeros_like(total))
    wa_BQH1 = (wa * inv).transpose(1, 2).unsqueeze(-1)
    wb_BQH1 = (wb * inv).transpose(1, 2).unsqueeze(-1)
    merged_out = wa_BQH1 * out_BQHD.to(dtype) + wb_BQH1 * blk_out_BQHD.to(dtype)
    return merged_out, merged_lse


@functools.lru_cache(maxsize=None)
def _triton_merge() -> Optional[ModuleType]:
    """The Triton kernel's module, or None where Triton cannot be imported."""
    try:
        from ringtrain.train.attention import merge_kernel
    except ImportError:
        return None
    return merge_kernel


def merge_into_(
    acc_out: Tensor, acc_lse_BHQ: Tensor, blk_out: Tensor, blk_lse_BHQ: Tensor, *, seq_dim: int = 1,
    may_be_empty: bool = True,
) -> None:
    """``(acc_out, acc_lse) <- merge(acc, blk)`` in place; the accumulators are fp32 (float64 LSEs
    of float64 inputs too) and may be strided views of larger tensors, the block's output in any
    float dtype. Outputs are ``[B, Q, H, D]`` (``seq_dim`` 1) or ``[B, H, Q, D]`` (2).
    ``may_be_empty``: whether a row may have seen no key in both (False saves a launch)."""
    fp32 = acc_out.dtype == acc_lse_BHQ.dtype == torch.float32
    kernel = _triton_merge() if acc_out.is_cuda and fp32 else None
    if kernel is not None:
        if seq_dim == 2:
            acc_out, blk_out = acc_out.transpose(1, 2), blk_out.transpose(1, 2)
        kernel.merge_into_(acc_out, acc_lse_BHQ, blk_out, blk_lse_BHQ)
        return
    # The block's share of each row is sigmoid(b - a) = e^b / (e^a + e^b): NaN only where both are
    # -inf (a row that saw nothing in either), where the row must stay as it is (share 0).
    share_BHQ = (blk_lse_BHQ - acc_lse_BHQ).sigmoid_()
    if may_be_empty:
        share_BHQ.nan_to_num_(0.0)
    share = share_BHQ.unsqueeze(-1) if seq_dim == 2 else share_BHQ.transpose(1, 2).unsqueeze(-1)
    acc_out.lerp_(blk_out if blk_out.dtype == acc_out.dtype else blk_out.to(acc_out.dtype), share)
    torch.logaddexp(acc_lse_BHQ, blk_lse_BHQ, out=acc_lse_BHQ)
