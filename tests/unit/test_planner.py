"""The planner against hand-derived numbers: model states per ZeRO stage, activations with and
without flash attention, traffic, FLOPs, the layout rules, and the `plan` command's contract."""

from __future__ import annotations

import argparse
import ast
import json
import sys
from pathlib import Path

import pytest

from ringtrain import config
from ringtrain.commands import plan as command
from ringtrain.planner.comm import ring_bytes, ulysses_bytes, zero_bytes
from ringtrain.planner.devices import H100, device
from ringtrain.planner.fit import fit_warning
from ringtrain.planner.layout import Layout, Workload, layout_of, precision, workload_of
from ringtrain.planner.memory import (
    activations,
    estimate,
    layer_activation_bytes,
    model_states,
    score_bytes,
    zero_buffers,
)
from ringtrain.planner.models import PRESETS, ModelSpec, from_job, kv_copies
from ringtrain.planner.search import TIE, Cluster, cluster_sizes, fewest_gpus, layouts, search
from ringtrain.planner.throughput import Assumptions, estimate_step, flops_per_token

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "jobs" / "quickstart.yaml"

# d = 64 / 4 = 16, KV width k d = 2 x 16 = 32.
SMALL = ModelSpec("small", vocab_size=1000, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=192)


# --- model shapes ---------------------------------------------------------------------------


def test_llama3_parameter_counts_follow_from_their_shapes() -> None:
    def llama(vocab: int, h: int, layers: int, kv: int, f: int) -> int:
        # two norm gains, wq and wo h x h, wk and wv h x kv, three SwiGLU matrices h x f
        layer = 2 * h + 2 * h * h + 2 * h * kv + 3 * h * f
        return 2 * vocab * h + layers * layer + h  # untied embedding and output, final norm

    assert PRESETS["llama3-8b"].num_params == llama(128256, 4096, 32, 1024, 14336) == 8_030_261_248
    assert PRESETS["llama3-70b"].num_params == llama(128256, 8192, 80, 1024, 28672) == 70_553_706_496
    assert PRESETS["llama3-405b"].num_params == llama(128256, 16384, 126, 1024, 53248) == 405_853_388_800


def test_the_quickstart_model_comes_from_its_job_file() -> None:
    model = from_job(config.load(QUICKSTART))
    # dim 128, 4 layers, 4 heads, 2 KV heads (KV width 64), SwiGLU 8/3 x 128 = 341 -> 352, 256 bytes
    layer = 2 * 128 + 2 * 128 * 128 + 2 * 128 * 64 + 3 * 128 * 352
    assert model.ffn_dim == 352
    assert model.num_params == 2 * 256 * 128 + 4 * layer + 128 == 803_968


# --- model states ---------------------------------------------------------------------------


def test_model_states_reproduce_the_zero_papers_figure_1() -> None:
    # Rajbhandari et al. 2020, Figure 1: a 7.5B model, K = 12, 64 data-parallel ranks:
    # 120 GB, 31.4 GB, 16.6 GB and 1.9 GB per device for stages 0-3.
    n, z, bf16 = 7_500_000_000, 64, precision("bf16", 1)
    states = {stage: model_states(n, stage, z, bf16) for stage in range(4)}
    assert states[0].total == (2 + 2 + 12) * n == 120_000_000_000
    assert states[1].total == (2 + 2) * n + 12 * n // z == 31_406_250_000
    assert states[2].total == 2 * n + (2 + 12) * n // z == 16_640_625_000
    assert states[3].total == (2 + 2 + 12) * n // z == 1_875_000_000
    assert (states[1].params, states[1].grads, states[1].optimizer) == (15_000_000_000, 15_000_000_000, 1_406_250_000)


