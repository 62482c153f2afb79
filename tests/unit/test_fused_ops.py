"""The fused ops' CPU half (train/fused.py) and ``auto`` recomputation (planner/recompute.py).

- Fused projections (one GEMM over concatenated weights) give what the separate projections
  give, outputs and gradients, with and without biases; a whole model with them gives the
  eager model's loss and gradients (float64, so only summation order can differ).
- Fused kernels never run off CUDA: asked for on the CPU, the eager path runs, bit for bit.
- ``auto`` picks the least recomputation whose predicted peak fits, and the planner's estimate
  orders the modes as the ladder assumes.

The liger kernels themselves run only on CUDA: tests/gpu/test_fused_gpu.py holds them to the
eager path.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ringtrain import config
from ringtrain.planner.layout import layout_of, workload_of
from ringtrain.planner.memory import estimate
from ringtrain.planner.recompute import LADDER, Recompute, recompute_for, with_mode
from ringtrain.topology import CPLayout
from ringtrain.train import fused as ops
from ringtrain.train.attention import build_attention
from ringtrain.train.fused import FusedOps
from ringtrain.train.model import MemorySavers, ModelArgs, Transformer
from ringtrain.train.trainer import resolve_recompute

ARGS = ModelArgs(vocab_size=96, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, ffn_dim=40, norm_eps=1e-6,
                 rope_theta=10000.0, qkv_bias=True, qk_norm=True)


@pytest.mark.parametrize("bias", [False, True])
def test_fused_projections_equal_the_separate_ones(bias: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    linears = tuple(torch.nn.Linear(16, n, bias=bias).double() for n in (24, 8, 8))
    x = torch.randn(2, 5, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    grads_out = [torch.randn(2, 5, n, generator=gen, dtype=torch.float64) for n in (24, 8, 8)]

    results = {}
    for fused in (FusedOps(), FusedOps(projections=True)):
        for p in (x, *(q for linear in linears for q in linear.parameters())):
            p.grad = None
        outs = ops.projections(x, linears, fused)
        torch.autograd.backward(outs, grads_out)
        results[fused.projections] = [*outs, x.grad, *(q.grad for linear in linears for q in linear.parameters())]
    for got, want in zip(results[True], results[False]):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def _loss_and_grads(fused: FusedOps, savers: MemorySavers) -> list[torch.Tensor]:
    torch.manual_seed(0)
    attention = build_attention(CPLayout(1, 1), "math", ring_group=None, ulysses_group=None)
    model = Transformer(ARGS, attention_fn=attention, savers=savers, fused=fused, init_std=0.3).double()
    ids = torch.randint(0, ARGS.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(16).expand(2, -1)
    loss = model(ids, positions, ids)
    loss.backward()
    return [loss.detach(), *(p.grad for p in model.parameters())]


@pytest.mark.parametrize(
    "savers",
    [MemorySavers(), MemorySavers(checkpointing="selective"), MemorySavers(checkpointing="selective", recompute_layers=1),
     MemorySavers(checkpointing="full", recompute_layers=1)],
    ids=["plain", "selective", "selective-first-layer", "full-first-layer"],
)
def test_a_model_with_fused_projections_trains_as_the_eager_one(savers: MemorySavers) -> None:
    want = _loss_and_grads(FusedOps(), MemorySavers())
    got = _loss_and_grads(FusedOps(projections=True), savers)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)


def test_fused_kernels_asked_for_on_the_cpu_run_the_eager_ops_exactly() -> None:
    torch.manual_seed(0)
    x = torch.randn(2, 6, 4, 8)
    w = torch.randn(8)
    cos, sin = torch.randn(2, 6, 1, 4), torch.randn(2, 6, 1, 4)
    on, off = FusedOps(kernels=True), FusedOps()
    assert torch.equal(ops.rms_norm(x, w, 1e-6, on), ops.rms_norm(x, w, 1e-6, off))
    assert all(torch.equal(a, b) for a, b in zip(ops.apply_rotary(x, x[:, :, :2], cos, sin, on),
                                                  ops.apply_rotary(x, x[:, :, :2], cos, sin, off)))
    assert torch.equal(ops.swiglu(x, x.flip(0), on), ops.swiglu(x, x.flip(0), off))
    assert ops.cross_entropy_sum(x.flatten(0, 2), torch.randn(16, 8), torch.zeros(48, dtype=torch.long), on) is None


def _job(seq_len: int, mode: str = "auto") -> config.JobConfig:
    return config.load(None, [
        "model.vocab_size=32000", "model.dim=2048", "model.n_layers=22", "model.n_heads=32", "model.n_kv_heads=4",
        "model.ffn_dim=5632", f"data.seq_len={seq_len}", "train.global_batch=1", "train.micro_batch=1",
        "zero.stage=2", f"model.activation_checkpointing={mode}", "cluster.device=cuda",
    ])


def _peak(job: config.JobConfig, mode: str, layers: "int | None" = None) -> int:
    return estimate(workload_of(job, "cuda"), with_mode(layout_of(job), mode, layers)).total


def test_the_ladder_saves_memory_in_its_order() -> None:
    job = _job(32768)
    peaks = [_peak(job, mode) for mode in LADDER]
    assert peaks == sorted(peaks, reverse=True) and len(set(peaks)) == len(peaks), peaks


@pytest.mark.parametrize("mode", LADDER)
def test_auto_takes_the_least_recomputation_that_fits(mode: str) -> None:
    job = _job(32768)
    # A device just large enough for ``mode`` (with the planner's 10% headroom) and too small
    # for anything that recomputes less.
    memory = int(_peak(job, mode) / 0.9) + 1
    assert recompute_for(job, memory) == Recompute(mode)


def test_auto_recomputes_only_as_many_layers_as_it_must() -> None:
    """Between what selective recomputation of every layer needs and what none needs, the first
    layers recompute and the rest keep everything: the fewest that fit."""
    job = _job(32768)
    memory = int((_peak(job, "selective") + _peak(job, "none")) / 2 / 0.9)
    got = recompute_for(job, memory)
    assert got.mode == "selective" and got.layers is not None and 0 < got.layers < 22
    assert _peak(job, "selective", got.layers) <= memory * 0.9 < _peak(job, "selective", got.layers - 1)
    # Each layer that keeps everything costs what it saves by recomputing, one layer's worth.
    steps = {_peak(job, "selective", k) - _peak(job, "selective", k + 1) for k in range(1, 21)}
    assert len(steps) == 1 and steps.pop() > 0


def test_auto_falls_back_to_full_when_nothing_fits_and_an_explicit_mode_stands() -> None:
    assert recompute_for(_job(32768), 10**9) == Recompute("full")
    assert recompute_for(_job(32768, "selective"), 10**15) == Recompute("selective")


def test_auto_is_none_on_a_cpu() -> None:
    job = _job(32768)
    assert resolve_recompute(job, torch.device("cpu")) == Recompute("none")
    assert resolve_recompute(job, None) == Recompute("none")
    full = dataclasses.replace(job, model=dataclasses.replace(job.model, activation_checkpointing="full", recompute_layers=3))
    assert resolve_recompute(full, torch.device("cpu")) == Recompute("full", 3)


def test_the_planner_counts_what_the_fused_kernels_keep() -> None:
    """Per token and layer (bf16): each fused RMSNorm keeps its input, its output and an fp32
    rstd (2 p h + 4) where torch ops keep (4 + 2p) h; the fused SwiGLU three f-wide tensors, not
    four; the fused loss one chunk of logits, the hidden states' and the weight's gradients."""
    from ringtrain.planner.memory import layer_activation_bytes
    from ringtrain.planner.models import from_job
    from ringtrain.planner.savers import fused_loss_rows, loss_bytes

    job = _job(32768)
    model = from_job(job)
    h, kd, f, a, p, t = model.dim, model.kv_dim, model.ffn_dim, model.n_heads, 2, 1000
    attention = t * (p * (2 * h + 2 * kd) + 4 * a)
    assert layer_activation_bytes(model, t, 1, p) == attention + 2 * t * (4 + 2 * p) * h + t * 4 * p * f
    assert layer_activation_bytes(model, t, 1, p, fused=True) == attention + 2 * t * (2 * p * h + 4) + t * 3 * p * f
    # Qwen3's 151,936-entry vocabulary over a 2048-wide model: 75 rows of logits weigh one row
    # of hidden states, so 32K tokens go 512 at a time.
    assert fused_loss_rows(32768, 151936, 2048) == 512
    layout = layout_of(job)
    fused_loss, _ = loss_bytes(model, layout, 32768, p, fused=True)
    rows = fused_loss_rows(32768, model.vocab_size, h)
    assert rows == 2048  # TinyLlama's 32,000 entries: 16 rows of logits weigh one of hidden states
    assert fused_loss == rows * model.vocab_size * (8 + p) + 32768 * p * h + 4 * model.vocab_size * h
    assert fused_loss < loss_bytes(model, layout, 32768, p)[0] / 10


def test_the_first_recompute_layers_recompute_and_the_rest_keep_everything() -> None:
    attention = build_attention(CPLayout(1, 1), "math", ring_group=None, ulysses_group=None)
    args = dataclasses.replace(ARGS, n_layers=4)
    model = Transformer(args, attention_fn=attention, savers=MemorySavers(checkpointing="full", recompute_layers=3))
    assert [layer.checkpointing for layer in model.layers] == ["full", "full", "full", "none"]
    model = Transformer(args, attention_fn=attention, savers=MemorySavers(checkpointing="selective"))
    assert [layer.selective for layer in model.layers] == [True] * 4


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["model.recompute_layers=-1"], "must be >= 0"),
        (["model.n_layers=4", "model.recompute_layers=5"], "more than the model's model.n_layers=4"),
        (["model.activation_offload_layers=2", "model.recompute_layers=2"], "without activation offload"),
    ],
)
def test_recompute_layers_is_checked(overrides: list[str], message: str) -> None:
    from ringtrain.errors import ConfigError

    with pytest.raises(ConfigError, match=message) as info:
        config.load(None, ["model.activation_checkpointing=full", *overrides])
    assert "model.recompute_layers" in str(info.value)
