"""Block attention kernels: one block of attention returning its output and its true fp32 log-sum-exp.

Context-parallel attention computes attention one block of keys at a time and merges the
partial results, which needs each block's log-sum-exp (LSE) as well as its output; each
block's backward then runs against the *merged* output and LSE. So a kernel here is a forward
that returns ``(out, lse)`` and a backward that takes them back, not a plain attention call,
and a kernel that cannot return a real LSE is refused by name.

Shape legend: B batch, Q query length of the block, S key length of the block, H query heads,
K key/value heads (H % K == 0; query head h reads KV head h // (H // K)), G = H // K, D head
dim. Tensors are ``[B, Q, H, D]`` and ``[B, S, K, D]``; LSEs are ``[B, H, Q]`` fp32.

Conventions every kernel keeps:

- ``causal`` only on square blocks (Q == S, refused otherwise): there query i sees keys 0..i
  under top-left and bottom-right (flash-attn's) alignment alike, and no row is left empty.
  On a non-square block the two alignments disagree, and flash-attn gives a row that sees no
  key an LSE of +inf, which the merge would weigh as everything instead of nothing.
- ``visible_BQS`` (boolean, True = may attend) restricts attention further; only kernels with
  ``supports_mask`` accept it.
- A query row with no visible key has output 0 and LSE -inf, and receives zero gradient.
- Head dims: a kernel whose op needs D to be a multiple of ``pad_head_dim_to`` gets q, k, v
  zero-padded up to one and its results sliced back (as flash-attn's ``FlashAttnFunc`` does);
  one with a largest D (``KernelSpec.max_head_dim``) is never chosen for a larger one.
- GQA: a kernel whose op takes fewer K/V heads than query heads (``native_gqa``) gets K/V as
  they are; any other gets them repeated per query head, and its K/V gradients summed back.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import math
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple, Optional, Union

import torch

from ringtrain.errors import RingtrainError

Tensor = torch.Tensor
Grads = tuple[Tensor, Tensor, Tensor]


class KernelUnavailableError(RingtrainError, ValueError):
    """An attention kernel was named that cannot run here, or cannot return a log-sum-exp."""

    def __init__(self, kernel: str, reason: str) -> None:
        super().__init__(f"attention kernel {kernel!r}: {reason}")
        self.kernel = kernel
        self.reason = reason

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.kernel, self.reason))


class BlockOutput(NamedTuple):
    out_BQHD: Tensor  # in the query's dtype
    lse_BHQ: Tensor  # fp32 (fp64 for fp64 inputs); -inf where a row sees no key
    aux: Any  # kernel-private state its backward needs (RNG state, varlen metadata)


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)


def _pad_head_dim(x: Tensor, multiple: int) -> Tensor:
    # Zero columns add nothing to q.k, and zero value columns only add output columns that are
    # sliced off; the scale is passed explicitly, so it stays that of the true head dim.
    extra = -x.shape[-1] % multiple
    return torch.nn.functional.pad(x, (0, extra)) if extra else x


def _check_square_if_causal(causal: bool, q_len: int, k_len: int) -> None:
    if causal and q_len != k_len:
        raise ValueError(
            f"causal attention needs a square block, got {q_len} queries and {k_len} keys: kernels "
            "align a non-square causal mask differently (flash-attn bottom-right, with LSE +inf for "
            "rows that see no key), so split the block or pass an explicit mask"
        )


def _allowed_mask(visible_BQS: Optional[Tensor], causal: bool, q_len: int, k_len: int) -> Optional[Tensor]:
    """The full boolean mask (``[Q, S]`` or ``[B, Q, S]``) or None when nothing is masked."""
    if not causal:
        return visible_BQS
    device = visible_BQS.device if visible_BQS is not None else None
    tril_QS = torch.ones(q_len, k_len, dtype=torch.bool, device=device).tril()
    return tril_QS if visible_BQS is None else visible_BQS & tril_QS


class AttentionKernel:
    """Forward and backward of one attention block; subclasses implement ``_forward``/``_backward``.

    This base class owns what must hold for every kernel: square causal blocks, head-dim
    padding, GQA expansion for kernels that lack it, the LSE of rows that see no key, and fp32
    LSEs. ``_forward``/``_backward`` take the layouts of ``forward``/``backward``, with the head
    dim padded to a multiple of ``pad_head_dim_to`` and KV heads already expanded to H unless
    ``native_gqa``.
    """

    name: ClassVar[str]
    supports_mask: ClassVar[bool] = False
    pad_head_dim_to: ClassVar[int] = 1

    def __init__(self, *, native_gqa: Optional[bool] = None) -> None:
        """``native_gqa`` overrides what ``takes_gqa`` says (tests compare both paths)."""
        self.native_gqa = self.takes_gqa() if native_gqa is None else native_gqa

    def takes_gqa(self) -> bool:
        """Whether this kernel's op takes fewer K/V heads than query heads as they are."""
        return False

    def forward(
        self,
        q_BQHD: Tensor,
        k_BSKD: Tensor,
        v_BSKD: Tensor,
        *,
        causal: bool,
        scale: float,
        visible_BQS: Optional[Tensor] = None,
    ) -> BlockOutput:
        self._check_mask(visible_BQS)
        _check_square_if_causal(causal, q_BQHD.shape[1], k_BSKD.shape[1])
        head_dim = q_BQHD.shape[-1]
        q_BQHD, k_BSKD, v_BSKD = (_pad_head_dim(t, self.pad_head_dim_to) for t in (q_BQHD, k_BSKD, v_BSKD))
        groups = q_BQHD.shape[2] // k_BSKD.shape[2]
        if groups > 1 and not self.native_gqa:
            k_BSKD, v_BSKD = k_BSKD.repeat_interleave(groups, dim=2), v_BSKD.repeat_interleave(groups, dim=2)
        out_BQHD, lse_BHQ, aux = self._forward(
            q_BQHD, k_BSKD, v_BSKD, causal=causal, scale=scale, visible_BQS=visible_BQS
        )
        out_BQHD = out_BQHD[..., :head_dim]
        if lse_BHQ.dtype != torch.float64:
            lse_BHQ = lse_BHQ.float()
        if visible_BQS is not None:
            # A fused kernel may report LSE 0 rather than -inf for a row whose keys are all
            # masked (torch's CPU flash kernel does); the merge needs the truth, or that row's
            # zero output would get real weight.
            seen_BQ = visible_BQS.any(dim=-1)
            lse_BHQ = lse_BHQ.masked_fill(~seen_BQ[:, None, :], -math.inf)
            out_BQHD = out_BQHD.masked_fill(~seen_BQ[:, :, None, None], 0.0)
        return BlockOutput(out_BQHD, lse_BHQ, aux)

    def backward(
        self,
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
        visible_BQS: Optional[Tensor] = None,
    ) -> Grads:
        """Gradients of this block for the merged ``out``/``lse`` of its query rows."""
        self._check_mask(visible_BQS)
        _check_square_if_causal(causal, q_BQHD.shape[1], k_BSKD.shape[1])
        # Every kernel recomputes P = exp(s - lse). For a row that saw no key that is
        # exp(-inf + inf) = NaN; with +inf instead of -inf it is exp(-inf) = 0, so the row
        # gets zero gradient through fused and explicit kernels alike.
        lse_BHQ = lse_BHQ.masked_fill(lse_BHQ == -math.inf, math.inf).contiguous()
        head_dim = q_BQHD.shape[-1]
        dout_BQHD, q_BQHD, k_BSKD, v_BSKD, out_BQHD = (
            _pad_head_dim(t, self.pad_head_dim_to) for t in (dout_BQHD, q_BQHD, k_BSKD, v_BSKD, out_BQHD)
        )
        kv_heads = k_BSKD.shape[2]
        groups = q_BQHD.shape[2] // kv_heads
        if groups > 1 and not self.native_gqa:
            k_BSKD, v_BSKD = k_BSKD.repeat_interleave(groups, dim=2), v_BSKD.repeat_interleave(groups, dim=2)
        dq, dk, dv = self._backward(
            dout_BQHD, q_BQHD, k_BSKD, v_BSKD, out_BQHD, lse_BHQ, aux,
            causal=causal, scale=scale, visible_BQS=visible_BQS,
        )
        if dk.shape[2] != kv_heads:
            # Each KV head fed ``groups`` query heads; its gradient is the sum over them. Also
            # taken when a native-GQA op hands back per-query-head gradients.
            dk = dk.unflatten(2, (kv_heads, groups)).sum(dim=3)
            dv = dv.unflatten(2, (kv_heads, groups)).sum(dim=3)
        return dq[..., :head_dim], dk[..., :head_dim], dv[..., :head_dim]

    def _check_mask(self, visible_BQS: Optional[Tensor]) -> None:
        if visible_BQS is not None and not self.supports_mask:
            raise ValueError(f"attention kernel {self.name!r} takes no mask; use a mask-capable kernel")

    def _forward(
        self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool, scale: float, visible_BQS: Optional[Tensor]
    ) -> tuple[Tensor, Tensor, Any]:
        raise NotImplementedError

    def _backward(
        self,
        dout: Tensor,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        out: Tensor,
        lse: Tensor,
        aux: Any,
        *,
        causal: bool,
        scale: float,
        visible_BQS: Optional[Tensor],
    ) -> Grads:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}(native_gqa={self.native_gqa})"