def test_fp32_states_follow_deepspeed() -> None:
    # 4 B params and grads; the optimizer updates fp32 params in place at stage 0 (K = 8: m, v),
    # and keeps a cloned fp32 master partition at stages 1-3 (K = 12).
    n, z = 1000, 4
    assert precision("fp32", 0).optimizer_bytes == 8 and precision("fp32", 2).optimizer_bytes == 12
    got = {s: model_states(n, s, z, precision("fp32", s)) for s in range(4)}
    assert (got[0].params, got[0].grads, got[0].optimizer) == (4000, 4000, 8000)
    assert (got[1].params, got[1].grads, got[1].optimizer) == (4000, 4000, 3000)
    assert (got[2].params, got[2].grads, got[2].optimizer) == (4000, 1000, 3000)
    assert (got[3].params, got[3].grads, got[3].optimizer) == (1000, 1000, 3000)


def test_partitions_round_up_and_offload_moves_state_to_the_host() -> None:
    bf16 = precision("bf16", 2)
    assert model_states(10, 3, 4, bf16).params == 2 * 3  # ceil(10 / 4) elements per rank
    off = model_states(1000, 2, 4, bf16, offload_optimizer=True)
    assert off.optimizer == 0 and off.host == (12 + 4) * 250  # K and the fp32 gradient partition
    assert model_states(1000, 3, 4, bf16, offload_params=True).params == 0
    assert precision("bf16", 1, optimizer_bytes=16).optimizer_bytes == 16


def test_zero_buffers_at_deepspeed_defaults() -> None:
    bf16, defaults = precision("bf16", 1), config.ZeroConfig()
    assert zero_buffers(SMALL, SMALL.num_params, 0, bf16, defaults).resident == 0
    assert zero_buffers(SMALL, SMALL.num_params, 0, bf16, defaults).reduce_transient == 2 * SMALL.num_params
    assert zero_buffers(SMALL, SMALL.num_params, 2, bf16, defaults).reduce_bucket == 2 * 500_000_000
    big = zero_buffers(PRESETS["llama3-70b"], PRESETS["llama3-70b"].num_params, 3, bf16, defaults)
    norms = (2 * 80 + 1) * 8192  # at most 1e5 elements: kept whole on every rank
    embedding = 128256 * 8192  # the largest module, gathered whole
    assert big.stage3_params == 2 * (norms + embedding)


# --- activations ----------------------------------------------------------------------------


def test_layer_activations_by_hand() -> None:
    # Per token, bf16 (p = 2): two RMSNorms keep an fp32 input, a normalized and a scaled output,
    # 2 x (4 + 2 + 2) x 64 = 1024; RoPE'd q, k and v 2 x (64 + 32 + 32) = 256; attention
    # output 2 x 64 = 128; fp32 log-sum-exp 4 x 4 heads = 16; SwiGLU's w1, w3, silu and product
    # outputs 4 x 2 x 192 = 1536. Korthikanti's unfused GPT layer would add the a*s^2 softmax.
    assert layer_activation_bytes(SMALL, 100, 1, 2) == 100 * (1024 + 256 + 128 + 16 + 1536)
    # fp32 (p = 4): 2 x 12 x 64 + 4 x 128 + 4 x 64 + 16 + 16 x 192
    assert layer_activation_bytes(SMALL, 100, 1, 4) == 100 * (1536 + 512 + 256 + 16 + 3072)


def test_ulysses_keeps_gathered_heads_and_both_sides_of_the_output() -> None:
    base = layer_activation_bytes(SMALL, 100, 1, 2)
    # U = 2 divides the 2 KV heads: no copies, only the second output, 2 x 64 per token
    assert layer_activation_bytes(SMALL, 100, 2, 2) == base + 100 * 2 * 64
    # U = 4 > 2 KV heads: each replicated twice, k and v gain 2 x 32 per token each copy
    assert layer_activation_bytes(SMALL, 100, 4, 2) == base + 100 * 2 * (64 + 2 * 32)
    assert [kv_copies(k, u) for k, u in ((8, 8), (8, 16), (2, 4), (8, 4), (4, 6))] == [1, 2, 2, 1, 3]


