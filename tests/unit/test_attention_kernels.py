"""Block kernel rules that hold before any GPU is present: which kernel takes which head dim,
head-dim padding, square causal blocks, op signatures, GQA without K/V copies, and which kernel
a masked (packed-document) block runs on."""

from __future__ import annotations

import math
from typing import Any, Optional

import pytest
import torch

from ringtrain.train.attention import kernels, sdpa_kernels
from ringtrain.train.attention.block_kernel import BackwardInputs, BlockCall
from ringtrain.train.attention.blocks import Cut, block_backward, block_forward
from ringtrain.train.attention.documents import doc_visibility
from ringtrain.train.attention.kernels import (
    KERNEL_OPS,
    MATH,
    AttentionKernel,
    CpuFlashKernel,
    KernelUnavailableError,
    MathKernel,
    SdpaCudnnKernel,
    SdpaEfficientKernel,
    SdpaFlashKernel,
    available_kernels,
    kernel_ops_fit,
    sdpa_takes_gqa,
    select_kernel,
)
from ringtrain.train.attention.sdpa_kernels import mask_as_bias

Tensor = torch.Tensor
CUDA_ALL = frozenset({"flash_attn", "sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "math"})


def _qkvd(
    heads: int = 4,
    kv_heads: int = 2,
    q_len: int = 6,
    k_len: int = 6,
    head_dim: int = 8,
    dtype: torch.dtype = torch.float64,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    gen = torch.Generator().manual_seed(0)
    q_shape, kv_shape = (2, q_len, heads, head_dim), (2, k_len, kv_heads, head_dim)
    q, k, v, dout = (torch.randn(s, generator=gen, dtype=dtype) for s in (q_shape, kv_shape, kv_shape, q_shape))
    return q, k, v, dout


def _both_ways(
    kernel: AttentionKernel,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    dout: Tensor,
    *,
    causal: bool,
    visible: Optional[Tensor] = None,
) -> list[Tensor]:
    """Forward then backward: output, LSE, dq, dk, dv."""
    scale = q.shape[-1] ** -0.5
    res = kernel.forward(q, k, v, causal=causal, scale=scale, visible_BQS=visible)
    grads = kernel.backward(
        dout, q, k, v, res.out_BQHD, res.lse_BHQ, res.aux, causal=causal, scale=scale, visible_BQS=visible
    )
    return [res.out_BQHD, res.lse_BHQ, *grads]


# ------------------------------------------------------------------------ head dims (item 3)


@pytest.mark.parametrize(
    ("head_dim", "want"),
    [
        (40, "flash_attn"),
        (64, "flash_attn"),
        (128, "flash_attn"),
        (256, "flash_attn"),
        (260, "sdpa_efficient"),
        (36, "flash_attn"),
    ],
)
def test_auto_never_picks_a_kernel_that_cannot_take_the_head_dim(head_dim: int, want: str) -> None:
    # 36 is not a multiple of 8: the kernel pads it (see the padding test); 260 is past 256,
    # which no FlashAttention-2 or cuDNN kernel takes in both directions.
    got = select_kernel("auto", device_type="cuda", dtype=torch.bfloat16, available=CUDA_ALL, head_dim=head_dim)
    assert got == want


@pytest.mark.parametrize(
    ("head_dim", "want"),
    [
        (40, "sdpa_cudnn"),
        (64, "sdpa_cudnn"),
        (128, "sdpa_cudnn"),
        (256, "sdpa_efficient"),
        (260, "sdpa_efficient"),
        (36, "sdpa_cudnn"),
    ],
)
def test_auto_without_flash_skips_cudnn_past_its_head_dim(head_dim: int, want: str) -> None:
    available = CUDA_ALL - {"flash_attn", "sdpa_flash"}
    got = select_kernel("auto", device_type="cuda", dtype=torch.bfloat16, available=available, head_dim=head_dim)
    assert got == want


@pytest.mark.parametrize(
    ("name", "head_dim", "limit"), [("flash_attn", 260, 256), ("sdpa_flash", 264, 256), ("sdpa_cudnn", 256, 128)]
)
def test_an_explicit_kernel_refuses_a_head_dim_past_its_limit(name: str, head_dim: int, limit: int) -> None:
    with pytest.raises(KernelUnavailableError, match=f"head dims up to {limit}, not {head_dim}"):
        select_kernel(name, device_type="cuda", dtype=torch.bfloat16, available=CUDA_ALL, head_dim=head_dim)


def test_no_kernel_left_names_the_head_dim() -> None:
    with pytest.raises(KernelUnavailableError, match="head dim 512"):
        select_kernel("auto", device_type="cuda", dtype=torch.bfloat16, available={"flash_attn"}, head_dim=512)


def test_resolving_a_name_passes_the_inputs_head_dim(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, Any] = {}

    def fake_get_kernel(name: str, **kwargs: Any) -> AttentionKernel:
        seen.update(kwargs, name=name)
        return MATH

    monkeypatch.setattr(kernels, "get_kernel", fake_get_kernel)
    kernels.resolve_kernel("auto", torch.zeros(1, 4, 2, 36))
    assert seen == {"name": "auto", "device_type": "cpu", "dtype": torch.float32, "head_dim": 36}


class _NeedsMultipleOf8(MathKernel):
    """Stands in for a fused op that rejects D % 8 != 0 (flash-attn's ``mha_fwd``/``mha_bwd``)."""

    name = "needs8"
    supports_mask = False
    pad_head_dim_to = 8

    def _op_forward(self, q: Tensor, k: Tensor, v: Tensor, call: BlockCall) -> tuple[Tensor, Tensor, Any]:
        assert q.shape[-1] % 8 == 0 and k.shape[-1] % 8 == 0 and v.shape[-1] % 8 == 0, "head dim not padded"
        return super()._op_forward(q, k, v, call)

    def _op_backward(self, inputs: BackwardInputs, aux: Any, call: BlockCall) -> Any:
        assert all(t.shape[-1] % 8 == 0 for t in inputs[:5]), "head dim not padded"
        return super()._op_backward(inputs, aux, call)


@pytest.mark.parametrize("head_dim", [36, 40, 3])
@pytest.mark.parametrize("causal", [True, False])
def test_a_kernel_that_needs_padding_gets_it_and_gives_unpadded_results(head_dim: int, causal: bool) -> None:
    q, k, v, dout = _qkvd(head_dim=head_dim)
    got = _both_ways(_NeedsMultipleOf8(), q, k, v, dout, causal=causal)
    want = _both_ways(MATH, q, k, v, dout, causal=causal)
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape
        torch.testing.assert_close(g, w, atol=1e-12, rtol=0)


# --------------------------------------------------------------- square causal blocks (item 7)


@pytest.mark.parametrize("kernel", [MATH, CpuFlashKernel()], ids=["math", "cpu_flash"])
def test_causal_needs_a_square_block(kernel: AttentionKernel) -> None:
    q, k, v, dout = _qkvd(q_len=4, k_len=6)
    with pytest.raises(ValueError, match="causal attention needs a square block, got 4 queries and 6 keys"):
        kernel.forward(q, k, v, causal=True, scale=0.3)
    res = kernel.forward(q, k, v, causal=False, scale=0.3)  # a non-causal one is fine
    with pytest.raises(ValueError, match="square block"):
        kernel.backward(dout, q, k, v, res.out_BQHD, res.lse_BHQ, res.aux, causal=True, scale=0.3)


# -------------------------------------------------------------------- op signatures (item 8)


# torch 2.4's cuDNN ops: no attn_bias, no compute_log_sumexp.
TORCH_24_CUDNN = {
    "_scaled_dot_product_cudnn_attention": "aten::_scaled_dot_product_cudnn_attention(Tensor query, Tensor key, "
    "Tensor value, float dropout_p=0.0, bool is_causal=False, bool return_debug_mask=False, *, float? scale=None) -> "
    "(Tensor output, Tensor logsumexp, Tensor cum_seq_q, Tensor cum_seq_k, SymInt max_q, SymInt max_k, "
    "Tensor philox_seed, Tensor philox_offset, Tensor debug_attn_mask)",
    "_scaled_dot_product_cudnn_attention_backward": "aten::_scaled_dot_product_cudnn_attention_backward("
    "Tensor grad_out, Tensor query, Tensor key, Tensor value, Tensor out, Tensor logsumexp, Tensor philox_seed, Tensor philox_offset, "
    "Tensor cum_seq_q, Tensor cum_seq_k, SymInt max_q, SymInt max_k, float dropout_p, bool is_causal, *, "
    "float? scale=None) -> (Tensor, Tensor, Tensor)",
}


@pytest.mark.parametrize("name", sorted(KERNEL_OPS))
def test_the_installed_torch_has_the_op_signatures_the_kernels_call(name: str) -> None:
    assert kernel_ops_fit(name)


def test_an_op_with_another_signature_or_none_is_not_offered() -> None:
    def torch_24(op: str) -> Optional[Any]:
        text = TORCH_24_CUDNN.get(op)
        return torch._C.parse_schema(text) if text is not None else kernels.aten_schema(op)

    assert not kernel_ops_fit("sdpa_cudnn", torch_24)
    assert kernel_ops_fit("sdpa_flash", torch_24)  # unchanged there
    assert not kernel_ops_fit("cpu_flash", lambda op: None)


def test_cpu_flash_is_offered_here() -> None:
    assert "cpu_flash" in available_kernels("cpu")


# ----------------------------------------------------------------- GQA without copies (item 9)


def test_torch_routes_gqa_to_its_fused_ops_from_the_enable_gqa_release() -> None:
    assert sdpa_takes_gqa()  # torch >= 2.5 here
    before = torch._C.parse_schema(
        "aten::scaled_dot_product_attention(Tensor query, Tensor key, Tensor value, Tensor? attn_mask=None, "
        "float dropout_p=0.0, bool is_causal=False, *, float? scale=None) -> Tensor"
    )
    assert not sdpa_takes_gqa(lambda op: before)
    assert not sdpa_takes_gqa(lambda op: None)


def test_which_kernels_take_kv_heads_as_they_are() -> None:
    assert SdpaFlashKernel().native_gqa and SdpaCudnnKernel().native_gqa
    assert not SdpaEfficientKernel().native_gqa  # equal head counts only
    assert MathKernel().native_gqa and CpuFlashKernel().native_gqa


class _Spy(MathKernel):
    """Records the K/V head count its op is handed; can hand back per-query-head gradients."""

    name = "spy"

    def __init__(self, *, native_gqa: bool, expanded_grads: bool = False) -> None:
        super().__init__(native_gqa=native_gqa)
        self.expanded_grads = expanded_grads
        self.kv_heads_seen: list[int] = []

    def _op_forward(self, q: Tensor, k: Tensor, v: Tensor, call: BlockCall) -> tuple[Tensor, Tensor, Any]:
        self.kv_heads_seen.append(k.shape[2])
        return super()._op_forward(q, k, v, call)

    def _op_backward(self, inputs: BackwardInputs, aux: Any, call: BlockCall) -> Any:
        self.kv_heads_seen.append(inputs.k.shape[2])
        if self.expanded_grads:
            groups = inputs.q.shape[2] // inputs.k.shape[2]
            inputs = inputs._replace(k=inputs.k.repeat_interleave(groups, dim=2),
                                     v=inputs.v.repeat_interleave(groups, dim=2))
        return super()._op_backward(inputs, aux, call)


@pytest.mark.parametrize(
    ("native", "expanded_grads", "heads_seen"), [(True, False, 2), (False, False, 8), (True, True, 2)]
)
def test_kv_heads_are_repeated_only_for_a_kernel_without_gqa(
    native: bool, expanded_grads: bool, heads_seen: int
) -> None:
    q, k, v, dout = _qkvd(heads=8, kv_heads=2)
    spy = _Spy(native_gqa=native, expanded_grads=expanded_grads)
    got = _both_ways(spy, q, k, v, dout, causal=True)
    assert spy.kv_heads_seen == [heads_seen, heads_seen]
    for g, w in zip(got, _both_ways(MATH, q, k, v, dout, causal=True), strict=True):
        assert g.shape == w.shape  # K/V gradients come back with K heads either way
        torch.testing.assert_close(g, w, atol=1e-12, rtol=0)


@pytest.mark.parametrize("kernel_cls", [CpuFlashKernel, MathKernel])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_native_gqa_equals_the_repeat_path_on_cpu(
    kernel_cls: type[AttentionKernel], masked: bool, dtype: torch.dtype
) -> None:
    q, k, v, dout = _qkvd(heads=6, kv_heads=2, dtype=dtype)
    visible = torch.rand(2, 6, 6, generator=torch.Generator().manual_seed(1)) > 0.4 if masked else None
    causal = not masked
    native = _both_ways(kernel_cls(native_gqa=True), q, k, v, dout, causal=causal, visible=visible)
    repeat = _both_ways(kernel_cls(native_gqa=False), q, k, v, dout, causal=causal, visible=visible)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    for n, r in zip(native, repeat, strict=True):
        assert n.shape == r.shape
        torch.testing.assert_close(n, r, atol=tol, rtol=0)


# ------------------------------------------------- packed documents


def test_a_block_cut_by_documents_runs_a_maskless_kernel_as_math_runs_the_mask() -> None:
    """Packed documents reach no kernel as a mask: each document's rectangle runs unmasked (on a
    kernel that takes none), and the whole equals math under the documents' mask."""
    q, k, v, dout = _qkvd()
    doc_BS = torch.tensor([[0, 0, 0, 1, 1, -1], [0, 1, 1, 1, 2, 2]])
    scale = q.shape[-1] ** -0.5
    kw = dict(causal=True, scale=scale, cut=Cut(doc_BS.numpy(), doc_BS.numpy()))
    got = block_forward(_NeedsMultipleOf8(), q, k, v, **kw)
    want = MATH.forward(q, k, v, causal=True, scale=scale, visible_BQS=doc_visibility(doc_BS, doc_BS))
    torch.testing.assert_close(got.out_BQHD, want.out_BQHD, atol=1e-12, rtol=0)
    torch.testing.assert_close(got.lse_BHQ, want.lse_BHQ, atol=1e-12, rtol=0)
    grads = block_backward(_NeedsMultipleOf8(), dout, q, k, v, got.out_BQHD, got.lse_BHQ, got.aux, **kw)
    ref = MATH.backward(dout, q, k, v, want.out_BQHD, want.lse_BHQ, None, causal=True, scale=scale,
                        visible_BQS=doc_visibility(doc_BS, doc_BS))
    for g, r in zip(grads, ref, strict=True):
        torch.testing.assert_close(g, r, atol=1e-12, rtol=0)
    assert grads[0][0, -1].abs().max() == 0  # the padding token's query gets nothing


@pytest.mark.parametrize(("q_len", "k_len", "causal"), [(6, 6, True), (4, 37, False), (5, 16, False)])
def test_the_efficient_kernels_bias_is_the_mask_with_aligned_strides(q_len: int, k_len: int, causal: bool) -> None:
    # What the efficient op is handed for a masked block; built on CPU since the op is CUDA-only.
    gen = torch.Generator().manual_seed(2)
    q_BHQD, k_BHSD = torch.zeros(2, 6, q_len, 8, dtype=torch.bfloat16), torch.zeros(2, 6, k_len, 8)
    visible_BQS = torch.rand(2, q_len, k_len, generator=gen) > 0.3
    bias, is_causal = mask_as_bias(
        q_BHQD, k_BHSD, BlockCall(causal, 0.1, visible_BQS), align=SdpaEfficientKernel.bias_align, expand_heads=True
    )
    assert bias is not None and not is_causal and bias.dtype == torch.bfloat16
    assert bias.shape == (2, 6, q_len, k_len) and bias.stride(1) == 0 and bias.stride(-1) == 1
    assert all(s % 16 == 0 for s in bias.stride()[:-1])
    allowed = visible_BQS & torch.ones(q_len, k_len, dtype=torch.bool).tril() if causal else visible_BQS
    want = torch.zeros(allowed.shape, dtype=torch.bfloat16).masked_fill(~allowed, -math.inf)
    assert torch.equal(bias, want[:, None].expand(-1, 6, -1, -1))
    unmasked, unmasked_causal = mask_as_bias(q_BHQD, k_BHSD, BlockCall(causal, 0.1, None), align=16)
    assert unmasked is None and unmasked_causal == causal


def _fake_efficient_ops(monkeypatch: pytest.MonkeyPatch) -> list[Tensor]:
    """CPU stand-ins for the CUDA-only efficient ops (same signatures, the LSE padded to 32
    rows and the output laid out [B, Q, H, D] as the CUTLASS kernel does), so the kernel's
    plumbing runs here; returns the biases they were handed. The backward holds its ``out`` to
    the forward's layout: the CUTLASS backward takes q, k, v and dout's strides from the tensors
    but reads ``out`` as [B, Q, H, D]-contiguous whatever its strides (an out laid out otherwise
    is read out of bounds on the GPU: NaN gradients or an illegal memory access)."""
    seen: list[Tensor] = []

    def scores(q: Tensor, k: Tensor, bias: Optional[Tensor], is_causal: bool, scale: float) -> Tensor:
        assert not is_causal or bias is None  # the causal mask travels inside the bias
        s = q @ k.transpose(-1, -2) * scale
        if is_causal:
            s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool).tril(), -math.inf)
        if bias is not None:
            assert all(stride % 16 == 0 for stride in bias.stride()[:-1]), "bias strides not aligned"
            seen.append(bias)
            s = s + bias
        return s

    def forward(q: Tensor, k: Tensor, v: Tensor, bias: Optional[Tensor], lse_wanted: bool, p: float,
                is_causal: bool, *, scale: float) -> tuple[Tensor, ...]:
        assert lse_wanted and q.shape[1] == k.shape[1]  # heads already expanded: no native GQA
        s = scores(q, k, bias, is_causal, scale)
        lse = torch.logsumexp(s, dim=-1)
        out_BHQD = torch.nan_to_num(torch.softmax(s, dim=-1)) @ v
        out = out_BHQD.transpose(1, 2).contiguous().transpose(1, 2)
        padded = torch.nn.functional.pad(lse, (0, -lse.shape[-1] % 32))
        return out, padded, torch.tensor(0), torch.tensor(0)

    def backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, bias: Optional[Tensor], out: Tensor, lse: Tensor,
                 seed: Tensor, offset: Tensor, p: float, grad_mask: list[bool], is_causal: bool, *,
                 scale: float) -> tuple[Tensor, ...]:
        assert lse.shape[-1] % 32 == 0 and grad_mask == [True, True, True, False]
        assert out.transpose(1, 2).is_contiguous(), f"out strides {out.stride()}: not [B, Q, H, D]-contiguous"
        s = scores(q, k, bias, is_causal, scale)
        prob = torch.exp(s - lse[..., : q.shape[2], None])
        dv = prob.transpose(-1, -2) @ dout
        ds = prob * (dout @ v.transpose(-1, -2) - (dout * out).sum(-1, keepdim=True)) * scale
        return ds @ k, ds.transpose(-1, -2) @ q, dv, torch.empty(0)

    class Aten:
        _scaled_dot_product_efficient_attention = staticmethod(forward)
        _scaled_dot_product_efficient_attention_backward = staticmethod(backward)

    monkeypatch.setattr(sdpa_kernels, "aten", Aten)
    return seen


