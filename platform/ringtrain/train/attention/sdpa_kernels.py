"""Block kernels over torch's own fused attention ops (``aten._scaled_dot_product_*``), which return an LSE.

The public ``scaled_dot_product_attention`` returns the output only; its backends' private ops
also return the log-sum-exp and have matching backward ops, which is what a context-parallel
block needs. Each kernel names the ops it calls with the signature its call is written for
(``ops``); one whose ops differ in this torch is not offered. All of them are head-major.

Shape legend: B batch, Q query length of the block, S key length of the block, H query heads,
K key/value heads (H unless the kernel takes GQA), D head dim (padded as the kernel says).
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from ringtrain.train.attention.block_kernel import (
    HALF,
    AttentionKernel,
    BackwardInputs,
    BlockCall,
    BlockMask,
    Grads,
    KernelSpec,
    SchemaLookup,
    additive_bias,
    allowed_mask,
    aten_schema,
    ops_fit,
)

Tensor = torch.Tensor
# The op namespace the kernels call through (one name, so a test can stand CPU fakes in for CUDA-only ops).
aten = torch.ops.aten


def sdpa_takes_gqa(schema_of: SchemaLookup = aten_schema) -> bool:
    """Whether this torch's fused CUDA attention ops take fewer K/V heads than query heads.

    From torch 2.5 ``scaled_dot_product_attention(..., enable_gqa=True)`` hands unequal head
    counts to the FlashAttention-2 op as they are (FA2's kernels read KV head h // G), and the
    cuDNN op takes them too (torch's shape rules for both backward ops give K/V gradients K
    heads); the efficient kernel requires equal counts (torch sends GQA to its math path
    instead). The flag in the public op's schema marks those releases.
    """
    schema = schema_of("scaled_dot_product_attention")
    return schema is not None and any(a.name == "enable_gqa" for a in schema.arguments)


def mask_as_bias(
    q_BHQD: Tensor, k_BKSD: Tensor, call: BlockCall, *, align: int = 1, expand_heads: bool = False
) -> tuple[Optional[Tensor], bool]:
    """The op's ``(attn_bias, is_causal)`` for a block: the causal flag alone when unmasked,
    else the causal and document masks folded into one additive bias of the query's dtype
    (``[B, 1, Q, S]``, or ``[B, H, Q, S]`` with a stride-0 head dim if ``expand_heads``), made
    once per mask (``BlockMask``), not per call."""
    mask = BlockMask.of(call.visible_BQS)
    if mask is None:
        return None, call.causal
    q_len, k_len, heads = q_BHQD.shape[2], k_BKSD.shape[2], q_BHQD.shape[1]

    def make() -> Tensor:
        allowed_BQS = allowed_mask(mask.visible_BQS, call.causal, q_len, k_len, device=q_BHQD.device)
        assert allowed_BQS is not None
        bias_B1QS = additive_bias(allowed_BQS, q_BHQD.dtype, align=align)
        return bias_B1QS.expand(-1, heads, -1, -1) if expand_heads else bias_B1QS

    key = ("bias", call.causal, q_BHQD.dtype, q_BHQD.device, align, expand_heads and heads, q_len, k_len)
    return mask.derived(key, make), False


class CpuFlashKernel(AttentionKernel):
    """torch's CPU flash-attention op (``_scaled_dot_product_flash_attention_for_cpu``)."""

    name = "cpu_flash"
    spec = KernelSpec(frozenset({"cpu"}), HALF | {torch.float32, torch.float64})
    supports_mask = True  # as an additive float mask
    head_major = True
    ops = {
        "_scaled_dot_product_flash_attention_for_cpu": (
            ("query", "key", "value", "dropout_p", "is_causal", "attn_mask", "scale"),
            2,
        ),
        "_scaled_dot_product_flash_attention_for_cpu_backward": (
            ("grad_out", "query", "key", "value", "out", "logsumexp", "dropout_p", "is_causal", "attn_mask", "scale"),
            3,
        ),
    }
    unavailable = (
        "this torch has no aten._scaled_dot_product_flash_attention_for_cpu with the signature this kernel calls"
    )

    @classmethod
    def runs_here(cls, device_type: str) -> bool:
        return device_type == "cpu" and ops_fit(cls.ops)

    def takes_gqa(self) -> bool:
        # The op broadcasts KV heads with repeat_interleave semantics and returns K-head grads.
        return True

    def _op_forward(self, q: Tensor, k: Tensor, v: Tensor, call: BlockCall) -> tuple[Tensor, Tensor, Any]:
        mask, is_causal = mask_as_bias(q, k, call)
        out_BHQD, lse_BHQ = aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, is_causal, attn_mask=mask, scale=call.scale
        )
        return out_BHQD, lse_BHQ, None

    def _op_backward(self, inputs: BackwardInputs, aux: Any, call: BlockCall) -> Grads:
        dout, q, k, v, out, lse = inputs
        mask, is_causal = mask_as_bias(q, k, call)
        dq, dk, dv = aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, is_causal, attn_mask=mask, scale=call.scale
        )
        return dq, dk, dv