def test_activation_peaks_with_and_without_flash_attention() -> None:
    layout = Layout(dp=1, ring=2, ulysses=1, zero_stage=0, checkpointing=False)
    t = 200  # 400 tokens over cp = 2
    kept = 2 * t * 2960  # two layers, 2960 bytes per token each (see above)
    final_norm, rotary = t * 8 * 64, 4 * t * 16
    loss = t * 1000 * 12  # fp32 log-softmax, its gradient, fp32 logits gradient (the logits are gone)
    flash = activations(SMALL, layout, 400, 2, flash=True)
    assert flash.kept == kept and flash.loss == loss
    assert flash.loss_peak == kept + final_norm + rotary + loss == 3_699_200
    # backward: no logits left referenced; SwiGLU backward holds t p (h + 2f)
    assert flash.backward_peak == kept + rotary + t * 2 * (64 + 2 * 192)
    assert flash.peak == 3_699_200

    # Unfused: 5 fp32 score matrices of the diagonal block, b (a/U) (U s)^2 = 4 x 200^2 elements,
    # while the last layer's attention runs its backward (its FFN half already freed).
    scores = 20 * 1 * 4 * 1 * 200 * 200
    assert score_bytes(SMALL, layout, 400) == scores == 3_200_000
    attention_work = t * ((4 + 4) * 64 + (16 + 12) * 32)
    ffn_half = t * ((4 + 4) * 64 + 4 * 2 * 192)
    unfused = activations(SMALL, layout, 400, 2, flash=False)
    assert unfused.backward_peak == kept + rotary + attention_work + scores - ffn_half
    assert unfused.peak == 4_268_800 > flash.peak


def test_checkpointing_keeps_only_layer_inputs() -> None:
    layout = Layout(dp=1, ring=2, ulysses=1, zero_stage=0, checkpointing=True)
    t = 200
    acts = activations(SMALL, layout, 400, 2, flash=True)
    assert acts.kept == 2 * t * 2 * 64
    assert acts.loss_peak == acts.kept + t * 8 * 64 + 4 * t * 16 + t * 1000 * 12
    # one layer recomputed in the backward
    assert acts.backward_peak == acts.kept + t * 2960 + 4 * t * 16 + t * 2 * (64 + 384)


def test_llama3_8b_at_128k_logits_dominate_activations() -> None:
    workload = Workload(PRESETS["llama3-8b"], 131072)
    est = estimate(workload, Layout(dp=1, ring=8, ulysses=1, zero_stage=3, checkpointing=True))
    t = 131072 // 8
    assert est.logits_and_loss == t * 128256 * 12
    assert est.kept_by_layers == 32 * t * 2 * 4096
    assert est.total == est.params + est.grads + est.optimizer + est.zero_buffers + est.activations


# --- communication and throughput -----------------------------------------------------------


def test_ring_and_ulysses_traffic() -> None:
    t, p = 100, 2
    ring4 = Layout(dp=1, ring=4, ulysses=1, zero_stage=0, checkpointing=False)
    kv, dkv = 2 * t * 32 * p, 2 * t * 32 * 4  # K and V blocks; fp32 dK and dV accumulators
    assert ring_bytes(SMALL, ring4, t, p) == (3 * kv, 3 * kv + 4 * dkv)
    ring4_ckpt = Layout(dp=1, ring=4, ulysses=1, zero_stage=0, checkpointing=True)
    assert ring_bytes(SMALL, ring4_ckpt, t, p)[0] == 2 * 3 * kv
    uly2 = Layout(dp=1, ring=1, ulysses=2, zero_stage=0, checkpointing=False)
    # q, k, v in and the output back, half of it leaving the rank, forward and backward
    forward = (t * p * (64 + 2 * 32) + t * p * 64) // 2
    assert ulysses_bytes(SMALL, uly2, t, p) == 2 * forward
    uly2_ckpt = Layout(dp=1, ring=1, ulysses=2, zero_stage=0, checkpointing=True)
    assert ulysses_bytes(SMALL, uly2_ckpt, t, p) == 3 * forward


