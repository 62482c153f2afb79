"""The zigzag ring on CUDA with every block kernel: a ring of N emulated on one device (each rank
a thread running the real ring code, see ``ring_emulation``) against the same kernel over the
whole sequence and against the fp32 math reference, forward and backward.

The ring's blocks are what a single call never sees: half blocks (non-causal, strided slices of
the local shard), LSE merges in fp32, and backward calls against the *merged* output and LSE, so
a kernel whose LSE is not the true one, or which mishandles a block's layout, shows here and not
in the kernel's own tests. bf16, B=2, GQA (8 query heads over 2 K/V heads), head dims 64, 128
and 40 (not a power of two).

Errors are relative to the reference's largest magnitude. bf16 rounds at about 4e-3; the ring
rounds each block's output and gradients once more before merging them in fp32, so its error
may be up to twice the monolithic kernel's, and it is held to that (or to a floor a few bf16
steps wide); a wrong block or LSE errs by 1e-1 or more.
"""

from __future__ import annotations

import math

import pytest
import torch

from ringtrain.train.attention.kernels import MATH, AttentionKernel, default_scale, get_kernel
from ringtrain_dev.emulated_cp import emulated_ring

from .support import CUDA_KERNELS, MARKS, cuda_kernel

pytestmark = MARKS

BATCH, HEADS, KV_HEADS = 2, 8, 2
# (ring size, full sequence): 768 over 4 ranks makes 96-token zigzag chunks, not a multiple of
# any kernel's tile, so the kernels' edge handling takes part.
RINGS = [(2, 1024), (4, 768)]
FLOOR = {"out": 1e-2, "dq": 3e-2, "dk": 3e-2, "dv": 3e-2}


def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.float(), ref.float()
    return float((x - ref).abs().max() / ref.abs().max().clamp_min(1e-12))