def _cuda_here(device_type: str) -> bool:
    return device_type == "cuda" and torch.cuda.is_available()


def _ampere_or_newer() -> bool:
    return torch.cuda.get_device_capability() >= (8, 0)


class SdpaFlashKernel(AttentionKernel):
    """torch's bundled FlashAttention-2 on CUDA (``_scaled_dot_product_flash_attention``)."""

    name = "sdpa_flash"
    # FlashAttention-2: D <= 256 (torch's sdp_utils check_head_dim_size_flash).
    spec = KernelSpec(frozenset({"cuda"}), HALF, max_head_dim=256)
    pad_head_dim_to = 8  # FlashAttention-2 takes D % 8 == 0; torch's public SDPA pads too
    head_major = True
    ops = {
        "_scaled_dot_product_flash_attention": (
            ("query", "key", "value", "dropout_p", "is_causal", "return_debug_mask", "scale"),
            9,
        ),
        "_scaled_dot_product_flash_attention_backward": (
            ("grad_out", "query", "key", "value", "out", "logsumexp", "cum_seq_q", "cum_seq_k", "max_q", "max_k",
             "dropout_p", "is_causal", "philox_seed", "philox_offset", "scale"),
            3,
        ),
    }
    unavailable = (
        "this torch has no flash attention for this GPU (needs sm80 or newer), "
        "or its op's signature is not the one this kernel calls"
    )

    @classmethod
    def runs_here(cls, device_type: str) -> bool:
        return (
            _cuda_here(device_type)
            and _ampere_or_newer()
            and torch.backends.cuda.is_flash_attention_available()
            and ops_fit(cls.ops)
        )

    def takes_gqa(self) -> bool:
        return sdpa_takes_gqa()

    def _op_forward(self, q: Tensor, k: Tensor, v: Tensor, call: BlockCall) -> tuple[Tensor, Tensor, Any]:
        out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, call.causal, False, scale=call.scale
        )
        return out, lse, (cum_q, cum_k, max_q, max_k, seed, offset)

    def _op_backward(self, inputs: BackwardInputs, aux: Any, call: BlockCall) -> Grads:
        dout, q, k, v, out, lse = inputs
        cum_q, cum_k, max_q, max_k, seed, offset = aux
        dq, dk, dv = aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, 0.0, call.causal, seed, offset, scale=call.scale
        )
        return dq, dk, dv