@pytest.mark.parametrize(("q_len", "k_len", "causal"), [(6, 6, True), (6, 6, False), (4, 37, False)])
def test_the_efficient_kernels_masked_path_equals_math(
    monkeypatch: pytest.MonkeyPatch, q_len: int, k_len: int, causal: bool
) -> None:
    biases = _fake_efficient_ops(monkeypatch)
    q, k, v, dout = _qkvd(heads=4, kv_heads=2, q_len=q_len, k_len=k_len, head_dim=12)
    doc = torch.tensor([[0] * 2 + [1] * 30 + [2] * 3 + [-1] * 2, [3] * 20 + [4] * 17])
    visible = doc_visibility(doc[:, :q_len], doc[:, :k_len])
    got = _both_ways(SdpaEfficientKernel(), q, k, v, dout, causal=causal, visible=visible)
    want = _both_ways(MATH, q, k, v, dout, causal=causal, visible=visible)
    assert len(biases) == 2  # forward and backward both got the mask
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape
        torch.testing.assert_close(g, w, atol=1e-12, rtol=0)


def test_a_masked_blocks_output_keeps_the_ops_layout(monkeypatch: pytest.MonkeyPatch) -> None:
    # Rows that see no key (the padding token, doc -1) get their output zeroed after the op; the
    # zeroing keeps the op's [B, Q, H, D] layout, so the output comes back contiguous and goes
    # to the op's backward as its forward laid it out, with no copy on either side.
    _fake_efficient_ops(monkeypatch)
    q, k, v, _ = _qkvd(heads=4, kv_heads=4, q_len=6, k_len=6, head_dim=16)
    doc = torch.tensor([[0, 0, 1, 1, 1, -1], [2, 2, 2, 3, 3, 3]])
    visible = doc_visibility(doc, doc)
    res = SdpaEfficientKernel().forward(q, k, v, causal=True, scale=0.25, visible_BQS=visible)
    assert res.out_BQHD.is_contiguous() and res.out_BQHD[0, -1].abs().max() == 0
    assert torch.isinf(res.lse_BHQ[0, :, -1]).all()


