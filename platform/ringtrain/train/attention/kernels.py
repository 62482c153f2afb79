"""The block-kernel registry: kernel names to kernels, and which kernel runs for given inputs.

The names are config's (``ATTENTION_KERNELS``: "auto" and ``ATTENTION_BLOCK_KERNELS``); each
names one ``AttentionKernel`` class, which declares what it takes (``spec``), the aten ops it
calls (``ops``) and whether it runs here (``runs_here``). Choosing is pure (``select_kernel``:
names, device, dtype, head dim and what the runtime offers in, a name out);
``get_kernel``/``resolve_kernel``/``mask_kernel`` add the runtime's probe and hand out the
(stateless, shared) kernel objects. Packed documents need no mask-capable kernel (``blocks`` cuts
their blocks into unmasked ones); only a sliding window's edge tiles do.

This module is also the kernels' front door: what callers outside the package need to run a
kernel (``AttentionKernel``, ``BlockOutput``, ``default_scale``, the kernel classes) is
importable from here.

Shape legend: B batch, Q query length, S key length, H query heads, D head dim.
"""

from __future__ import annotations

import functools
from collections.abc import Collection, Mapping
from typing import Optional, TypeVar, Union

import torch

from ringtrain.config import ATTENTION_BLOCK_KERNELS, ATTENTION_KERNELS, AUTO_KERNEL
from ringtrain.train.attention.block_kernel import (
    AtenOps,
    AttentionKernel,
    BlockOutput,
    Grads,
    KernelSpec,
    KernelUnavailableError,
    SchemaLookup,
    aten_schema,
    default_scale,
    ops_fit,
)
from ringtrain.train.attention.flash_attn_kernel import FlashAttnKernel
from ringtrain.train.attention.math_kernel import MathKernel
from ringtrain.train.attention.sdpa_kernels import (
    CpuFlashKernel,
    SdpaCudnnKernel,
    SdpaEfficientKernel,
    SdpaFlashKernel,
    sdpa_takes_gqa,
)

__all__ = [
    "AUTO_ORDER",
    "HOPPER",
    "KERNEL_CLASSES",
    "KERNEL_NAMES",
    "KERNEL_OPS",
    "KERNEL_SPECS",
    "MASK_ORDER",
    "MATH",
    "NO_LSE",
    "UNAVAILABLE",
    "AttentionKernel",
    "BlockOutput",
    "CpuFlashKernel",
    "FlashAttnKernel",
    "Grads",
    "KernelArg",
    "KernelSpec",
    "KernelUnavailableError",
    "MathKernel",
    "SdpaCudnnKernel",
    "SdpaEfficientKernel",
    "SdpaFlashKernel",
    "aten_schema",
    "available_kernels",
    "check_kernel_name",
    "default_scale",
    "device_capability",
    "get_kernel",
    "kernel_ops_fit",
    "mask_kernel",
    "platform_of",
    "resolve_kernel",
    "sdpa_takes_gqa",
    "select_kernel",
]

_V = TypeVar("_V")


def keyed_by(names: tuple[str, ...], table: Mapping[str, _V], what: str) -> dict[str, _V]:
    """``table`` in the order of ``names``; raises unless its keys are exactly ``names``.

    Run at import, so a declared kernel name without a kernel (or a kernel without a declared
    name) stops the first import instead of failing when a job names it.
    """
    missing, extra = set(names) - set(table), set(table) - set(names)
    if missing or extra:
        raise RuntimeError(
            f"{what} disagree with config's declared names: missing {sorted(missing)}, undeclared {sorted(extra)}"
        )
    return {name: table[name] for name in names}


KERNEL_CLASSES: Mapping[str, type[AttentionKernel]] = keyed_by(
    ATTENTION_BLOCK_KERNELS,
    {
        cls.name: cls
        for cls in (FlashAttnKernel, SdpaFlashKernel, SdpaCudnnKernel, SdpaEfficientKernel, CpuFlashKernel, MathKernel)
    },
    "the block kernel classes",
)
KERNEL_NAMES: tuple[str, ...] = ATTENTION_KERNELS

