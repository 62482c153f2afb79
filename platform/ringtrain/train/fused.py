"""Fused ops of the decoder's forward: which run, and the calls that pick a fused kernel or the eager one.

Two kinds, switched by ``train.fused_ops`` (``FusedOps.from_job``):

- kernels: RMSNorm (Llama's and Gemma's), RoPE, SwiGLU / GeGLU and the output projection with its cross-entropy as
  liger-kernel's Triton kernels (Hsu et al. 2024, "Liger Kernel: Efficient Triton Kernels for LLM
  Training"), on CUDA where liger-kernel imports. Each keeps less for the backward than the eager
  ops (RMSNorm its input and one fp32 rstd per row instead of fp32 copies; SwiGLU its two inputs,
  recomputing the SiLU; the loss no logits at all) and runs as one kernel instead of several.
  Elsewhere, and where liger-kernel is missing, the eager path runs: the reference they are
  tested against.
- projections: q/k/v, and the SwiGLU's gate and up projections, as one GEMM each, over the
  parameters concatenated at each call. The parameters stay separate (Hugging Face's layout, for
  import, export and every ZeRO stage's state), so the only cost is the concatenation (a weight
  copy, small next to the GEMM at long context), and the gradient is split back by autograd.
  Not under ZeRO-3, which gathers a parameter only while its own module runs.

The eager ops compute in fp32 and round once, as Hugging Face's Llama does; the kernels take
the same inputs and agree within bf16 rounding (tests/gpu/test_fused_gpu.py).

Shape legend: B batch, S sequence, H query heads, K key/value heads, D head dim, E model dim,
F FFN dim, T tokens, V vocabulary.
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

from ringtrain.config import JobConfig
from ringtrain.train.data import IGNORE_INDEX

Tensor = torch.Tensor


@dataclass(frozen=True)
class FusedOps:
    """Which fused ops a model runs (see the module docstring); both off is the reference path."""

    kernels: bool = False
    projections: bool = False

    @classmethod
    def from_job(cls, job: JobConfig) -> FusedOps:
        on = bool(job.train.fused_ops)
        return cls(kernels=on, projections=on and job.zero.stage != 3)


@functools.lru_cache(maxsize=None)
def liger_ops() -> Optional[Any]:
    """liger-kernel's ops module namespace, or None where it (or a Triton it can use) is missing."""
    try:
        return importlib.import_module("liger_kernel.transformers.functional")
    except Exception:  # not installed, or installed without a usable Triton
        return None


def kernels_run(fused: FusedOps, device_type: str) -> bool:
    """Whether ``fused``'s kernels run on ``device_type`` here (else the eager ops do)."""
    return fused.kernels and device_type == "cuda" and liger_ops() is not None


def _kernels_for(x: Tensor, fused: FusedOps) -> Optional[Any]:
    """liger's functions when ``fused`` asks for kernels and ``x`` is on a GPU that can run them."""
    return liger_ops() if kernels_run(fused, x.device.type) else None


def rms_norm(x: Tensor, weight: Tensor, eps: float, fused: FusedOps, style: str = "llama") -> Tensor:
    """RMSNorm over the last dim, normalised in fp32. ``llama``: ``x / rms(x) * weight``, rounded
    to x's dtype before the weight; ``gemma``: ``x / rms(x) * (1 + weight)`` all in fp32, rounded
    once at the end (Gemma's gains are stored centred on zero)."""
    liger = _kernels_for(x, fused)
    gemma = style == "gemma"
    if liger is not None:
        if gemma:
            return liger.liger_rms_norm(x, weight, eps, offset=1.0, casting_mode="gemma", in_place=True)
        return liger.liger_rms_norm(x, weight, eps, casting_mode="llama", in_place=True)
    x_fp32 = x.float()
    normed = x_fp32 * torch.rsqrt(x_fp32.pow(2).mean(-1, keepdim=True) + eps)
    if gemma:
        return (normed * (1.0 + weight.float())).type_as(x)
    return normed.type_as(x) * weight


