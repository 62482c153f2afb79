"""One attention block through a block kernel, cut at document boundaries when documents are packed.

Without documents a block is one kernel call. With packed documents a query sees only keys of
its own document: the block is cut into one unmasked rectangle per document
(``documents.segments``), each run on the block's kernel, causal where the block is, and written
into the block's output; a row whose document has no key here (padding included) keeps output 0
and LSE -inf. No [Q, S] mask is made, no kernel is swapped for a mask-capable one, and a block
costs a call per document it holds. The backward cuts the same way, against the merged output
and LSE of each rectangle's rows.

A rectangle of a causal block is square and on its diagonal: a causal block's rows and columns
are the same positions, so a document's runs in both are the same slice.

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
from ringtrain.train.attention.documents import Segment, segments
from ringtrain.train.attention.merge import merge_partials

Tensor = torch.Tensor


@dataclass(frozen=True)
class Block:
    """Which local query rows attend to which columns of the K/V at hand (a ring's visiting
    block, or the whole gathered sequence), and how."""

    rows: slice
    cols: slice
    causal: bool


def _cut(q_docs_BQ: np.ndarray, k_docs_BS: np.ndarray, causal: bool) -> list[Segment]:
    cut = segments(q_docs_BQ, k_docs_BS)
    if causal and any(seg.rows != seg.cols for seg in cut):
        raise ValueError("a causal block's documents must sit on its diagonal: its rows and columns are one range")
    return cut


def block_forward(
    kernel: AttentionKernel,
    q_BQHD: Tensor,
    k_BSKD: Tensor,
    v_BSKD: Tensor,
    *,
    causal: bool,
    scale: float,
    q_docs_BQ: Optional[np.ndarray] = None,
    k_docs_BS: Optional[np.ndarray] = None,
) -> BlockOutput:
    """The block's output and LSE; ``q_docs_BQ`` / ``k_docs_BS``: the rows' and columns'
    documents on the host (both or neither)."""
    if q_docs_BQ is None or k_docs_BS is None:
        return kernel.forward(q_BQHD, k_BSKD, v_BSKD, causal=causal, scale=scale)
    B, Q, H, _ = q_BQHD.shape
    out_BQHD = torch.zeros_like(q_BQHD)
    lse_dtype = torch.float64 if q_BQHD.dtype == torch.float64 else torch.float32  # as the kernels give it
    lse_BHQ = torch.full((B, H, Q), -math.inf, dtype=lse_dtype, device=q_BQHD.device)
    seen: set[tuple[int, int]] = set()
    auxes = []
    for seg in _cut(q_docs_BQ, k_docs_BS, causal):
        b = slice(seg.b, seg.b + 1)
        res = kernel.forward(q_BQHD[b, seg.rows], k_BSKD[b, seg.cols], v_BSKD[b, seg.cols], causal=causal, scale=scale)
        auxes.append(res.aux)
        out, lse = res.out_BQHD, res.lse_BHQ
        if (seg.b, seg.rows.start) in seen:  # one document in several runs of the columns
            merged, lse = merge_partials(out_BQHD[b, seg.rows], lse_BHQ[b, :, seg.rows], out, lse)
            out = merged.to(out_BQHD.dtype)
        seen.add((seg.b, seg.rows.start))
        out_BQHD[b, seg.rows] = out
        lse_BHQ[b, :, seg.rows] = lse
    return BlockOutput(out_BQHD, lse_BHQ, auxes)


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
    q_docs_BQ: Optional[np.ndarray] = None,
    k_docs_BS: Optional[np.ndarray] = None,
) -> Grads:
    """The block's gradients for the merged ``out``/``lse`` of its rows; cut as the forward was."""
    if q_docs_BQ is None or k_docs_BS is None:
        return kernel.backward(dout_BQHD, q_BQHD, k_BSKD, v_BSKD, out_BQHD, lse_BHQ, aux, causal=causal, scale=scale)
    # fp32 (fp64 for fp64 inputs): a run of keys may serve several runs of rows.
    acc = torch.float64 if q_BQHD.dtype == torch.float64 else torch.float32
    dq_BQHD = torch.zeros(q_BQHD.shape, dtype=acc, device=q_BQHD.device)
    dk_BSKD = torch.zeros(k_BSKD.shape, dtype=acc, device=k_BSKD.device)
    dv_BSKD = torch.zeros(v_BSKD.shape, dtype=acc, device=v_BSKD.device)
    for seg, seg_aux in zip(_cut(q_docs_BQ, k_docs_BS, causal), aux):
        b = slice(seg.b, seg.b + 1)
        dq, dk, dv = kernel.backward(
            dout_BQHD[b, seg.rows],
            q_BQHD[b, seg.rows],
            k_BSKD[b, seg.cols],
            v_BSKD[b, seg.cols],
            out_BQHD[b, seg.rows],
            lse_BHQ[b, :, seg.rows],
            seg_aux,
            causal=causal,
            scale=scale,
        )
        dq_BQHD[b, seg.rows] += dq
        dk_BSKD[b, seg.cols] += dk
        dv_BSKD[b, seg.cols] += dv
    return dq_BQHD.to(q_BQHD.dtype), dk_BSKD.to(k_BSKD.dtype), dv_BSKD.to(v_BSKD.dtype)