def _inputs(seq: int, head_dim: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator(device="cuda").manual_seed(seq * 1000 + head_dim)
    shapes = [(BATCH, seq, HEADS, head_dim), (BATCH, seq, KV_HEADS, head_dim), (BATCH, seq, KV_HEADS, head_dim),
              (BATCH, seq, HEADS, head_dim)]
    return tuple(torch.randn(s, generator=gen, device="cuda", dtype=torch.bfloat16) for s in shapes)


def _monolithic(kernel: AttentionKernel, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor,
                *, causal: bool, scale: float) -> dict[str, torch.Tensor]:
    fwd = kernel.forward(q, k, v, causal=causal, scale=scale)
    dq, dk, dv = kernel.backward(dout, q, k, v, fwd.out_BQHD, fwd.lse_BHQ, fwd.aux, causal=causal, scale=scale)
    return {"out": fwd.out_BQHD, "dq": dq, "dk": dk, "dv": dv}


@pytest.mark.parametrize("name", CUDA_KERNELS)
@pytest.mark.parametrize("head_dim", [64, 128, 40])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize(("world", "seq"), RINGS, ids=[f"ring{w}" for w, _ in RINGS])
@pytest.mark.parametrize("kv_exchange", ["ring", "allgather"])
def test_emulated_ring_matches_monolithic_and_math(
    name: str, head_dim: int, causal: bool, world: int, seq: int, kv_exchange: str
) -> None:
    kernel = cuda_kernel(name, head_dim=head_dim)
    q, k, v, dout = _inputs(seq, head_dim)
    scale = default_scale(head_dim)
    ring = emulated_ring(q, k, v, dout, world=world, kernel=kernel, causal=causal, scale=scale,
                         kv_exchange=kv_exchange)
    got = {"out": ring.out_BSHD, "dq": ring.dq_BSHD, "dk": ring.dk_BSKD, "dv": ring.dv_BSKD}
    mono = _monolithic(kernel, q, k, v, dout, causal=causal, scale=scale)
    # The reference: fp32 math on the same (bf16-rounded) inputs.
    ref = _monolithic(MATH, *(t.float() for t in (q, k, v, dout)), causal=causal, scale=scale)

    for quantity in ("out", "dq", "dk", "dv"):
        assert got[quantity].dtype == torch.bfloat16, f"{quantity} came back as {got[quantity].dtype}"
        assert got[quantity].shape == ref[quantity].shape, quantity
        assert torch.isfinite(got[quantity]).all(), f"{quantity} has non-finite values"
        ring_err, mono_err = _rel(got[quantity], ref[quantity]), _rel(mono[quantity], ref[quantity])
        bound = max(2 * mono_err, FLOOR[quantity])
        assert ring_err <= bound, (
            f"{quantity}: ring vs math {ring_err:.2e} > {bound:.2e} (monolithic {name} vs math {mono_err:.2e})"
        )
        # The ring and the kernel over the whole sequence, each within its bound of the reference.
        assert _rel(got[quantity], mono[quantity]) <= bound + max(mono_err, FLOOR[quantity]), quantity


@pytest.mark.parametrize("kv_exchange", ["ring", "allgather"])
def test_packed_documents_through_the_emulated_ring_match_math(kv_exchange: str) -> None:
    """Blocks cut at document boundaries on the fastest kernel, merged across the ring, against
    the fp32 math kernel over the whole sequence under the documents' mask."""
    from ringtrain.train.attention.documents import doc_visibility

    kernel = get_kernel("auto", device_type="cuda", dtype=torch.bfloat16, head_dim=128)  # the fastest here
    q, k, v, dout = _inputs(1024, 128)
    doc = torch.zeros(BATCH, 1024, dtype=torch.long, device="cuda")
    doc[:, 300:] = 1
    doc[:, 700:] = 2
    doc[1, -5:] = -1
    scale = default_scale(128)
    ring = emulated_ring(q, k, v, dout, world=4, kernel=kernel, causal=True, scale=scale, doc_ids_BS=doc,
                         kv_exchange=kv_exchange)
    visible = doc_visibility(doc, doc)
    ref = MATH.forward(*(t.float() for t in (q, k, v)), causal=True, scale=scale, visible_BQS=visible)
    ref_grads = MATH.backward(dout.float(), *(t.float() for t in (q, k, v)), ref.out_BQHD, ref.lse_BHQ, None,
                              causal=True, scale=scale, visible_BQS=visible)
    for got, want in zip((ring.out_BSHD, ring.dq_BSHD, ring.dk_BSKD, ring.dv_BSKD), (ref.out_BQHD, *ref_grads)):
        assert _rel(got, want) <= 3e-2, _rel(got, want)


def test_the_triton_merge_equals_the_torch_merge_on_cuda() -> None:
    """The compiled kernel of merge.merge_into_ on the rows of a strided view, empty rows included."""
    from ringtrain.train.attention import merge

    if merge._triton_merge() is None:
        pytest.fail("triton is not importable on this CUDA machine", pytrace=False)
    gen = torch.Generator(device="cuda").manual_seed(0)
    out = torch.randn(2, 512, 8, 128, generator=gen, device="cuda")
    lse = torch.randn(2, 8, 512, generator=gen, device="cuda")
    blk_out = torch.randn(2, 256, 8, 128, generator=gen, device="cuda", dtype=torch.bfloat16)
    blk_lse = torch.randn(2, 8, 256, generator=gen, device="cuda")
    blk_lse[:, :, :3] = -math.inf
    lse[:, :, 256:259] = -math.inf
    rows = slice(256, None)
    want_out, want_lse = merge.merge_partials(out[:, rows], lse[:, :, rows], blk_out, blk_lse)
    merge.merge_into_(out[:, rows], lse[:, :, rows], blk_out, blk_lse)
    torch.testing.assert_close(out[:, rows], want_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse[:, :, rows], want_lse, rtol=1e-5, atol=1e-5)
