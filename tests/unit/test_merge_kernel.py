"""The Triton LSE merge (train/attention/merge_kernel.py) against the torch reference, on the CPU.

Triton's interpreter (TRITON_INTERPRET=1) runs a kernel's program on CPU tensors with the
kernel's own arithmetic, so the one kernel ring attention merges with on CUDA is checked here:
in place into strided views of the accumulators (a ring block's half of the rows), rows empty
on one side or both (out 0 and LSE -inf stay so, no NaN), bf16 and fp32 blocks, head dims that
are not a power of two. The GPU tier runs it compiled.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Iterator
from types import ModuleType

import pytest
import torch

from ringtrain.train.attention.merge import merge_partials
from tests.tools import missing

B, S, H = 2, 48, 4


@pytest.fixture(scope="module")
def kernel() -> Iterator[ModuleType]:
    if importlib.util.find_spec("triton") is None:
        missing("triton is not installed (pip install -e '.[test]' brings it)")
    import triton

    # Read where a kernel is decorated and where it is launched: on while these tests run.
    was = triton.knobs.runtime.interpret
    triton.knobs.runtime.interpret = True
    try:
        yield importlib.reload(importlib.import_module("ringtrain.train.attention.merge_kernel"))
    finally:
        triton.knobs.runtime.interpret = was


def _partials(D: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(D)
    out = torch.randn(B, S, H, D, generator=gen)
    lse = torch.randn(B, H, S, generator=gen) * 3
    blk_out = torch.randn(B, S // 2, H, D, generator=gen).to(dtype)
    blk_lse = torch.randn(B, H, S // 2, generator=gen) * 3
    # Rows that see nothing: on the block's side only, on the accumulator's only, on both.
    blk_lse[:, :, 0] = -math.inf
    blk_out[:, 0] = 0
    lse[:, :, S // 2 + 1] = -math.inf
    out[:, S // 2 + 1] = 0
    lse[:, :, S // 2 + 2] = blk_lse[:, :, 2] = -math.inf
    out[:, S // 2 + 2] = 0
    blk_out[:, 2] = 0
    return out, lse, blk_out, blk_lse


@pytest.mark.parametrize("head_dim", [64, 40])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_kernel_merges_into_views_as_the_reference_does(kernel: ModuleType, head_dim: int, dtype: torch.dtype) -> None:
    out, lse, blk_out, blk_lse = _partials(head_dim, dtype)
    rows = slice(S // 2, None)  # the second half: a strided view of both accumulators
    want_out, want_lse = merge_partials(out[:, rows], lse[:, :, rows], blk_out, blk_lse)
    untouched_out, untouched_lse = out[:, : S // 2].clone(), lse[:, :, : S // 2].clone()

    kernel.merge_into_(out[:, rows], lse[:, :, rows], blk_out, blk_lse)

    torch.testing.assert_close(out[:, rows], want_out, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(lse[:, :, rows], want_lse, rtol=1e-6, atol=1e-6)
    assert not out.isnan().any() and not lse.isnan().any()
    assert (lse[:, :, S // 2 + 2] == -math.inf).all() and (out[:, S // 2 + 2] == 0).all()
    assert torch.equal(out[:, : S // 2], untouched_out) and torch.equal(lse[:, :, : S // 2], untouched_lse)


def test_rows_past_2_to_the_31_elements_are_addressed_in_64_bits(kernel: ModuleType) -> None:
    # An accumulator of 128K tokens of 128 heads of 128 holds 2^31 elements: its last rows' offsets
    # (row index times a stride under 2^31) wrap in 32 bits, on a GPU a wrong row or a fault (the
    # interpreter faults). Three query rows 2^30 elements apart: the storage is 8 GiB of address
    # space, of which only the rows' pages are ever touched.
    stride, D = 2**30, 8
    storage = torch.empty(2 * stride + D)
    out = storage.as_strided((1, 3, 1, D), (0, stride, D, 1))
    out.copy_(torch.arange(3 * D, dtype=torch.float32).view(1, 3, 1, D))
    lse = torch.tensor([[[0.5, -1.0, 2.0]]])
    blk_out, blk_lse = torch.full((1, 3, 1, D), -4.0), torch.tensor([[[1.0, 0.0, -3.0]]])
    want_out, want_lse = merge_partials(out.clone(), lse.clone(), blk_out, blk_lse)

    kernel.merge_into_(out, lse, blk_out, blk_lse)

    torch.testing.assert_close(out, want_out, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(lse, want_lse, rtol=1e-6, atol=1e-6)


def test_the_kernel_refuses_partials_of_different_shapes(kernel: ModuleType) -> None:
    out, lse, blk_out, blk_lse = _partials(64, torch.float32)
    with pytest.raises(ValueError, match="merge shapes disagree"):
        kernel.merge_into_(out, lse, blk_out, blk_lse)