HOPPER_CASES = [
    (64, torch.bfloat16, CUDA_ALL, "sdpa_cudnn"),
    (128, torch.float16, CUDA_ALL, "sdpa_cudnn"),
    (40, torch.bfloat16, CUDA_ALL, "sdpa_cudnn"),  # padded to 48 for cuDNN
    (256, torch.bfloat16, CUDA_ALL, "flash_attn"),  # past cuDNN's backward
    (256, torch.bfloat16, CUDA_ALL - {"flash_attn"}, "sdpa_flash"),
    (128, torch.bfloat16, CUDA_ALL - {"sdpa_cudnn"}, "flash_attn"),  # a cuDNN older than 9
    (128, torch.float32, CUDA_ALL, "sdpa_efficient"),
]


@pytest.mark.parametrize(("head_dim", "dtype", "available", "want"), HOPPER_CASES)
@pytest.mark.parametrize("capability", [(9, 0), (10, 0)], ids=["hopper", "blackwell"])
def test_auto_prefers_cudnn_from_hopper_on(
    head_dim: int, dtype: torch.dtype, available: frozenset, want: str, capability: tuple[int, int]
) -> None:
    got = select_kernel("auto", device_type="cuda", dtype=dtype, available=available, head_dim=head_dim,
                        capability=capability)
    assert got == want


@pytest.mark.parametrize("capability", [(8, 0), (8, 9), None], ids=["ampere", "ada", "unknown"])
def test_auto_keeps_flash_attention_first_before_hopper(capability: "tuple[int, int] | None") -> None:
    got = select_kernel("auto", device_type="cuda", dtype=torch.bfloat16, available=CUDA_ALL, head_dim=128,
                        capability=capability)
    assert got == "flash_attn"


# ------------------------------------------------- flash-attn's causal alignment (its release)


@pytest.mark.parametrize(("version", "offered"), [("2.0.9", False), ("2.1.0", True), ("2.8.3.post2", True),
                                                  ("nightly", False)])
def test_flash_attn_is_offered_only_where_it_aligns_a_wide_causal_block_bottom_right(
    monkeypatch: pytest.MonkeyPatch, version: str, offered: bool
) -> None:
    import sys
    import types

    from ringtrain.train.attention import flash_attn_kernel

    package = types.ModuleType("flash_attn")
    package.__version__ = version  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "flash_attn", package)
    interface = "flash_attn.flash_attn_interface"
    monkeypatch.setitem(sys.modules, interface, types.ModuleType(interface))
    assert flash_attn_kernel._flash_attn_importable() is offered