def test_zero_traffic_per_stage() -> None:
    bf16 = precision("bf16", 1)
    share = 2 * 1000 * 3 // 4  # (Z - 1) / Z of 1000 bf16 elements, Z = 4

    def at(stage: int, ckpt: bool = False) -> tuple[int, int, int]:
        return zero_bytes(1000, Layout(dp=4, ring=1, ulysses=1, zero_stage=stage, checkpointing=ckpt), bf16)

    assert at(0) == (0, 2 * share, 0)  # all-reduce
    assert at(1) == (0, 2 * share, 0)  # reduce-scatter + all-gather per step
    assert at(2) == (share, share, 0)  # reduce-scatter per micro batch
    assert at(3) == (3 * share, 0, 2 * share)  # gather forward + backward, reduce-scatter
    assert at(3, ckpt=True) == (4 * share, 0, 3 * share)


def test_flops_per_token() -> None:
    model = PRESETS["llama3-8b"]
    matmul = 8_030_261_248 - 128256 * 4096 - (2 * 32 + 1) * 4096  # no embedding lookup, no norm gains
    assert model.num_matmul_params == matmul
    dense, attention = 6 * matmul, 6 * 32 * 4096 * 131072
    assert flops_per_token(model, 131072, checkpointing=False) == (dense + attention, dense + attention)
    assert flops_per_token(model, 131072, checkpointing=True)[1] == pytest.approx((dense + attention) * 8 / 6)


def test_step_time_of_one_gpu_is_compute() -> None:
    workload = Workload(SMALL, 400, global_batch=3)
    layout = Layout(dp=1, ring=1, ulysses=1, zero_stage=0, checkpointing=False)
    step = estimate_step(workload, layout, H100, Assumptions(mfu=0.5))
    per_token = 6 * SMALL.num_matmul_params + 6 * 2 * 64 * 400
    assert step.micro_batches == 3 and step.tokens_per_step == 1200
    assert step.compute_s == pytest.approx(1200 * per_token / (989e12 * 0.5))
    assert step.step_s == step.compute_s
    assert step.mfu == pytest.approx(0.5)


# --- search ---------------------------------------------------------------------------------


def test_layouts_obey_the_rules() -> None:
    workload = Workload(PRESETS["llama3-70b"], 131072, global_batch=32)
    found = list(layouts(workload, Cluster(H100, 64)))
    assert found
    for lay in found:
        assert lay.dp * lay.cp == 64
        assert 131072 % (2 * lay.cp) == 0
        assert 64 % lay.ulysses == 0 and lay.ulysses <= 8
        assert 32 % lay.dp == 0
        assert not (lay.offload_optimizer and lay.zero_stage == 0)
    assert any(lay.impl == "hybrid" for lay in found)
    odd_heads = ModelSpec("odd", 1000, 96, 2, 6, 2, 256)
    ulysses = {lay.ulysses for lay in layouts(Workload(odd_heads, 1200, global_batch=12), Cluster(H100, 12, 12))}
    assert ulysses == {1, 2, 3, 6}


def test_every_layout_round_trips_through_the_job_config() -> None:
    job = config.load(QUICKSTART, ["train.global_batch=8", "mesh.ulysses=2", "attention.impl=hybrid", "mesh.cp=4"])
    found = list(layouts(workload_of(job, "cuda"), Cluster(H100, 8)))
    assert {lay.impl for lay in found} == {"ring", "ulysses", "hybrid"}
    # every mesh, at both ends of the other knobs (loading a config costs milliseconds)
    ends = [lay for lay in found if (lay.zero_stage, lay.offload_optimizer) in ((0, False), (3, True))]
    # the saver rungs at one end only: each rung's keys are already covered by the other end's
    ends = [lay for lay in ends if lay.num_savers == 0 or lay.zero_stage == 3]
    for lay in ends:
        assert layout_of(config.replace(job, lay.overrides())) == lay