class MathKernel(AttentionKernel):
    """Explicit softmax in fp32 (fp64 for fp64 inputs): any mask, any device; the reference."""

    name = "math"
    supports_mask = True

    def takes_gqa(self) -> bool:
        return True

    @staticmethod
    def _compute_dtype(x: Tensor) -> torch.dtype:
        return torch.float64 if x.dtype == torch.float64 else torch.float32

    def _scores(self, q: Tensor, k: Tensor, *, causal: bool, scale: float, visible_BQS: Optional[Tensor]) -> Tensor:
        """``[B, K, G, Q, S]`` scaled scores with masked entries at -inf."""
        dtype = self._compute_dtype(q)
        q_BQKGD = q.to(dtype).unflatten(2, (k.shape[2], -1))
        s = torch.einsum("bqkgd,bskd->bkgqs", q_BQKGD, k.to(dtype)) * scale
        allowed = _allowed_mask(visible_BQS, causal, q.shape[1], k.shape[1])
        if allowed is not None:
            s = s.masked_fill(~(allowed[:, None, None] if allowed.dim() == 3 else allowed), -math.inf)
        return s

    def _forward(
        self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool, scale: float, visible_BQS: Optional[Tensor]
    ) -> tuple[Tensor, Tensor, Any]:
        s = self._scores(q, k, causal=causal, scale=scale, visible_BQS=visible_BQS)
        lse_BKGQ = torch.logsumexp(s, dim=-1)
        p = torch.exp(s - lse_BKGQ.masked_fill(lse_BKGQ == -math.inf, math.inf)[..., None])
        out = torch.einsum("bkgqs,bskd->bqkgd", p, v.to(s.dtype)).flatten(2, 3)
        return out.to(q.dtype), lse_BKGQ.flatten(1, 2), None

    def _backward(
        self,
        dout: Tensor,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        out: Tensor,
        lse: Tensor,
        aux: Any,
        *,
        causal: bool,
        scale: float,
        visible_BQS: Optional[Tensor],
    ) -> Grads:
        # Standard softmax backward (FlashAttention-2, Dao 2023, Alg. 2):
        # dV = P^T dO, dP = dO V^T, dS = P * (dP - rowsum(dO * O)), dQ = dS K, dK = dS^T Q.
        kv_heads = k.shape[2]
        s = self._scores(q, k, causal=causal, scale=scale, visible_BQS=visible_BQS)
        dtype = s.dtype
        p = torch.exp(s - lse.to(dtype).unflatten(1, (kv_heads, -1))[..., None])
        dout_BQKGD = dout.to(dtype).unflatten(2, (kv_heads, -1))
        out_BQKGD = out.to(dtype).unflatten(2, (kv_heads, -1))
        dv = torch.einsum("bkgqs,bqkgd->bskd", p, dout_BQKGD)
        dp = torch.einsum("bqkgd,bskd->bkgqs", dout_BQKGD, v.to(dtype))
        delta_BKGQ = (dout_BQKGD * out_BQKGD).sum(dim=-1).permute(0, 2, 3, 1)
        ds = p * (dp - delta_BKGQ[..., None]) * scale
        dq = torch.einsum("bkgqs,bskd->bqkgd", ds, k.to(dtype)).flatten(2, 3)
        dk = torch.einsum("bkgqs,bqkgd->bskd", ds, q.to(dtype).unflatten(2, (kv_heads, -1)))
        return dq, dk, dv