# Views of what each class declares, by name: what selection and the tests read.
KERNEL_SPECS: Mapping[str, KernelSpec] = {name: cls.spec for name, cls in KERNEL_CLASSES.items()}
UNAVAILABLE: Mapping[str, str] = {name: cls.unavailable for name, cls in KERNEL_CLASSES.items()}
KERNEL_OPS: Mapping[str, AtenOps] = {name: cls.ops for name, cls in KERNEL_CLASSES.items() if cls.ops}

# Fastest first, by platform (``platform_of``); unlisted devices get "math". Measured with
# bench/attention.py (bf16, causal, GQA, one call, fwd / bwd TFLOP/s): on Hopper cuDNN's fused
# attention runs 455 / 420 at head dim 64 and 560-650 / 540-570 at 128, against 295-345 /
# 270-330 for FlashAttention-2 (torch's bundled copy) and 130-180 / 100-130 for the efficient
# kernel. Before Hopper FlashAttention-2 leads.
HOPPER = (9, 0)
AUTO_ORDER: Mapping[str, tuple[str, ...]] = {
    "cuda-sm90": ("sdpa_cudnn", "flash_attn", "sdpa_flash", "sdpa_efficient", "math"),
    "cuda": ("flash_attn", "sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "math"),
    "cpu": ("cpu_flash", "math"),
}
# Where a masked piece of a block (a sliding window's edge, ``blocks``) goes when the layer's
# kernel takes no mask, best first; "math" (any mask, any device, but the whole score matrix of the
# piece) closes every list. On CUDA the efficient kernel takes the mask as an additive bias and
# keeps the LSE the merge needs.
MASK_ORDER: Mapping[str, tuple[str, ...]] = {
    "cuda": ("sdpa_efficient",),
    "cpu": ("cpu_flash",),
}


# Names someone might reasonably try that cannot serve context parallelism.
NO_LSE: Mapping[str, str] = {
    "sdpa": "torch.nn.functional.scaled_dot_product_attention returns the output only, no log-sum-exp, "
    "so context-parallel blocks cannot be merged; use 'auto' or one of the sdpa_* kernels",
    "sdpa_math": "the SDPA math backend returns no log-sum-exp; use 'math', which does",
}


def check_kernel_name(name: str) -> None:
    """Refuse a name that is unknown or cannot return a log-sum-exp."""
    if name in NO_LSE:
        raise KernelUnavailableError(name, NO_LSE[name])
    if name not in KERNEL_NAMES:
        raise KernelUnavailableError(name, f"unknown; choose one of {', '.join(KERNEL_NAMES)}")


def platform_of(device_type: str, capability: Optional[tuple[int, int]] = None) -> str:
    """The ``AUTO_ORDER`` key for a device: CUDA devices of compute capability 9.0 or newer
    (Hopper, Blackwell) order their kernels apart from older ones."""
    if device_type == "cuda" and capability is not None and capability >= HOPPER:
        return "cuda-sm90"
    return device_type


def device_capability(device_type: str) -> Optional[tuple[int, int]]:
    """The current CUDA device's compute capability; None elsewhere."""
    if device_type != "cuda" or not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability()
    return (major, minor)


def _fits(
    name: str, *, device_type: str, dtype: torch.dtype, head_dim: Optional[int], available: Collection[str]
) -> bool:
    spec = KERNEL_SPECS[name]
    on_device = spec.devices is None or device_type in spec.devices
    return on_device and dtype in spec.dtypes and spec.takes_head_dim(head_dim) and name in available


def select_kernel(
    name: str,
    *,
    device_type: str,
    dtype: torch.dtype,
    available: Collection[str],
    head_dim: Optional[int] = None,
    capability: Optional[tuple[int, int]] = None,
) -> str:
    """The kernel to run for ``name`` on ``device_type`` with ``dtype`` inputs; pure.

    ``available`` is what the runtime offers (``available_kernels``). ``auto`` takes the first
    fit in the ``AUTO_ORDER`` of the device's platform (``capability``: its CUDA compute
    capability, None when not known); an explicit name that does not fit raises naming why.
    ``head_dim`` (None: not known) rules out kernels whose op cannot take it.
    """
    check_kernel_name(name)
    if name == AUTO_KERNEL:
        for candidate in AUTO_ORDER.get(platform_of(device_type, capability), ("math",)):
            if _fits(candidate, device_type=device_type, dtype=dtype, head_dim=head_dim, available=available):
                return candidate
        shape = "" if head_dim is None else f" with head dim {head_dim}"
        raise KernelUnavailableError(name, f"no kernel here runs {dtype}{shape} on {device_type}")
    spec = KERNEL_SPECS[name]
    if spec.devices is not None and device_type not in spec.devices:
        raise KernelUnavailableError(name, f"runs on {'/'.join(sorted(spec.devices))}, not {device_type}")
    if dtype not in spec.dtypes:
        supported = ", ".join(sorted(str(d).removeprefix("torch.") for d in spec.dtypes))
        raise KernelUnavailableError(name, f"does not take {str(dtype).removeprefix('torch.')} inputs ({supported})")
    if not spec.takes_head_dim(head_dim):
        raise KernelUnavailableError(name, f"takes head dims up to {spec.max_head_dim}, not {head_dim}")
    if name not in available:
        raise KernelUnavailableError(name, UNAVAILABLE[name])
    return name


def kernel_ops_fit(name: str, schema_of: SchemaLookup = aten_schema) -> bool:
    """Whether every op kernel ``name`` calls exists with the signature its call is written for."""
    return ops_fit(KERNEL_OPS.get(name, {}), schema_of)


@functools.lru_cache(maxsize=None)
def available_kernels(device_type: str) -> frozenset[str]:
    """Kernels this process can run on ``device_type`` (probed once)."""
    return frozenset(name for name, cls in KERNEL_CLASSES.items() if cls.runs_here(device_type))


@functools.lru_cache(maxsize=None)
def _instance(name: str) -> AttentionKernel:
    return KERNEL_CLASSES[name]()


def get_kernel(
    name: str, *, device_type: str, dtype: torch.dtype, head_dim: Optional[int] = None
) -> AttentionKernel:
    """The kernel ``name`` resolves to for these inputs, or a ``KernelUnavailableError``."""
    chosen = select_kernel(
        name,
        device_type=device_type,
        dtype=dtype,
        available=available_kernels(device_type),
        head_dim=head_dim,
        capability=device_capability(device_type),
    )
    return _instance(chosen)


KernelArg = Union[str, AttentionKernel]


def resolve_kernel(kernel: KernelArg, like: torch.Tensor) -> AttentionKernel:
    """A kernel object for inputs like ``like`` [..., D]; a name is resolved for its device,
    dtype and head dim."""
    if isinstance(kernel, AttentionKernel):
        return kernel
    return get_kernel(kernel, device_type=like.device.type, dtype=like.dtype, head_dim=like.shape[-1])


def mask_kernel(kernel: AttentionKernel, like: torch.Tensor) -> AttentionKernel:
    """The kernel a masked piece with queries like ``like`` [B, Q, H, D] runs on: ``kernel`` if it
    takes masks, else the first of ``MASK_ORDER`` that fits and runs here, else "math"."""
    if kernel.supports_mask:
        return kernel
    device_type = like.device.type
    for candidate in MASK_ORDER.get(device_type, ()):
        if _fits(candidate, device_type=device_type, dtype=like.dtype, head_dim=like.shape[-1],
                 available=available_kernels(device_type)):
            return _instance(candidate)
    return _instance("math")


MATH = _instance("math")