def test_ranking_puts_fitting_and_faster_first() -> None:
    ranked = search(Workload(PRESETS["llama3-8b"], 131072, global_batch=32), Cluster(H100, 64), Assumptions())
    fits = [c.fits for c in ranked]
    assert fits == sorted(fits, reverse=True) and fits[0]
    speeds = [c.step.tokens_per_s for c in ranked if c.fits]
    assert all(later <= earlier * TIE for earlier, later in zip(speeds, speeds[1:]))


def test_nothing_fits_names_the_fewest_gpus_that_would() -> None:
    # Without the long-context savers 1M tokens of Llama-3-8B need 32 H100s; with them 8 do.
    workload = Workload(PRESETS["llama3-8b"], 1048576, global_batch=4)
    cluster = Cluster(H100, 8)
    assert not any(c.fits for c in search(workload, cluster, Assumptions(), savers=False))
    best = fewest_gpus(workload, cluster, Assumptions(), savers=False)
    assert best is not None and best.fits
    sizes = cluster_sizes(8)
    smaller = [n for n in sizes if n < best.layout.world]
    assert best.layout.world == 32 and smaller == [1, 2, 4, 8, 16, 24]
    assert not any(
        c.fits for n in smaller for c in search(workload, cluster.with_gpus(n), Assumptions(), savers=False)
    )
    with_savers = search(workload, cluster, Assumptions())
    assert with_savers[0].fits and with_savers[0].layout.num_savers >= 1


# --- the command ----------------------------------------------------------------------------


def _run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="ringtrain")
    sub = parser.add_subparsers(dest="command", required=True)
    command.add_arguments(sub.add_parser("plan"))
    return command.run(parser.parse_args(["plan", *argv]))


def test_plan_prints_a_ranked_table_and_the_best_breakdown(capsys: pytest.CaptureFixture[str]) -> None:
    assert _run(["--model", "llama3-8b", "--seq-len", "131072", "--gpus", "64"]) == 0
    out = capsys.readouterr().out
    assert "layouts fit; the fastest 10:" in out and "MFU 0.45" in out
    assert "best: dp " in out and "run: ringtrain run JOB.yaml mesh.dp=" in out