class CpuFlashKernel(AttentionKernel):
    """torch's CPU flash-attention op (``_scaled_dot_product_flash_attention_for_cpu``)."""

    name = "cpu_flash"
    supports_mask = True  # as an additive float mask

    def takes_gqa(self) -> bool:
        # The op broadcasts KV heads with repeat_interleave semantics and returns K-head grads.
        return True

    @staticmethod
    def _mask(q: Tensor, k: Tensor, causal: bool, visible_BQS: Optional[Tensor]) -> tuple[Optional[Tensor], bool]:
        if visible_BQS is None:
            return None, causal
        allowed = _allowed_mask(visible_BQS, causal, q.shape[1], k.shape[1])
        assert allowed is not None
        # The op takes a float mask of the query's dtype, added to the scores.
        bias = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device).masked_fill_(~allowed, -math.inf)
        return bias[:, None], False

    def _forward(
        self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool, scale: float, visible_BQS: Optional[Tensor]
    ) -> tuple[Tensor, Tensor, Any]:
        mask, is_causal = self._mask(q, k, causal, visible_BQS)
        out_BHQD, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0.0, is_causal, attn_mask=mask, scale=scale
        )
        return out_BHQD.transpose(1, 2), lse, None

    def _backward(
        self,
        dout: Tensor,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        out: Tensor,
        lse: Tensor,
        aux: Any,
        *,
        causal: bool,
        scale: float,
        visible_BQS: Optional[Tensor],
    ) -> Grads:
        mask, is_causal = self._mask(q, k, causal, visible_BQS)
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout.transpose(1, 2),
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            out.transpose(1, 2),
            lse,
            0.0,
            is_causal,
            attn_mask=mask,
            scale=scale,
        )
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


