"""What the GPU tier's tests share: the marks that skip them without CUDA, and the one rule for
a piece missing on a GPU machine.

Without CUDA every test here skips (``MARKS``). On a machine with a GPU, ``make test-gpu`` sets
RINGTRAIN_GPU_STRICT=1 after installing what the tier needs: a missing piece (flash-attn, a
cuDNN too old for its attention) then fails its test instead of skipping it, since a skip
there would hide that the check never ran.
"""

from __future__ import annotations

import os
from typing import NoReturn, Optional

import pytest
import torch

from ringtrain.train.attention.kernels import UNAVAILABLE, AttentionKernel, available_kernels, get_kernel

STRICT_ENV = "RINGTRAIN_GPU_STRICT"
CUDA = torch.cuda.is_available()
MARKS = [pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="needs CUDA")]
# Every block kernel that runs on CUDA, the fused ones first.
FUSED = ("flash_attn", "sdpa_flash", "sdpa_cudnn", "sdpa_efficient")
CUDA_KERNELS = (*FUSED, "math")


def strict() -> bool:
    return os.environ.get(STRICT_ENV, "").strip().lower() not in ("", "0", "false")


def missing(what: str) -> NoReturn:
    """Skip the calling test for lack of ``what``; fail it under RINGTRAIN_GPU_STRICT."""
    if strict():
        pytest.fail(f"{what}; {STRICT_ENV} is set, so this check fails instead of skipping", pytrace=False)
    pytest.skip(what)


def cuda_kernel(name: str, dtype: torch.dtype = torch.bfloat16, head_dim: Optional[int] = None) -> AttentionKernel:
    """The CUDA block kernel ``name`` for ``dtype`` inputs (of ``head_dim``, when given); skips
    (fails when strict) if this machine lacks it."""
    if name not in available_kernels("cuda"):
        missing(f"attention kernel {name} is not available here: {UNAVAILABLE[name]}")
    return get_kernel(name, device_type="cuda", dtype=dtype, head_dim=head_dim)
