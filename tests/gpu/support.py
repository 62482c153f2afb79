"""What the GPU tier's tests share: the marks that skip them without CUDA, and the one rule for
a piece missing on a GPU machine.

Without CUDA every test here skips (``MARKS``). On a machine with a GPU, ``make test-gpu`` sets
RINGTRAIN_GPU_STRICT=1 after installing what the tier needs: a missing piece (flash-attn, a
cuDNN too old for its attention, Ray) then fails its test instead of skipping it, since a skip
there would hide that the check never ran. A package the environment leaves out on purpose is
the exception: RINGTRAIN_GPU_LEFT_OUT names such distributions (``make test-gpu
PYTHON_ENV=system`` builds no flash-attn and carries no Ray), and a test that needs one of them
while it is not installed is reported as not run, naming it, strict or not.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re
from typing import NoReturn, Optional

import pytest
import torch

from ringtrain.train.attention.kernels import UNAVAILABLE, AttentionKernel, available_kernels, get_kernel

STRICT_ENV = "RINGTRAIN_GPU_STRICT"
LEFT_OUT_ENV = "RINGTRAIN_GPU_LEFT_OUT"
CUDA = torch.cuda.is_available()
MARKS = [pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="needs CUDA")]
# Every block kernel that runs on CUDA, the fused ones first.
FUSED = ("flash_attn", "sdpa_flash", "sdpa_cudnn", "sdpa_efficient")
CUDA_KERNELS = (*FUSED, "math")
# The distribution a kernel comes from, where it is not torch itself.
KERNEL_DISTRIBUTION = {"flash_attn": "flash-attn"}


def strict() -> bool:
    return os.environ.get(STRICT_ENV, "").strip().lower() not in ("", "0", "false")


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def left_out(distribution: str) -> bool:
    """Whether ``distribution`` is absent here because RINGTRAIN_GPU_LEFT_OUT says it was left
    out; listed but installed does not count (then it must work)."""
    listed = {_canonical(name) for name in re.split(r"[\s,]+", os.environ.get(LEFT_OUT_ENV, "")) if name}
    if _canonical(distribution) not in listed:
        return False
    try:
        importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return True
    return False


def not_run(label: str, why: str, *, on_purpose: bool) -> str:
    """The reason a test reports for not running: what it needs first, so that reports group by it."""
    return f"not run: needs {label}: {why}" + (f" (left out on purpose: {LEFT_OUT_ENV})" if on_purpose else "")


def missing(what: str, distribution: Optional[str] = None) -> NoReturn:
    """Skip the calling test for lack of ``what``; fail it under RINGTRAIN_GPU_STRICT, unless
    ``what`` comes from a ``distribution`` left out on purpose."""
    if distribution is not None and left_out(distribution):
        pytest.skip(not_run(distribution, what, on_purpose=True))
    if strict():
        pytest.fail(f"{what}; {STRICT_ENV} is set, so this check fails instead of skipping", pytrace=False)
    pytest.skip(what)


def needs_module(module: str, distribution: str, label: str) -> pytest.MarkDecorator:
    """A mark that reports a test as not run, naming ``label``, where ``module`` cannot be
    imported and its distribution was left out (or nothing is strict). Under strict mode with the
    distribution expected, the test runs and its import fails, as it should."""
    absent = importlib.util.find_spec(module) is None
    on_purpose = absent and left_out(distribution)
    return pytest.mark.skipif(
        absent and (on_purpose or not strict()),
        reason=not_run(label, f"{module} is not installed here", on_purpose=on_purpose),
    )


def cuda_kernel(name: str, dtype: torch.dtype = torch.bfloat16, head_dim: Optional[int] = None) -> AttentionKernel:
    """The CUDA block kernel ``name`` for ``dtype`` inputs (of ``head_dim``, when given); skips
    (fails when strict) if this machine lacks it."""
    if name not in available_kernels("cuda"):
        missing(f"attention kernel {name} is not available here: {UNAVAILABLE[name]}", KERNEL_DISTRIBUTION.get(name))
    return get_kernel(name, device_type="cuda", dtype=dtype, head_dim=head_dim)