class SdpaFlashKernel(AttentionKernel):
    """torch's bundled FlashAttention-2 on CUDA (``_scaled_dot_product_flash_attention``)."""

    name = "sdpa_flash"
    pad_head_dim_to = 8  # FlashAttention-2 takes D % 8 == 0; torch's public SDPA pads too

    def takes_gqa(self) -> bool:
        return sdpa_takes_gqa()

    def _forward(
        self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool, scale: float, visible_BQS: Optional[Tensor]
    ) -> tuple[Tensor, Tensor, Any]:
        out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = torch.ops.aten._scaled_dot_product_flash_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0.0, causal, False, scale=scale
        )
        return out.transpose(1, 2), lse, (cum_q, cum_k, max_q, max_k, seed, offset)

    def _backward(
        self,
        dout: Tensor,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        out: Tensor,
        lse: Tensor,
        aux: Any,
        *,
        causal: bool,
        scale: float,
        visible_BQS: Optional[Tensor],
    ) -> Grads:
        cum_q, cum_k, max_q, max_k, seed, offset = aux
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dout.transpose(1, 2),
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            out.transpose(1, 2),
            lse,
            cum_q,
            cum_k,
            max_q,
            max_k,
            0.0,
            causal,
            seed,
            offset,
            scale=scale,
        )
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