def test_plan_json_is_machine_readable(capsys: pytest.CaptureFixture[str]) -> None:
    assert _run(["--model", "llama3-70b", "--seq-len", "131072", "--gpus", "64", "--json", "--top", "3"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["model"]["num_params"] == 70_553_706_496 and record["num_fitting"] >= 1
    assert len(record["layouts"]) == 3 and all(x["fits"] for x in record["layouts"])
    best = record["layouts"][0]
    assert best["memory_bytes"]["total"] <= record["usable_bytes_per_gpu"]


def test_plan_says_what_is_needed_when_nothing_fits(capsys: pytest.CaptureFixture[str]) -> None:
    assert _run(["--model", "llama3-8b", "--seq-len", "16777216", "--gpus", "8"]) == 0
    out = capsys.readouterr().out
    # ZeRO offload (optimizer and parameters) makes 32 GPUs enough, as ALST reports 15M on 32 H100s.
    assert "no layout of 8 GPUs fits" in out and "needs at least 32 GPUs (--gpus 32)" in out


def test_plan_of_a_job_file_and_of_a_parameter_count(capsys: pytest.CaptureFixture[str]) -> None:
    assert _run([str(QUICKSTART), "train.global_batch=8"]) == 0
    assert "the job's layout (dp 2 x cp 2 (ring 2 x ulysses 1), ZeRO-2) fits" in capsys.readouterr().out
    assert _run(["--params", "70B", "--gpus", "8", "--json"]) == 0
    stages = json.loads(capsys.readouterr().out)["stages"]
    zero3_offload = [s for s in stages if s["zero_stage"] == 3 and s["offload_optimizer"]][0]
    # 70e9 x (2 + 2) / 8 bytes of params and grads, plus the bucket and the prefetch
    assert zero3_offload["memory_bytes"]["params"] == 2 * 70_000_000_000 // 8 and zero3_offload["fits"]


@pytest.mark.parametrize(
    "argv, names",
    [
        ([], "--model"),
        (["--model", "llama3-8b", "--params", "8B"], "--model"),
        (["--model", "gpt-5", "--seq-len", "1024"], "--model"),
        (["--model", "llama3-8b"], "--seq-len"),
        (["--model", "llama3-8b", "--seq-len", "many"], "--seq-len"),
        (["--model", "llama3-8b", "--seq-len", "1024", "--gpus", "0"], "--gpus"),
        (["--model", "llama3-8b", "--seq-len", "1024", "--gpu-type", "v100"], "--gpu-type"),
        (["--model", "llama3-8b", "--seq-len", "1024", "--mfu", "1.5"], "--mfu"),
        (["--model", "llama3-8b", "--seq-len", "1024", "--dtype", "fp8"], "--dtype"),
        (["--params", "lots"], "--params"),
        (["--model", "llama3-8b", "--seq-len", "1024", "--objective", "ppo"], "--objective"),
        (["--model", "llama3-8b", "--seq-len", "1024", "--completion-tokens", "512"], "--completion-tokens"),
        (["--model", "llama3-8b", "--max-seq-len", "--objective", "dpo", "--completion-tokens", "0"], "--completion-tokens"),
        (["--params", "8B", "--objective", "dpo"], "--objective"),
        ([str(QUICKSTART), "mesh.nope=1"], "mesh.nope"),
        ([str(QUICKSTART), "data.seq_len=1001"], "data.seq_len"),
    ],
)
def test_bad_input_is_one_line_naming_the_flag(argv: list[str], names: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert _run(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ringtrain: config error: ") and names in lines[0]


def test_fit_warning() -> None:
    quickstart = config.load(QUICKSTART)
    assert fit_warning(quickstart, "cpu") is None
    assert fit_warning(quickstart, "cuda") is None
    llama8b_shape = [
        "model.vocab_size=128256",
        "model.dim=4096",
        "model.n_layers=32",
        "model.n_heads=32",
        "model.n_kv_heads=8",
        "data.seq_len=131072",
    ]
    too_big = config.load(QUICKSTART, [*llama8b_shape, "mesh.dp=2", "mesh.cp=4", "train.global_batch=2"])
    warning = fit_warning(too_big, "cuda")
    assert warning is not None and "\n" not in warning
    assert (
        warning.startswith("ringtrain: warning: predicted peak") and "predicted to fit: mesh.dp=2 mesh.cp=4" in warning
    )
    fitted = config.load(
        QUICKSTART, [*llama8b_shape, "mesh.dp=1", "mesh.cp=8", "zero.stage=3", "model.activation_checkpointing=true"]
    )
    assert fit_warning(fitted, "h100") is None
    assert estimate(workload_of(fitted, "cuda"), layout_of(fitted)).total <= Cluster(device("cuda"), 8).usable_bytes


# --- purity ---------------------------------------------------------------------------------


def test_the_planner_imports_only_the_standard_library_and_the_config() -> None:
    allowed = {"ringtrain", "ringtrain.config", "ringtrain.errors"}
    for path in sorted((ROOT / "platform" / "ringtrain" / "planner").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module == "ringtrain":
                names = [f"ringtrain.{alias.name}" for alias in node.names]  # from ringtrain import a module
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for name in names:
                ok = name.partition(".")[0] in sys.stdlib_module_names or name in allowed
                assert ok or name.startswith("ringtrain.planner"), f"{path.name} imports {name}"