def _rotate(x_BSHD: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    # The half-split convention (rotate the first half against the second), as in Llama's HF port.
    x1, x2 = x_BSHD.float().chunk(2, dim=-1)
    rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return rotated.type_as(x_BSHD)


def apply_rotary(
    q_BSHD: Tensor, k_BSKD: Tensor, cos_BS1R: Tensor, sin_BS1R: Tensor, fused: FusedOps
) -> tuple[Tensor, Tensor]:
    """q and k rotated by their positions' angles; cos/sin ``[B, S, 1, D/2]`` in fp32 (R = D/2)."""
    liger = _kernels_for(q_BSHD, fused)
    if liger is not None:
        # liger takes head-major views of sequence-major storage, and cos/sin of one half's
        # width [B, S, D/2] when told the rotary width; it computes in cos's dtype (fp32).
        cos_BSR, sin_BSR = cos_BS1R.squeeze(2), sin_BS1R.squeeze(2)
        q_BHSD, k_BKSD = liger.liger_rope(
            q_BSHD.transpose(1, 2), k_BSKD.transpose(1, 2), cos_BSR, sin_BSR, rotary_dim=q_BSHD.shape[-1]
        )
        return q_BHSD.transpose(1, 2), k_BKSD.transpose(1, 2)
    return _rotate(q_BSHD, cos_BS1R, sin_BS1R), _rotate(k_BSKD, cos_BS1R, sin_BS1R)


def swiglu(gate_BSF: Tensor, up_BSF: Tensor, fused: FusedOps) -> Tensor:
    """``silu(gate) * up``."""
    liger = _kernels_for(gate_BSF, fused)
    if liger is not None:
        return liger.liger_swiglu(gate_BSF, up_BSF)
    return F.silu(gate_BSF) * up_BSF


def geglu(gate_BSF: Tensor, up_BSF: Tensor, fused: FusedOps) -> Tensor:
    """``gelu(gate) * up`` with GELU's tanh approximation (Gemma's ``gelu_pytorch_tanh``, which
    liger's GeGLU kernel computes too)."""
    liger = _kernels_for(gate_BSF, fused)
    if liger is not None:
        return liger.liger_geglu(gate_BSF, up_BSF)
    return F.gelu(gate_BSF, approximate="tanh") * up_BSF


GatedActivation = Callable[[Tensor, Tensor, FusedOps], Tensor]
# The gated MLP's activation by config's ACTIVATIONS name.
GATED_ACTIVATIONS: dict[str, GatedActivation] = {"silu": swiglu, "gelu_pytorch_tanh": geglu}


class _StackedLinear(torch.autograd.Function):
    """``x @ cat(weights).T (+ cat(biases))`` as one GEMM forward and two backward, with the
    concatenated weight made for each GEMM and freed after it: autograd keeps only ``x`` and
    references to the separate weights, never a second copy of them across the step."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, num_weights: int, *params: Tensor) -> Tensor:  # type: ignore[override]
        weights, biases = params[:num_weights], params[num_weights:]
        ctx.num_weights = num_weights
        ctx.save_for_backward(x, *weights)
        return F.linear(x, torch.cat(weights), torch.cat(biases) if biases else None)

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Optional[Tensor], ...]:  # type: ignore[override]
        x, *weights = ctx.saved_tensors
        grad_x = grad_out @ torch.cat(weights) if ctx.needs_input_grad[0] else None
        grad_2d = grad_out.flatten(0, -2)
        grad_w = (grad_2d.t() @ x.flatten(0, -2)).split([w.shape[0] for w in weights])
        has_bias = len(ctx.needs_input_grad) > 2 + ctx.num_weights
        grad_b = grad_2d.sum(0).split([w.shape[0] for w in weights]) if has_bias else ()
        return (grad_x, None, *grad_w, *grad_b)


def projections(x: Tensor, linears: tuple[torch.nn.Linear, ...], fused: FusedOps) -> tuple[Tensor, ...]:
    """Each linear of ``linears`` applied to ``x``: one GEMM over their stacked weights when
    ``fused.projections``, else one call each."""
    if not fused.projections or len(linears) == 1:
        return tuple(linear(x) for linear in linears)
    biases = [linear.bias for linear in linears if linear.bias is not None]
    if biases and len(biases) != len(linears):
        raise ValueError("fused projections need a bias on every linear or on none")
    out = _StackedLinear.apply(x, len(linears), *(linear.weight for linear in linears), *biases)
    return out.split([linear.out_features for linear in linears], dim=-1)


def cross_entropy_sum(
    hidden_TE: Tensor, weight_VE: Tensor, labels_T: Tensor, fused: FusedOps, softcap: Optional[float] = None
) -> Optional[Tensor]:
    """The fp32 sum of the token losses of ``hidden @ weight.T`` over labelled tokens, by liger's
    fused linear cross-entropy (chunks of logits made and turned into gradients in the forward,
    none kept), or None where it does not run (the caller then takes its own path). ``softcap``:
    the logits are ``softcap * tanh(logits / softcap)`` first."""
    liger = _kernels_for(hidden_TE, fused)
    if liger is None:
        return None
    # The weight gradient is summed over chunks: in fp32, as the unfused matmul accumulates it.
    extra = {} if softcap is None else {"softcap": softcap}
    loss = liger.liger_fused_linear_cross_entropy(
        hidden_TE, weight_VE, labels_T, ignore_index=IGNORE_INDEX, reduction="sum", accum_dtype=torch.float32, **extra
    )
    return loss.float()