class SdpaEfficientKernel(AttentionKernel):
    """torch's memory-efficient (xFormers/CUTLASS) kernel on CUDA, with ``compute_log_sumexp``."""

    name = "sdpa_efficient"
    # The CUTLASS kernel wants D aligned to 16 bytes on sm80+ (8 half or 4 fp32 elements). It
    # takes equal head counts only (torch routes GQA around it), so K/V are repeated.
    pad_head_dim_to = 8

    def _forward(
        self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool, scale: float, visible_BQS: Optional[Tensor]
    ) -> tuple[Tensor, Tensor, Any]:
        out, lse, seed, offset = torch.ops.aten._scaled_dot_product_efficient_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None, True, 0.0, causal, scale=scale
        )
        # The kernel pads the LSE's query dim to a multiple of 32; keep the true rows and
        # remember the padded length for the backward.
        return out.transpose(1, 2), lse[..., : q.shape[1]], (seed, offset, lse.shape[-1])

    def _backward(
        self,
        dout: Tensor,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        out: Tensor,
        lse: Tensor,
        aux: Any,
        *,
        causal: bool,
        scale: float,
        visible_BQS: Optional[Tensor],
    ) -> Grads:
        seed, offset, padded_len = aux
        lse_padded = torch.nn.functional.pad(lse, (0, padded_len - lse.shape[-1]))
        dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            dout.transpose(1, 2),
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            None,
            out.transpose(1, 2),
            lse_padded,
            seed,
            offset,
            0.0,
            [True, True, True, False],
            causal,
            scale=scale,
        )
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


class SdpaCudnnKernel(AttentionKernel):
    """cuDNN's fused attention on CUDA, with ``compute_log_sumexp``."""

    name = "sdpa_cudnn"
    pad_head_dim_to = 8  # cuDNN takes D % 8 == 0

    def takes_gqa(self) -> bool:
        return sdpa_takes_gqa()

    def _forward(
        self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool, scale: float, visible_BQS: Optional[Tensor]
    ) -> tuple[Tensor, Tensor, Any]:
        out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = torch.ops.aten._scaled_dot_product_cudnn_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None, True, 0.0, causal, False, scale=scale
        )
        # cuDNN may return the LSE as [B, H, Q, 1]; the backward wants that shape back.
        lse_shape = tuple(lse.shape)
        return out.transpose(1, 2), lse.reshape(lse_shape[:3]), (lse_shape, cum_q, cum_k, max_q, max_k, seed, offset)

    def _backward(
        self,
        dout: Tensor,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        out: Tensor,
        lse: Tensor,
        aux: Any,
        *,
        causal: bool,
        scale: float,
        visible_BQS: Optional[Tensor],
    ) -> Grads:
        lse_shape, cum_q, cum_k, max_q, max_k, seed, offset = aux
        dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            dout.transpose(1, 2),
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            out.transpose(1, 2),
            lse.reshape(lse_shape),
            seed,
            offset,
            None,
            cum_q,
            cum_k,
            max_q,
            max_k,
            0.0,
            causal,
            scale=scale,
        )
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


def _flash_attn_call_kwargs(fn: Callable[..., Any], **given: Any) -> dict[str, Any]:
    """Keyword arguments for a flash-attn internal whose signature moves between releases.

    The values we set, "no sliding window / softcap / ALiBi" under whichever names this release
    uses, and the function's own defaults for the rest.
    """
    params = inspect.signature(getattr(fn, "_init_fn", fn)).parameters
    kwargs = {n: p.default for n, p in params.items() if p.default is not inspect.Parameter.empty}
    neutral = {
        "window_size": (-1, -1),
        "window_size_left": -1,
        "window_size_right": -1,
        "softcap": 0.0,
        "alibi_slopes": None,
    }
    kwargs.update({n: value for n, value in neutral.items() if n in params})
    kwargs.update({n: value for n, value in given.items() if n in params})
    missing = [n for n in params if n not in kwargs]
    if missing:
        raise KernelUnavailableError(
            "flash_attn", f"unsupported flash-attn release: {fn.__name__} also needs {missing}"
        )
    return kwargs


