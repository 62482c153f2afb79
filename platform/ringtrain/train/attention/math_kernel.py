"""The math block kernel: explicit softmax attention in fp32 (fp64 for fp64 inputs), the reference.

It runs on any device and takes any mask, so it is also where a masked block goes when no
fused kernel here takes masks. It holds the whole ``[B, K, G, Q, S]`` score tensor: slow and
memory-hungry next to the fused kernels, exact next to all of them.

Shape legend: B batch, Q query length of the block, S key length of the block, H query heads,
K key/value heads, G = H // K query heads per KV head, D head dim.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch

from ringtrain.train.attention.block_kernel import (
    HALF,
    AttentionKernel,
    BackwardInputs,
    BlockCall,
    Grads,
    KernelSpec,
    accumulation_dtype,
    allowed_mask,
    visible_of,
)

Tensor = torch.Tensor


class MathKernel(AttentionKernel):
    """Explicit softmax in fp32 (fp64 for fp64 inputs): any mask, any device; the reference."""

    name = "math"
    spec = KernelSpec(None, HALF | {torch.float32, torch.float64})
    supports_mask = True

    @classmethod
    def runs_here(cls, device_type: str) -> bool:
        return True

    def takes_gqa(self) -> bool:
        return True

    @staticmethod
    def _compute_dtype(x: Tensor) -> torch.dtype:
        return accumulation_dtype(x.dtype)

    def _scores(self, q_BQHD: Tensor, k_BSKD: Tensor, call: BlockCall) -> Tensor:
        """``[B, K, G, Q, S]`` scaled scores with masked entries at -inf."""
        dtype = self._compute_dtype(q_BQHD)
        q_BQKGD = q_BQHD.to(dtype).unflatten(2, (k_BSKD.shape[2], -1))
        s_BKGQS = torch.einsum("bqkgd,bskd->bkgqs", q_BQKGD, k_BSKD.to(dtype)) * call.scale
        allowed = allowed_mask(
            visible_of(call), call.causal, q_BQHD.shape[1], k_BSKD.shape[1], device=s_BKGQS.device
        )
        if allowed is not None:
            hidden = (allowed[:, None, None] if allowed.dim() == 3 else allowed).logical_not()
            s_BKGQS = s_BKGQS.masked_fill(hidden, -math.inf)
        return s_BKGQS

    def _op_forward(
        self, q_BQHD: Tensor, k_BSKD: Tensor, v_BSKD: Tensor, call: BlockCall
    ) -> tuple[Tensor, Tensor, Optional[Any]]:
        s_BKGQS = self._scores(q_BQHD, k_BSKD, call)
        lse_BKGQ = torch.logsumexp(s_BKGQS, dim=-1)
        p_BKGQS = torch.exp(s_BKGQS - lse_BKGQ.masked_fill(lse_BKGQ == -math.inf, math.inf)[..., None])
        out_BQHD = torch.einsum("bkgqs,bskd->bqkgd", p_BKGQS, v_BSKD.to(s_BKGQS.dtype)).flatten(2, 3)
        return out_BQHD.to(q_BQHD.dtype), lse_BKGQ.flatten(1, 2), None

    def _op_backward(self, inputs: BackwardInputs, aux: Any, call: BlockCall) -> Grads:
        # Standard softmax backward (FlashAttention-2, Dao 2023, Alg. 2):
        # dV = P^T dO, dP = dO V^T, dS = P * (dP - rowsum(dO * O)), dQ = dS K, dK = dS^T Q.
        dout_BQHD, q_BQHD, k_BSKD, v_BSKD, out_BQHD, lse_BHQ = inputs
        kv_heads = k_BSKD.shape[2]
        s_BKGQS = self._scores(q_BQHD, k_BSKD, call)
        dtype = s_BKGQS.dtype
        p_BKGQS = torch.exp(s_BKGQS - lse_BHQ.to(dtype).unflatten(1, (kv_heads, -1))[..., None])
        dout_BQKGD = dout_BQHD.to(dtype).unflatten(2, (kv_heads, -1))
        out_BQKGD = out_BQHD.to(dtype).unflatten(2, (kv_heads, -1))
        dv_BSKD = torch.einsum("bkgqs,bqkgd->bskd", p_BKGQS, dout_BQKGD)
        dp_BKGQS = torch.einsum("bqkgd,bskd->bkgqs", dout_BQKGD, v_BSKD.to(dtype))
        delta_BKGQ = (dout_BQKGD * out_BQKGD).sum(dim=-1).permute(0, 2, 3, 1)
        ds_BKGQS = p_BKGQS * (dp_BKGQS - delta_BKGQ[..., None]) * call.scale
        dq_BQHD = torch.einsum("bkgqs,bskd->bqkgd", ds_BKGQS, k_BSKD.to(dtype)).flatten(2, 3)
        dk_BSKD = torch.einsum("bkgqs,bqkgd->bskd", ds_BKGQS, q_BQHD.to(dtype).unflatten(2, (kv_heads, -1)))
        return dq_BQHD, dk_BSKD, dv_BSKD