class SdpaEfficientKernel(AttentionKernel):
    """torch's memory-efficient (xFormers/CUTLASS) kernel on CUDA, with ``compute_log_sumexp``.

    The one fused CUDA kernel here that takes an additive bias and still returns the LSE, so
    masked (packed-document) blocks run on it rather than on the full-matrix math kernel.
    """

    name = "sdpa_efficient"
    spec = KernelSpec(frozenset({"cuda"}), HALF | {torch.float32})
    supports_mask = True  # as an additive bias (``attn_bias``), forward and backward
    # The CUTLASS kernel wants D aligned to 16 bytes on sm80+ (8 half or 4 fp32 elements). It
    # takes equal head counts only (torch routes GQA around it), so K/V are repeated.
    pad_head_dim_to = 8
    head_major = True
    # The bias goes over as torch's own SDPA hands it to this op (preprocess_mask): every stride
    # but the last a multiple of 8 elements (16 in some builds; 16 serves both), heads expanded.
    bias_align = 16
    ops = {
        "_scaled_dot_product_efficient_attention": (
            ("query", "key", "value", "attn_bias", "compute_log_sumexp", "dropout_p", "is_causal", "scale"),
            4,
        ),
        "_scaled_dot_product_efficient_attention_backward": (
            ("grad_out_", "query", "key", "value", "attn_bias", "out", "logsumexp", "philox_seed", "philox_offset",
             "dropout_p", "grad_input_mask", "is_causal", "scale"),
            4,
        ),
    }
    unavailable = "no CUDA device, or this torch's op signature is not the one this kernel calls"

    @classmethod
    def runs_here(cls, device_type: str) -> bool:
        return _cuda_here(device_type) and ops_fit(cls.ops)

    def _op_forward(self, q: Tensor, k: Tensor, v: Tensor, call: BlockCall) -> tuple[Tensor, Tensor, Any]:
        bias, is_causal = mask_as_bias(q, k, call, align=self.bias_align, expand_heads=True)
        out, lse, seed, offset = aten._scaled_dot_product_efficient_attention(
            q, k, v, bias, True, 0.0, is_causal, scale=call.scale
        )
        # The kernel pads the LSE's query dim to a multiple of 32; keep the true rows and
        # remember the padded length for the backward.
        return out, lse[..., : q.shape[2]], (seed, offset, lse.shape[-1])

    def _op_backward(self, inputs: BackwardInputs, aux: Any, call: BlockCall) -> Grads:
        dout, q, k, v, out, lse = inputs
        seed, offset, padded_len = aux
        lse_padded = torch.nn.functional.pad(lse, (0, padded_len - lse.shape[-1]))
        bias, is_causal = mask_as_bias(q, k, call, align=self.bias_align, expand_heads=True)
        # The op takes q, k, v and dout's strides from the tensors but reads ``out`` as its
        # forward laid it out, [B, Q, H, D]-contiguous, whatever strides it is handed; an out
        # laid out otherwise (head-major contiguous, as padding its head dim leaves it) is read
        # out of bounds: NaN gradients, or an illegal memory access. A no-op in the usual case.
        out = out.transpose(1, 2).contiguous().transpose(1, 2)
        # grad_input_mask: q, k, v, and no gradient for the bias (a mask, not a parameter).
        dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
            dout, q, k, v, bias, out, lse_padded, seed, offset, 0.0, [True, True, True, False], is_causal,
            scale=call.scale,
        )
        return dq, dk, dv


class SdpaCudnnKernel(AttentionKernel):
    """cuDNN's fused attention on CUDA, with ``compute_log_sumexp``."""

    name = "sdpa_cudnn"
    # D <= 128 everywhere; 256 only on sm90/sm100 with recent cuDNN and frontend, and its
    # backward then only at 128, 192/128 or 256 (torch's check_cudnn_tensor_shapes and
    # check_cudnn_d256_bprop_head_dim), which a pure choice cannot see.
    spec = KernelSpec(frozenset({"cuda"}), HALF, max_head_dim=128)
    pad_head_dim_to = 8  # cuDNN takes D % 8 == 0
    head_major = True
    ops = {
        "_scaled_dot_product_cudnn_attention": (
            ("query", "key", "value", "attn_bias", "compute_log_sumexp", "dropout_p", "is_causal",
             "return_debug_mask", "scale"),
            9,
        ),
        "_scaled_dot_product_cudnn_attention_backward": (
            ("grad_out", "query", "key", "value", "out", "logsumexp", "philox_seed", "philox_offset", "attn_bias",
             "cum_seq_q", "cum_seq_k", "max_q", "max_k", "dropout_p", "is_causal", "scale"),
            3,
        ),
    }
    unavailable = "cuDNN attention needs cuDNN 9 or newer and torch 2.5 or newer (the op's signature differs before)"

    @classmethod
    def runs_here(cls, device_type: str) -> bool:
        cudnn_9 = torch.backends.cudnn.is_available() and (torch.backends.cudnn.version() or 0) >= 90000
        return _cuda_here(device_type) and cudnn_9 and ops_fit(cls.ops)

    def takes_gqa(self) -> bool:
        return sdpa_takes_gqa()

    def _op_forward(self, q: Tensor, k: Tensor, v: Tensor, call: BlockCall) -> tuple[Tensor, Tensor, Any]:
        out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = aten._scaled_dot_product_cudnn_attention(
            q, k, v, None, True, 0.0, call.causal, False, scale=call.scale
        )
        # cuDNN may return the LSE as [B, H, Q, 1]; the backward wants that shape back.
        lse_shape = tuple(lse.shape)
        return out, lse.reshape(lse_shape[:3]), (lse_shape, cum_q, cum_k, max_q, max_k, seed, offset)

    def _op_backward(self, inputs: BackwardInputs, aux: Any, call: BlockCall) -> Grads:
        dout, q, k, v, out, lse = inputs
        lse_shape, cum_q, cum_k, max_q, max_k, seed, offset = aux
        dq, dk, dv = aten._scaled_dot_product_cudnn_attention_backward(
            dout, q, k, v, out, lse.reshape(lse_shape), seed, offset, None, cum_q, cum_k, max_q, max_k, 0.0,
            call.causal, scale=call.scale,
        )
        return dq, dk, dv
