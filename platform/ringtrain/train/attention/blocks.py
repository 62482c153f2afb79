"""One attention block under the causal and packed-document masks, through a block kernel.

Packed documents share one sequence; ``doc_ids`` gives each token's document, and a query sees
only keys of its own document. That is a per-sample boolean mask, so a masked block goes to a
mask-capable kernel: the given one if it takes masks, else the best one that fits the inputs
(``kernels.select_block_kernel``: the efficient kernel on CUDA, ``math`` otherwise). A negative
doc id marks padding: such a token sees no key and no query sees it, so its output and
gradients are zero.

The mask is rebuilt in the backward rather than saved: it is cheap to recompute and costs
Q x S booleans per block to keep.

Shape legend: B batch, Q query length of the block, S key length of the block, H query heads,
K key/value heads, D head dim.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from ringtrain.train.attention.block_kernel import AttentionKernel, BlockOutput, Grads
from ringtrain.train.attention.kernels import kernel_for_block

Tensor = torch.Tensor


def doc_visibility(q_doc_BQ: Tensor, k_doc_BS: Tensor) -> Tensor:
    """``[B, Q, S]``: True where query and key belong to the same (non-padding) document."""
    same_BQS = q_doc_BQ[:, :, None] == k_doc_BS[:, None, :]
    return same_BQS & (q_doc_BQ >= 0)[:, :, None]


def _kernel_and_mask(
    kernel: AttentionKernel, q_BQHD: Tensor, q_doc_BQ: Optional[Tensor], k_doc_BS: Optional[Tensor]
) -> tuple[AttentionKernel, Optional[Tensor]]:
    if q_doc_BQ is None or k_doc_BS is None:
        return kernel, None
    return kernel_for_block(kernel, masked=True, like=q_BQHD), doc_visibility(q_doc_BQ, k_doc_BS)


def block_forward(
    kernel: AttentionKernel,
    q_BQHD: Tensor,
    k_BSKD: Tensor,
    v_BSKD: Tensor,
    *,
    causal: bool,
    scale: float,
    q_doc_BQ: Optional[Tensor] = None,
    k_doc_BS: Optional[Tensor] = None,
) -> BlockOutput:
    kernel, visible_BQS = _kernel_and_mask(kernel, q_BQHD, q_doc_BQ, k_doc_BS)
    return kernel.forward(q_BQHD, k_BSKD, v_BSKD, causal=causal, scale=scale, visible_BQS=visible_BQS)


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
    q_doc_BQ: Optional[Tensor] = None,
    k_doc_BS: Optional[Tensor] = None,
) -> Grads:
    kernel, visible_BQS = _kernel_and_mask(kernel, q_BQHD, q_doc_BQ, k_doc_BS)
    return kernel.backward(
        dout_BQHD, q_BQHD, k_BSKD, v_BSKD, out_BQHD, lse_BHQ, aux, causal=causal, scale=scale, visible_BQS=visible_BQS
    )