class FlashAttnKernel(AttentionKernel):
    """The ``flash_attn`` package (FlashAttention-2): BSHD layout and GQA natively."""

    name = "flash_attn"
    # ``_flash_attn_forward``/``_backward`` take D % 8 == 0 and leave the padding to
    # ``FlashAttnFunc``, which this kernel bypasses to get the LSE.
    pad_head_dim_to = 8

    def takes_gqa(self) -> bool:
        return True

    def _forward(
        self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool, scale: float, visible_BQS: Optional[Tensor]
    ) -> tuple[Tensor, Tensor, Any]:
        fa = importlib.import_module("flash_attn.flash_attn_interface")
        kwargs = _flash_attn_call_kwargs(
            fa._flash_attn_forward,
            q=q,
            k=k,
            v=v,
            dropout_p=0.0,
            softmax_scale=scale,
            causal=causal,
            return_softmax=False,
        )
        result = fa._flash_attn_forward(**kwargs)
        # >= 2.6: (out, lse, S_dmask, rng_state); before: (out, q, k, v, out_padded, lse, S_dmask, rng_state)
        if len(result) == 4:
            return result[0], result[1], result[3]
        return result[0], result[5], result[7]

    def _backward(
        self,
        dout: Tensor,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        out: Tensor,
        lse: Tensor,
        aux: Any,
        *,
        causal: bool,
        scale: float,
        visible_BQS: Optional[Tensor],
    ) -> Grads:
        fa = importlib.import_module("flash_attn.flash_attn_interface")
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        kwargs = _flash_attn_call_kwargs(
            fa._flash_attn_backward,
            dout=dout,
            q=q,
            k=k,
            v=v,
            out=out,
            softmax_lse=lse,
            dq=dq,
            dk=dk,
            dv=dv,
            dropout_p=0.0,
            softmax_scale=scale,
            causal=causal,
            deterministic=False,
            rng_state=aux,
        )
        fa._flash_attn_backward(**kwargs)
        return dq, dk, dv


_KERNEL_CLASSES: Mapping[str, type[AttentionKernel]] = {
    cls.name: cls
    for cls in (FlashAttnKernel, SdpaFlashKernel, SdpaCudnnKernel, SdpaEfficientKernel, CpuFlashKernel, MathKernel)
}

_HALF = frozenset({torch.float16, torch.bfloat16})


@dataclass(frozen=True)
class KernelSpec:
    devices: Optional[frozenset[str]]  # None: any device
    dtypes: frozenset[torch.dtype]
    max_head_dim: Optional[int] = None  # None: any; forward and backward alike


KERNEL_SPECS: Mapping[str, KernelSpec] = {
    # FlashAttention-2 (the package and torch's copy): D <= 256 (flash-attn's mha_fwd/mha_bwd,
    # torch's sdp_utils check_head_dim_size_flash).
    "flash_attn": KernelSpec(frozenset({"cuda"}), _HALF, max_head_dim=256),
    "sdpa_flash": KernelSpec(frozenset({"cuda"}), _HALF, max_head_dim=256),
    # cuDNN: D <= 128 everywhere; 256 only on sm90/sm100 with recent cuDNN and frontend, and its
    # backward then only at 128, 192/128 or 256 (torch's check_cudnn_tensor_shapes and
    # check_cudnn_d256_bprop_head_dim), which a pure choice cannot see.
    "sdpa_cudnn": KernelSpec(frozenset({"cuda"}), _HALF, max_head_dim=128),
    "sdpa_efficient": KernelSpec(frozenset({"cuda"}), _HALF | {torch.float32}),
    "cpu_flash": KernelSpec(frozenset({"cpu"}), _HALF | {torch.float32, torch.float64}),
    "math": KernelSpec(None, _HALF | {torch.float32, torch.float64}),
}
KERNEL_NAMES: tuple[str, ...] = ("auto", *KERNEL_SPECS)

