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

- ``causal`` is top-left aligned (query i sees keys 0..i). Callers only use it on square
  blocks, where top-left and bottom-right (flash-attn's) alignment agree.
- ``visible_BQS`` (boolean, True = may attend) restricts attention further; only kernels with
  ``supports_mask`` accept it.
- A query row with no visible key has output 0 and LSE -inf, and receives zero gradient.
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


def _allowed_mask(visible_BQS: Optional[Tensor], causal: bool, q_len: int, k_len: int) -> Optional[Tensor]:
    """The full boolean mask (``[Q, S]`` or ``[B, Q, S]``) or None when nothing is masked."""
    if not causal:
        return visible_BQS
    device = visible_BQS.device if visible_BQS is not None else None
    tril_QS = torch.ones(q_len, k_len, dtype=torch.bool, device=device).tril()
    return tril_QS if visible_BQS is None else visible_BQS & tril_QS


class AttentionKernel:
    """Forward and backward of one attention block; subclasses implement ``_forward``/``_backward``.

    This base class owns what must hold for every kernel: GQA expansion for kernels that lack
    it, the LSE of rows that see no key, and fp32 LSEs. ``_forward``/``_backward`` take the
    layouts of ``forward``/``backward``, with KV heads already expanded to H unless
    ``native_gqa``.
    """

    name: ClassVar[str]
    supports_mask: ClassVar[bool] = False
    native_gqa: ClassVar[bool] = False

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
        groups = q_BQHD.shape[2] // k_BSKD.shape[2]
        if groups > 1 and not self.native_gqa:
            k_BSKD, v_BSKD = k_BSKD.repeat_interleave(groups, dim=2), v_BSKD.repeat_interleave(groups, dim=2)
        out_BQHD, lse_BHQ, aux = self._forward(
            q_BQHD, k_BSKD, v_BSKD, causal=causal, scale=scale, visible_BQS=visible_BQS
        )
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
        # Every kernel recomputes P = exp(s - lse). For a row that saw no key that is
        # exp(-inf + inf) = NaN; with +inf instead of -inf it is exp(-inf) = 0, so the row
        # gets zero gradient through fused and explicit kernels alike.
        lse_BHQ = lse_BHQ.masked_fill(lse_BHQ == -math.inf, math.inf).contiguous()
        kv_heads = k_BSKD.shape[2]
        groups = q_BQHD.shape[2] // kv_heads
        expand = groups > 1 and not self.native_gqa
        if expand:
            k_BSKD, v_BSKD = k_BSKD.repeat_interleave(groups, dim=2), v_BSKD.repeat_interleave(groups, dim=2)
        dq, dk, dv = self._backward(
            dout_BQHD, q_BQHD, k_BSKD, v_BSKD, out_BQHD, lse_BHQ, aux,
            causal=causal, scale=scale, visible_BQS=visible_BQS,
        )
        if expand:
            # Each KV head fed ``groups`` query heads; its gradient is the sum over them.
            dk = dk.unflatten(2, (kv_heads, groups)).sum(dim=3)
            dv = dv.unflatten(2, (kv_heads, groups)).sum(dim=3)
        return dq, dk, dv

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
        return f"{type(self).__name__}()"


class MathKernel(AttentionKernel):
    """Explicit softmax in fp32 (fp64 for fp64 inputs): any mask, any device; the reference."""

    name = "math"
    supports_mask = True
    native_gqa = True

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
    native_gqa = True  # the op broadcasts KV heads with repeat_interleave semantics

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
    native_gqa = True

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


KERNEL_SPECS: Mapping[str, KernelSpec] = {
    "flash_attn": KernelSpec(frozenset({"cuda"}), _HALF),
    "sdpa_flash": KernelSpec(frozenset({"cuda"}), _HALF),
    "sdpa_cudnn": KernelSpec(frozenset({"cuda"}), _HALF),
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
    "sdpa_flash": "this torch has no flash attention for this GPU (needs sm80 or newer)",
    "sdpa_cudnn": "cuDNN attention needs cuDNN 9 or newer",
    "sdpa_efficient": "no CUDA device",
    "cpu_flash": "this torch has no aten._scaled_dot_product_flash_attention_for_cpu",
    "math": "",
}


def check_kernel_name(name: str) -> None:
    """Refuse a name that is unknown or cannot return a log-sum-exp."""
    if name in NO_LSE:
        raise KernelUnavailableError(name, NO_LSE[name])
    if name not in KERNEL_NAMES:
        raise KernelUnavailableError(name, f"unknown; choose one of {', '.join(KERNEL_NAMES)}")


def select_kernel(name: str, *, device_type: str, dtype: torch.dtype, available: Collection[str]) -> str:
    """The kernel to run for ``name`` on ``device_type`` with ``dtype`` inputs; pure.

    ``available`` is what the runtime offers (``available_kernels``). ``auto`` takes the first
    fit in ``AUTO_ORDER``; an explicit name that does not fit raises naming why.
    """
    check_kernel_name(name)

    def fits(candidate: str) -> bool:
        spec = KERNEL_SPECS[candidate]
        on_device = spec.devices is None or device_type in spec.devices
        return on_device and dtype in spec.dtypes and candidate in available

    if name == "auto":
        for candidate in AUTO_ORDER.get(device_type, ("math",)):
            if fits(candidate):
                return candidate
        raise KernelUnavailableError(name, f"no kernel here runs {dtype} on {device_type}")
    spec = KERNEL_SPECS[name]
    if spec.devices is not None and device_type not in spec.devices:
        raise KernelUnavailableError(name, f"runs on {'/'.join(sorted(spec.devices))}, not {device_type}")
    if dtype not in spec.dtypes:
        supported = ", ".join(sorted(str(d).removeprefix("torch.") for d in spec.dtypes))
        raise KernelUnavailableError(name, f"does not take {str(dtype).removeprefix('torch.')} inputs ({supported})")
    if name not in available:
        raise KernelUnavailableError(name, UNAVAILABLE[name])
    return name


def _flash_attn_importable() -> bool:
    try:
        importlib.import_module("flash_attn.flash_attn_interface")
    except Exception:  # an ImportError, or a CUDA/ABI mismatch raised while loading its extension
        return False
    return True


@functools.lru_cache(maxsize=None)
def available_kernels(device_type: str) -> frozenset[str]:
    """Kernels this process can run on ``device_type`` (probed once)."""
    names = {"math"}
    if device_type == "cpu" and hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu"):
        names.add("cpu_flash")
    if device_type == "cuda" and torch.cuda.is_available():
        names.add("sdpa_efficient")
        ampere_or_newer = torch.cuda.get_device_capability() >= (8, 0)
        if ampere_or_newer and torch.backends.cuda.is_flash_attention_available():
            names.add("sdpa_flash")
        if torch.backends.cudnn.is_available() and (torch.backends.cudnn.version() or 0) >= 90000:
            names.add("sdpa_cudnn")
        if ampere_or_newer and _flash_attn_importable():
            names.add("flash_attn")
    return frozenset(names)


@functools.lru_cache(maxsize=None)
def _instance(name: str) -> AttentionKernel:
    return _KERNEL_CLASSES[name]()


def get_kernel(name: str, *, device_type: str, dtype: torch.dtype) -> AttentionKernel:
    """The kernel ``name`` resolves to for these inputs, or a ``KernelUnavailableError``."""
    chosen = select_kernel(name, device_type=device_type, dtype=dtype, available=available_kernels(device_type))
    return _instance(chosen)


KernelArg = Union[str, AttentionKernel]


def resolve_kernel(kernel: KernelArg, like: Tensor) -> AttentionKernel:
    """A kernel object for inputs like ``like``; a name is resolved for its device and dtype."""
    if isinstance(kernel, AttentionKernel):
        return kernel
    return get_kernel(kernel, device_type=like.device.type, dtype=like.dtype)


MATH = _instance("math")
