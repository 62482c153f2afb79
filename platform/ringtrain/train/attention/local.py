"""Single-rank attention through a block kernel, as an autograd function.

The "no context parallelism" path, and the attention Ulysses runs over the gathered sequence.

Shape legend: B batch, S sequence, H query heads, K key/value heads, D head dim.
"""

from __future__ import annotations

from typing import Any, Optional, Union

import numpy as np
import torch

from ringtrain.train.attention.blocks import Cut, block_backward, block_forward
from ringtrain.train.attention.documents import Documents
from ringtrain.train.attention.block_kernel import AttentionKernel, default_scale
from ringtrain.train.attention.kernels import KernelArg, resolve_kernel

Tensor = torch.Tensor


class _LocalAttention(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        q_BSHD: Tensor,
        k_BSKD: Tensor,
        v_BSKD: Tensor,
        docs: Optional[Documents],
        causal: bool,
        kernel: AttentionKernel,
        scale: float,
        window: Optional[int],
    ) -> Tensor:
        host_BS = None if docs is None else docs.host_BS
        positions = None if window is None else np.arange(q_BSHD.shape[1])
        cut = Cut(host_BS, host_BS, window, positions, positions)
        res = block_forward(kernel, q_BSHD, k_BSKD, v_BSKD, causal=causal, scale=scale, cut=cut)
        out_BSHD = res.out_BQHD.to(q_BSHD.dtype)
        ctx.save_for_backward(q_BSHD, k_BSKD, v_BSKD, out_BSHD, res.lse_BHQ)
        ctx.aux, ctx.causal, ctx.kernel, ctx.scale, ctx.cut = res.aux, causal, kernel, scale, cut
        return out_BSHD

    @staticmethod
    def backward(ctx: Any, dout_BSHD: Tensor) -> tuple[Optional[Tensor], ...]:  # type: ignore[override]
        q_BSHD, k_BSKD, v_BSKD, out_BSHD, lse_BHS = ctx.saved_tensors
        dq, dk, dv = block_backward(
            ctx.kernel,
            dout_BSHD,
            q_BSHD,
            k_BSKD,
            v_BSKD,
            out_BSHD,
            lse_BHS,
            ctx.aux,
            causal=ctx.causal,
            scale=ctx.scale,
            cut=ctx.cut,
        )
        return dq.to(q_BSHD.dtype), dk.to(k_BSKD.dtype), dv.to(v_BSKD.dtype), None, None, None, None, None


def check_window(window: Optional[int], causal: bool) -> None:
    """Raise ValueError unless ``window`` is None or a positive token count of causal attention."""
    if window is None:
        return
    if window < 1:
        raise ValueError(f"a sliding window must hold at least one token, got {window}")
    if not causal:
        raise ValueError("a sliding window is causal: it needs causal=True")


def check_qkv(q_BSHD: Tensor, k_BSKD: Tensor, v_BSKD: Tensor, doc_ids: Optional[Union[Tensor, Documents]]) -> None:
    """Raise ValueError unless q, k, v (and doc ids) have consistent [B, S, heads, D] shapes."""
    if q_BSHD.dim() != 4 or k_BSKD.dim() != 4 or k_BSKD.shape != v_BSKD.shape:
        shapes = ", ".join(str(tuple(t.shape)) for t in (q_BSHD, k_BSKD, v_BSKD))
        raise ValueError(f"want q [B, S, H, D] and k, v [B, S, K, D]; got {shapes}")
    B, S, H, D = q_BSHD.shape
    if k_BSKD.shape[:2] != (B, S) or k_BSKD.shape[3] != D:
        raise ValueError(
            f"q {tuple(q_BSHD.shape)} and k {tuple(k_BSKD.shape)} disagree on batch, sequence or head dim"
        )
    if H % k_BSKD.shape[2]:
        raise ValueError(f"{H} query heads are not a multiple of {k_BSKD.shape[2]} key/value heads")
    if doc_ids is not None and tuple(doc_ids.shape) != (B, S):
        raise ValueError(f"doc_ids has shape {tuple(doc_ids.shape)}, want [B, S] = {(B, S)}")


def local_attention(
    q_BSHD: Tensor,
    k_BSKD: Tensor,
    v_BSKD: Tensor,
    *,
    causal: bool = True,
    doc_ids: Optional[Union[Tensor, Documents]] = None,
    kernel: KernelArg = "auto",
    scale: Optional[float] = None,
    window: Optional[int] = None,
) -> Tensor:
    """Attention over this rank's whole sequence; ``doc_ids`` [B, S] (ids, or ``Documents``)
    confines it to documents, ``window`` (tokens, causal only) to a sliding window."""
    check_qkv(q_BSHD, k_BSKD, v_BSKD, doc_ids)
    check_window(window, causal)
    return _LocalAttention.apply(
        q_BSHD,
        k_BSKD,
        v_BSKD,
        Documents.of(doc_ids),
        causal,
        resolve_kernel(kernel, q_BSHD),
        default_scale(q_BSHD.shape[-1]) if scale is None else scale,
        window,
    )
