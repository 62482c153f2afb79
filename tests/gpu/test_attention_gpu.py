"""CUDA block kernels against the math kernel (fp32, or float64 for masked blocks): outputs, true
LSEs and gradients."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import pytest
import torch

from ringtrain.train.attention import local_attention
from ringtrain.train.attention.documents import doc_visibility
from ringtrain.train.attention.kernels import MATH, AttentionKernel, KernelArg, get_kernel
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


def _packed_doc_ids(batch: int, seq: int, ends: Optional[Sequence[int]] = None, padding: int = 7) -> torch.Tensor:
    """[B, S] doc ids: documents ending at ``ends`` (by default uneven ones) on every sample, and
    ``padding`` tokens of padding (-1) at the end of the first."""
    doc_BS = torch.zeros(batch, seq, dtype=torch.long, device="cuda")
    for end in ends or (seq // 5, seq // 2 + 3, seq - 11):
        doc_BS[:, end:] += 1
    doc_BS[0, seq - padding :] = -1
    return doc_BS


def _packed_grads_match_float64(kernel: KernelArg, causal: bool, dtype: torch.dtype, seq: int, doc_BS: torch.Tensor,
                                padding: int) -> list[torch.Tensor]:
    """Packed local attention on CUDA, forward and autograd, against the math kernel in float64;
    the gradients, for more checks."""
    q, k, v, dout = (t.requires_grad_() for t in _inputs(8, 2, seq=seq, dtype=dtype))
    out = local_attention(q, k, v, causal=causal, doc_ids=doc_BS, kernel=kernel)
    out.backward(dout)
    ref_q, ref_k, ref_v = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = local_attention(ref_q, ref_k, ref_v, causal=causal, doc_ids=doc_BS, kernel="math")
    ref.backward(dout.double())
    atol = 2e-2 if dtype != torch.float32 else 1e-3
    torch.testing.assert_close(out.double(), ref, atol=atol, rtol=0)
    grads = []
    for got, want in ((q.grad, ref_q.grad), (k.grad, ref_k.grad), (v.grad, ref_v.grad)):
        assert got is not None and want is not None
        torch.testing.assert_close(got.double(), want, atol=5 * atol, rtol=5 * atol)
        grads.append(got)
    assert out[0, -padding:].abs().max() == 0  # padding rows see nothing
    return grads


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(("q_len", "k_len", "causal"), [(256, 256, True), (256, 256, False), (128, 200, False)])
@pytest.mark.parametrize(("heads", "kv_heads"), [(8, 8), (8, 2)])
def test_masked_block_on_cuda_runs_efficient_and_matches_float64(
    dtype: torch.dtype, q_len: int, k_len: int, causal: bool, heads: int, kv_heads: int
) -> None:
    """The efficient kernel's biased path, the one fused CUDA kernel that takes a mask and
    returns the LSE: output, true LSE (-inf for rows that see nothing) and gradients as float64."""
    efficient = cuda_kernel("sdpa_efficient", dtype)  # skips (fails when strict) if the op is missing
    q, _, _, dout = _inputs(heads, kv_heads, seq=q_len, dtype=dtype)
    _, k, v, _ = _inputs(heads, kv_heads, seq=k_len, dtype=dtype)
    doc_BS = _packed_doc_ids(2, max(q_len, k_len))
    visible_BQS = doc_visibility(doc_BS[:, :q_len], doc_BS[:, :k_len])
    got = efficient.forward(q, k, v, causal=causal, scale=SCALE, visible_BQS=visible_BQS)
    ref_inputs = [t.double() for t in (q, k, v)]
    want = MATH.forward(*ref_inputs, causal=causal, scale=SCALE, visible_BQS=visible_BQS)
    assert got.lse_BHQ.dtype == torch.float32 and got.out_BQHD.dtype == dtype
    atol = 2e-2 if dtype != torch.float32 else 1e-3
    torch.testing.assert_close(got.lse_BHQ.double(), want.lse_BHQ, atol=atol, rtol=0)  # -inf rows equal too
    torch.testing.assert_close(got.out_BQHD.double(), want.out_BQHD, atol=atol, rtol=0)
    grads = efficient.backward(
        dout, q, k, v, got.out_BQHD, got.lse_BHQ, got.aux, causal=causal, scale=SCALE, visible_BQS=visible_BQS
    )
    ref = MATH.backward(
        dout.double(), *ref_inputs, want.out_BQHD, want.lse_BHQ, None, causal=causal, scale=SCALE,
        visible_BQS=visible_BQS,
    )
    gtol = 5e-2 if dtype != torch.float32 else 5e-3
    for g, r in zip(grads, ref, strict=True):
        assert g.shape == r.shape and g.isfinite().all()
        torch.testing.assert_close(g.double(), r, atol=gtol, rtol=gtol)
    if q_len == k_len:  # the first sample's last 7 queries are padding: they see no key
        assert grads[0][0, -7:].abs().max() == 0 and got.out_BQHD[0, -7:].abs().max() == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_packed_local_attention_on_cuda_matches_float64(dtype: torch.dtype) -> None:
    """``data.packing: doc`` on CUDA end to end: the auto kernel on each document's block, autograd."""
    _packed_grads_match_float64("auto", True, dtype, 256, _packed_doc_ids(2, 256), padding=7)



@pytest.mark.parametrize("name", FUSED)
@pytest.mark.parametrize("causal", [True, False])
def test_each_fused_kernel_runs_one_token_and_odd_length_documents(name: str, causal: bool) -> None:
    """Packed documents give a kernel a block per document (``plan``'s pieces, the sequence being
    longer than a masked block): here 1 x 1, 2 x 2, 7 x 7, 37 x 37 and an odd rest, which the
    fused ops are called on directly, without the shape checks of torch's public SDPA."""
    doc_BS = _packed_doc_ids(2, 301, ends=(1, 2, 4, 11, 48), padding=5)  # documents of 1, 1, 2, 7, 37, the rest
    grads = _packed_grads_match_float64(_kernel(name), causal, torch.bfloat16, 301, doc_BS, padding=5)
    assert all(g.isfinite().all() for g in grads)