# Fastest first. Unlisted devices get "math".
AUTO_ORDER: Mapping[str, tuple[str, ...]] = {
    "cuda": ("flash_attn", "sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "math"),
    "cpu": ("cpu_flash", "math"),
}

# Names someone might reasonably try that cannot serve context parallelism.
NO_LSE: Mapping[str, str] = {
    "sdpa": "torch.nn.functional.scaled_dot_product_attention returns the output only, no log-sum-exp, "
    "so context-parallel blocks cannot be merged; use 'auto' or one of the sdpa_* kernels",
    "sdpa_math": "the SDPA math backend returns no log-sum-exp; use 'math', which does",
}

UNAVAILABLE: Mapping[str, str] = {
    "flash_attn": "the flash_attn package is not importable here, or the GPU is older than sm80",
    "sdpa_flash": "this torch has no flash attention for this GPU (needs sm80 or newer), "
    "or its op's signature is not the one this kernel calls",
    "sdpa_cudnn": "cuDNN attention needs cuDNN 9 or newer and torch 2.5 or newer (the op's signature differs before)",
    "sdpa_efficient": "no CUDA device, or this torch's op signature is not the one this kernel calls",
    "cpu_flash": "this torch has no aten._scaled_dot_product_flash_attention_for_cpu with the signature "
    "this kernel calls",
    "math": "",
}


def check_kernel_name(name: str) -> None:
    """Refuse a name that is unknown or cannot return a log-sum-exp."""
    if name in NO_LSE:
        raise KernelUnavailableError(name, NO_LSE[name])
    if name not in KERNEL_NAMES:
        raise KernelUnavailableError(name, f"unknown; choose one of {', '.join(KERNEL_NAMES)}")


def _takes_head_dim(spec: KernelSpec, head_dim: Optional[int]) -> bool:
    return head_dim is None or spec.max_head_dim is None or head_dim <= spec.max_head_dim


def select_kernel(
    name: str,
    *,
    device_type: str,
    dtype: torch.dtype,
    available: Collection[str],
    head_dim: Optional[int] = None,
) -> str:
    """The kernel to run for ``name`` on ``device_type`` with ``dtype`` inputs; pure.

    ``available`` is what the runtime offers (``available_kernels``). ``auto`` takes the first
    fit in ``AUTO_ORDER``; an explicit name that does not fit raises naming why. ``head_dim``
    (None: not known) rules out kernels whose op cannot take it.
    """
    check_kernel_name(name)

    def fits(candidate: str) -> bool:
        spec = KERNEL_SPECS[candidate]
        on_device = spec.devices is None or device_type in spec.devices
        return on_device and dtype in spec.dtypes and _takes_head_dim(spec, head_dim) and candidate in available

    if name == "auto":
        for candidate in AUTO_ORDER.get(device_type, ("math",)):
            if fits(candidate):
                return candidate
        shape = "" if head_dim is None else f" with head dim {head_dim}"
        raise KernelUnavailableError(name, f"no kernel here runs {dtype}{shape} on {device_type}")
    spec = KERNEL_SPECS[name]
    if spec.devices is not None and device_type not in spec.devices:
        raise KernelUnavailableError(name, f"runs on {'/'.join(sorted(spec.devices))}, not {device_type}")
    if dtype not in spec.dtypes:
        supported = ", ".join(sorted(str(d).removeprefix("torch.") for d in spec.dtypes))
        raise KernelUnavailableError(name, f"does not take {str(dtype).removeprefix('torch.')} inputs ({supported})")
    if not _takes_head_dim(spec, head_dim):
        raise KernelUnavailableError(name, f"takes head dims up to {spec.max_head_dim}, not {head_dim}")
    if name not in available:
        raise KernelUnavailableError(name, UNAVAILABLE[name])
    return name


def _flash_attn_importable() -> bool:
    try:
        importlib.import_module("flash_attn.flash_attn_interface")
    except Exception:  # an ImportError, or a CUDA/ABI mismatch raised while loading its extension
        return False
    return True


# The aten ops each torch kernel calls, with the argument names (in order) and the number of
# results its call is written for. The private ops change between releases (cuDNN's gained
# ``attn_bias`` and ``compute_log_sumexp`` in torch 2.5); a call written for another signature
# would put its values in the wrong places, so a kernel whose ops differ is not offered.
KERNEL_OPS: Mapping[str, Mapping[str, tuple[tuple[str, ...], int]]] = {
    "sdpa_flash": {
        "_scaled_dot_product_flash_attention": (
            ("query", "key", "value", "dropout_p", "is_causal", "return_debug_mask", "scale"),
            9,
        ),
        "_scaled_dot_product_flash_attention_backward": (
            ("grad_out", "query", "key", "value", "out", "logsumexp", "cum_seq_q", "cum_seq_k", "max_q", "max_k",
             "dropout_p", "is_causal", "philox_seed", "philox_offset", "scale"),
            3,
        ),
    },
    "sdpa_efficient": {
        "_scaled_dot_product_efficient_attention": (
            ("query", "key", "value", "attn_bias", "compute_log_sumexp", "dropout_p", "is_causal", "scale"),
            4,
        ),
        "_scaled_dot_product_efficient_attention_backward": (
            ("grad_out_", "query", "key", "value", "attn_bias", "out", "logsumexp", "philox_seed", "philox_offset",
             "dropout_p", "grad_input_mask", "is_causal", "scale"),
            4,
        ),
    },
    "sdpa_cudnn": {
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
    },
    "cpu_flash": {
        "_scaled_dot_product_flash_attention_for_cpu": (
            ("query", "key", "value", "dropout_p", "is_causal", "attn_mask", "scale"),
            2,
        ),
        "_scaled_dot_product_flash_attention_for_cpu_backward": (
            ("grad_out", "query", "key", "value", "out", "logsumexp", "dropout_p", "is_causal", "attn_mask", "scale"),
            3,
        ),
    },
}

SchemaLookup = Callable[[str], Optional[Any]]


def aten_schema(op: str) -> Optional[Any]:
    """The installed torch's schema (``torch.FunctionSchema``) of ``aten::op``, None if absent."""
    packet = getattr(torch.ops.aten, op, None)
    return None if packet is None else packet.default._schema


def kernel_ops_fit(name: str, schema_of: SchemaLookup = aten_schema) -> bool:
    """Whether every op kernel ``name`` calls exists with the signature its call is written for."""
    for op, (arguments, num_returns) in KERNEL_OPS.get(name, {}).items():
        schema = schema_of(op)
        if schema is None:
            return False
        if tuple(a.name for a in schema.arguments) != arguments or len(schema.returns) != num_returns:
            return False
    return True


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


@functools.lru_cache(maxsize=None)
def available_kernels(device_type: str) -> frozenset[str]:
    """Kernels this process can run on ``device_type`` (probed once)."""
    names = {"math"}
    if device_type == "cpu" and kernel_ops_fit("cpu_flash"):
        names.add("cpu_flash")
    if device_type == "cuda" and torch.cuda.is_available():
        if kernel_ops_fit("sdpa_efficient"):
            names.add("sdpa_efficient")
        ampere_or_newer = torch.cuda.get_device_capability() >= (8, 0)
        if ampere_or_newer and torch.backends.cuda.is_flash_attention_available() and kernel_ops_fit("sdpa_flash"):
            names.add("sdpa_flash")
        cudnn_9 = torch.backends.cudnn.is_available() and (torch.backends.cudnn.version() or 0) >= 90000
        if cudnn_9 and kernel_ops_fit("sdpa_cudnn"):
            names.add("sdpa_cudnn")
        if ampere_or_newer and _flash_attn_importable():
            names.add("flash_attn")
    return frozenset(names)


@functools.lru_cache(maxsize=None)
def _instance(name: str) -> AttentionKernel:
    return _KERNEL_CLASSES[name]()


def get_kernel(
    name: str, *, device_type: str, dtype: torch.dtype, head_dim: Optional[int] = None
) -> AttentionKernel:
    """The kernel ``name`` resolves to for these inputs, or a ``KernelUnavailableError``."""
    chosen = select_kernel(
        name, device_type=device_type, dtype=dtype, available=available_kernels(device_type), head_dim=head_dim
    )
    return _instance(chosen)


KernelArg = Union[str, AttentionKernel]


def resolve_kernel(kernel: KernelArg, like: Tensor) -> AttentionKernel:
    """A kernel object for inputs like ``like`` [..., D]; a name is resolved for its device,
    dtype and head dim."""
    if isinstance(kernel, AttentionKernel):
        return kernel
    return get_kernel(kernel, device_type=like.device.type, dtype=like.dtype, head_dim=like.shape[-1])


MATH = _instance("math")
