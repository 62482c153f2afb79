"""The fused kernels (train/fused.py: liger-kernel's RMSNorm, RoPE, SwiGLU and fused linear
cross-entropy) against the eager path they replace, on CUDA in bf16, forward and backward; and
a whole model with every fused op against the eager model.

Errors are relative to the reference's largest magnitude. The eager ops compute in fp32 and
round once; the kernels do too, but may round an intermediate to bf16 where the eager path
does not, so they agree to a few bf16 steps (bf16 rounds at 2^-8 ~ 4e-3), not bit for bit. A
kernel computing the wrong thing (a sign, a missing weight, a wrong half) errs by O(1).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from ringtrain.topology import CPLayout
from ringtrain.train import fused as ops
from ringtrain.train.attention import build_attention
from ringtrain.train.fused import FusedOps
from ringtrain.train.model import MemorySavers, ModelArgs, Transformer
from ringtrain.train.rope import build_rope

from .support import MARKS, missing

pytestmark = MARKS

EAGER, FUSED = FusedOps(), FusedOps(kernels=True, projections=True)
BF16_STEPS = 4e-3 * 4


@pytest.fixture(autouse=True)
def _liger() -> None:
    if ops.liger_ops() is None:
        missing("liger-kernel is not importable here (pip install liger-kernel)")


def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.float(), ref.float()
    return float((x - ref).abs().max() / ref.abs().max().clamp_min(1e-12))


def _both(fn: Callable[[FusedOps, list[torch.Tensor]], tuple[torch.Tensor, ...]], inputs: list[torch.Tensor],
          grads_out: list[torch.Tensor]) -> dict[str, list[torch.Tensor]]:
    """Outputs and input gradients of ``fn`` on the eager path and the fused one."""
    results = {}
    for name, fused in (("eager", EAGER), ("fused", FUSED)):
        leaves = [x.detach().clone().requires_grad_() for x in inputs]
        outs = fn(fused, leaves)
        torch.autograd.backward(outs, grads_out)
        results[name] = [*(o.detach() for o in outs), *(x.grad for x in leaves)]
    return results


def _assert_close(results: dict[str, list[torch.Tensor]], bound: float = BF16_STEPS) -> None:
    for i, (got, want) in enumerate(zip(results["fused"], results["eager"])):
        assert got.shape == want.shape and got.dtype == want.dtype, i
        assert _rel(got, want) <= bound, f"result {i}: {_rel(got, want):.2e} > {bound:.0e}"


def _randn(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.randn(shape, device="cuda", dtype=dtype)


@pytest.mark.parametrize("shape", [(2, 1024, 2048), (2, 1024, 8, 128)], ids=["hidden", "per-head"])
@pytest.mark.parametrize("style", ["llama", "gemma"])
def test_rms_norm(shape: tuple[int, ...], style: str) -> None:
    """Llama's norm, and Gemma's (1 + w) in fp32 throughout (liger's offset 1 and gemma casting)."""
    x, w, dy = _randn(*shape), 0.1 * _randn(shape[-1]) + (1 if style == "llama" else 0), _randn(*shape)
    _assert_close(_both(lambda f, t: (ops.rms_norm(t[0], t[1], 1e-6, f, style=style),), [x, w], [dy]))


@pytest.mark.parametrize("head_dim", [64, 128])
def test_rotary(head_dim: int) -> None:
    positions = torch.arange(2048, device="cuda").expand(2, -1) * 3  # positions past the sequence, as a zigzag shard holds
    cos, sin = build_rope(head_dim, 1e6).cos_sin(positions)
    q, k = _randn(2, 2048, 16, head_dim), _randn(2, 2048, 4, head_dim)
    dq, dk = _randn(*q.shape), _randn(*k.shape)
    _assert_close(_both(lambda f, t: ops.apply_rotary(t[0], t[1], cos, sin, f), [q, k], [dq, dk]))


def test_swiglu() -> None:
    gate, up, dy = _randn(2, 1024, 5632), _randn(2, 1024, 5632), _randn(2, 1024, 5632)
    _assert_close(_both(lambda f, t: (ops.swiglu(t[0], t[1], f),), [gate, up], [dy]))


def test_geglu() -> None:
    """Gemma's gated MLP: gelu_pytorch_tanh(gate) * up."""
    gate, up, dy = _randn(2, 1024, 6912), _randn(2, 1024, 6912), _randn(2, 1024, 6912)
    _assert_close(_both(lambda f, t: (ops.geglu(t[0], t[1], f),), [gate, up], [dy]))


@pytest.mark.parametrize("vocab", [32000, 151936])
def test_fused_linear_cross_entropy(vocab: int) -> None:
    hidden, weight = _randn(4096, 1024), 0.02 * _randn(vocab, 1024)
    labels = torch.randint(0, vocab, (4096,), device="cuda")
    labels[::7] = -100  # ignored tokens contribute nothing

    def loss(fused: FusedOps, t: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        got = ops.cross_entropy_sum(t[0], t[1], labels, fused)
        if got is None:  # the eager reference: whole logits in fp32
            logits = torch.nn.functional.linear(t[0], t[1]).float()
            got = torch.nn.functional.cross_entropy(logits, labels, ignore_index=-100, reduction="sum")
        return (got,)

    _assert_close(_both(loss, [hidden, weight], [torch.tensor(1.0, device="cuda")]), bound=1e-2)


QWEN3_LIKE = ModelArgs(vocab_size=4096, dim=512, n_layers=2, n_heads=8, n_kv_heads=4, head_dim=128, ffn_dim=1536,
                       norm_eps=1e-6, rope_theta=1e6, qk_norm=True, tie_embeddings=True)


@pytest.mark.parametrize("kernel", ["sdpa_cudnn", "sdpa_flash"])
def test_a_model_with_every_fused_op_trains_as_the_eager_model(kernel: str) -> None:
    attention = build_attention(CPLayout(1, 1), kernel, ring_group=None, ulysses_group=None)
    ids = torch.randint(0, QWEN3_LIKE.vocab_size, (1, 2048), device="cuda")
    positions = torch.arange(2048, device="cuda")[None]
    results = {}
    for name, fused in (("eager", EAGER), ("fused", FUSED)):
        torch.manual_seed(0)
        model = Transformer(QWEN3_LIKE, attention_fn=attention, savers=MemorySavers(), fused=fused, init_std=0.1)
        model = model.to(device="cuda", dtype=torch.bfloat16)
        loss = model(ids, positions, ids) / ids.numel()
        loss.backward()
        results[name] = [loss.detach(), *(p.grad for p in model.parameters())]
    # Per-op errors compound over the layers and into the weight gradients (sums over 2048
    # tokens of bf16 products): a few times an op's.
    _assert_close(results, bound=4 * BF16_STEPS)
