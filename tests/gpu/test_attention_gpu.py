"""CUDA block kernels against the fp32 math kernel: outputs, true LSEs and gradients."""

from __future__ import annotations

import pytest
import torch

from ringtrain.train.attention import local_attention
from ringtrain.train.attention.kernels import MATH, AttentionKernel
from ringtrain.train.attention.merge import merge_partials

from .support import FUSED, MARKS, cuda_kernel

pytestmark = MARKS

SCALE = 128**-0.5


def _inputs(heads: int, kv_heads: int, seq: int = 256, dtype: torch.dtype = torch.bfloat16) -> list[torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    shapes = [(2, seq, heads, 128), (2, seq, kv_heads, 128), (2, seq, kv_heads, 128), (2, seq, heads, 128)]
    return [torch.randn(s, generator=gen, device="cuda", dtype=dtype) for s in shapes]


def _kernel(name: str) -> AttentionKernel:
    return cuda_kernel(name, torch.bfloat16)


@pytest.mark.parametrize("name", FUSED)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize(("heads", "kv_heads"), [(8, 8), (8, 2)])
def test_fused_kernel_matches_math(name: str, causal: bool, heads: int, kv_heads: int) -> None:
    kernel = _kernel(name)
    q, k, v, dout = _inputs(heads, kv_heads)
    got = kernel.forward(q, k, v, causal=causal, scale=SCALE)
    want = MATH.forward(q, k, v, causal=causal, scale=SCALE)
    assert got.lse_BHQ.dtype == torch.float32 and got.lse_BHQ.shape == want.lse_BHQ.shape
    torch.testing.assert_close(got.lse_BHQ, want.lse_BHQ, atol=2e-2, rtol=0)
    torch.testing.assert_close(got.out_BQHD.float(), want.out_BQHD.float(), atol=2e-2, rtol=0)
    grads = kernel.backward(dout, q, k, v, got.out_BQHD, got.lse_BHQ, got.aux, causal=causal, scale=SCALE)
    ref = MATH.backward(dout, q, k, v, want.out_BQHD, want.lse_BHQ, None, causal=causal, scale=SCALE)
    for g, r in zip(grads, ref):
        assert g.shape == r.shape
        torch.testing.assert_close(g.float(), r.float(), atol=5e-2, rtol=5e-2)


@pytest.mark.parametrize("name", FUSED)
def test_lse_merges_key_halves_into_the_whole(name: str) -> None:
    """A merge of two key halves equals one call over all keys only if the LSE is real."""
    kernel = _kernel(name)
    q, k, v, _ = _inputs(8, 2)
    halves = [kernel.forward(q, k[:, s], v[:, s], causal=False, scale=SCALE) for s in (slice(0, 128), slice(128, None))]
    merged, lse = merge_partials(halves[0].out_BQHD, halves[0].lse_BHQ, halves[1].out_BQHD, halves[1].lse_BHQ)
    whole = kernel.forward(q, k, v, causal=False, scale=SCALE)
    torch.testing.assert_close(lse, whole.lse_BHQ, atol=1e-2, rtol=0)
    torch.testing.assert_close(merged, whole.out_BQHD.float(), atol=2e-2, rtol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_auto_local_attention_on_cuda(dtype: torch.dtype) -> None:
    q, k, v, dout = (t.requires_grad_() for t in _inputs(8, 2, dtype=dtype))
    out = local_attention(q, k, v, causal=True)
    out.backward(dout)
    assert out.dtype == dtype and q.grad is not None and q.grad.dtype == dtype
    ref = MATH.forward(q.detach(), k.detach(), v.detach(), causal=True, scale=SCALE)
    torch.testing.assert_close(out.float(), ref.out_BQHD.float(), atol=2e-2, rtol=0)
