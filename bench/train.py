"""Benchmark: training throughput and MFU at 32K tokens on one GPU, ringtrain's Trainer against
plain PyTorch around the same module and against Hugging Face transformers' own model.

Shapes (``SHAPES``), one 32,768-token sequence per optimizer step, bf16:

- tinyllama: TinyLlama-1.1B (Zhang et al. 2024, "TinyLlama", Table 1): vocabulary 32,000, dim
  2048, 22 layers, 32 query / 4 KV heads of dim 64, FFN 5632, rope theta 1e4.
- qwen3: Qwen3-1.7B (its config.json): vocabulary 151,936, dim 2048, 28 layers, 16 query / 8 KV
  heads of dim 128, FFN 6144, per-head q/k RMSNorm, tied embeddings, rope theta 1e6, eps 1e-6.

Variants, each in a process of its own (``ringtrain_dev.try_process``; on CUDA a spawned one: a
fresh CUDA context, allocator and process group), one after the other:

- trainer: ringtrain's ``Trainer`` of one rank in an NCCL world of one, as a worker runs it:
  DeepSpeed ZeRO-``--zero``, the job's defaults (``model.activation_checkpointing=auto``,
  ``train.fused_ops=true``, ``attention.kernel=auto``), the stdlib corpus as data, snapshots off.
- plain: the same ``Transformer`` from ``build_model`` (so the same resolved recompute mode,
  fused ops and kernel), bf16 weights with fp32 master copies stepped by torch's AdamW (fused on
  CUDA) and copied back, the same gradient clipping, random tokens, the loss from the model's
  labels path: the Trainer's recipe without the platform around it.
- hf: transformers' ``LlamaForCausalLM`` / ``Qwen3ForCausalLM`` built from the config ringtrain's
  exporter writes for the same shape (``ringtrain.hf.hfconfig``), ``attn_implementation="sdpa"``,
  gradient checkpointing of every layer (32K tokens do not fit without), the same fp32-master
  AdamW, ``model(input_ids=..., labels=...).loss``: what a user would otherwise run.
- trainer_snapshots (on ``--snapshot-shapes``, default tinyllama): the trainer with a snapshot
  every ``--snapshot-every`` steps (default 1; 0 leaves it out) under
  ``checkpoint.snapshot_staging=--snapshot-staging`` (default auto), for the per-step snapshot's
  cost.

The snapshot's cost is profiled where it is paid. Each snapshot says where its time went
(``ringtrain.train.snapshot.CopyProfile``: the capture's issue on the host, buffers allocated,
the staging copy on the device, the copy into host memory, its rate and whether that memory was
page-locked, the checksum), and the
snapshotter how long each fence held the optimizer step; ``snapshot_profile`` in the JSON holds
their medians over the timed steps and splits the step time the snapshots added into the fence's
wait, the capture's issue and its wait for a host buffer, and what is left: the step's own work
slowed beside the copy (memory bandwidth, or a host thread kept from a core). On a GPU both
trainer variants of the shape snapshots run on also run one more step under torch.profiler, and
the JSON keeps each one's table of the ops that took the most device and host time
(``profile_table``), so the two tables tell where the rest went.

Each variant runs ``--warmup`` untimed steps, then ``--steps`` timed ones, each from a
synchronized device to a synchronized device; the median step time gives tokens/s. Peak memory
is ``torch.cuda.max_memory_allocated`` over the steps (the process's peak RSS on a CPU).

MFU is model FLOPs per token x tokens/s over the device's peak dense bf16 FLOP/s. With N_mm the
parameters of matrix multiplies (every projection and the output head, tied or not; not the
embedding lookup or the norm gains), L layers, A = n_heads x head_dim the attention width and
S the sequence length, per token:

    causal (the platform's MFU metric)   6 N_mm +  6 L A S
    the 12 L d S convention              6 N_mm + 12 L A S

The first halves attention's score and value products under the causal mask; the second counts
them whole, as published MFU figures do (PaLM's 6 N + 12 L H Q T; Chowdhery et al. 2022). Neither
counts recomputation. The planner's ``flops_per_token`` (``ringtrain.planner.throughput``)
takes model.dim for A; the two differ where head_dim != dim / n_heads (not in these two
shapes), and the JSON records the planner's figure beside. The peak is the planner's device
table (``ringtrain.planner.devices``: H100 989 TFLOP/s) or ``--peak-tflops``.

Targets, each printed PASS or MISS with its value:

    trainer MFU (causal)                       >= 50% qwen3, >= 38% tinyllama
    trainer / plain tokens/s                   >= 0.98, per shape
    trainer / hf tokens/s                      >= 1.5, per shape
    trainer_snapshots / trainer step time      <= 1.02, per shape it ran on

``--check`` exits 1 when one is missed or could not be measured. A variant that fails (out of
memory included, or past ``--timeout``) is a result: it is recorded with the last lines of its
error, the bench goes on with the next one, and exits 1 at the end. A SIGINT (a time box's)
ends the bench at the variant in flight, recorded as interrupted; the JSON still holds all
that was measured before it. The budget is 5 minutes on one H100 for the whole bench:
``--timeout`` bounds each variant, process start included, and ``--shapes``, ``--variants`` and
``--seq`` cut it down.

    PYTHONPATH=platform python bench/train.py [--shapes tinyllama,qwen3]
        [--variants trainer,plain,hf,trainer_snapshots] [--seq 32768] [--warmup 2] [--steps 4]
        [--zero 2] [--kernel auto] [--snapshot-every 1] [--timeout 120] [--peak-tflops T]
        [--check] [--name train] [--out PATH]

``--device cpu --tiny`` is a smoke run of the same code: tiny shapes of both families (dim 64,
2 layers, 4 heads / 2 KV heads of dim 16, or 32 for Qwen3's, vocabulary 512, 256 tokens), a gloo
world of one, the dtype the Trainer picks there (fp32), every variant; its ratios are printed
marked as a smoke run, not held to the targets.

Writes bench/results/<name>-<device>.json (``--name``, default train; ``-tiny`` added for tiny
shapes; or ``--out``) through
``ringtrain_dev.record``: commit, device, versions, and every step time and loss per variant per
shape.
Needs CUDA unless ``--device cpu``: without it, it exits 2 at once with a message.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time
import traceback
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional

import torch

from ringtrain.config import SNAPSHOT_STAGINGS
from ringtrain_dev.bench_cli import bad_input, listed, one_device_parser, slug, without_cuda
from ringtrain_dev.one_device import MasterWeightAdamW, Shape, device_of, hf_model, hf_step, join_world_of_one, model_overrides
from ringtrain_dev.record import RESULTS_DIR, Run
from ringtrain_dev.targets import SMOKE, Target
from ringtrain_dev.try_process import interrupt_on_sigint, run_to_end

if TYPE_CHECKING:
    from ringtrain.config import JobConfig
    from ringtrain.train.model import Transformer

PLAIN_RATIO_MIN = 0.98  # trainer tokens/s over plain PyTorch's
HF_RATIO_MIN = 1.5  # trainer tokens/s over transformers'
SNAPSHOT_RATIO_MAX = 1.02  # trainer step time with a snapshot every step over without
ERROR_LINES = 20  # of a failed variant's traceback, kept in the JSON
PROFILE_ROWS = 25  # of each profiled step's table
INTERRUPTED = "interrupted (SIGINT) before it reported"


@dataclass(frozen=True)
class TimedShape(Shape):
    """A model shape (its job keys, transformers' classes for the same model) and the Trainer's
    MFU target on it."""

    mfu_min: float
    snapshots: bool = False  # the trainer_snapshots variant runs on this shape unless --snapshot-shapes says


SHAPES: dict[str, TimedShape] = {
    "tinyllama": TimedShape(
        title="TinyLlama-1.1B",
        model={"vocab_size": 32000, "dim": 2048, "n_layers": 22, "n_heads": 32, "n_kv_heads": 4, "head_dim": 64,
               "ffn_dim": 5632, "rope_theta": 10000.0, "norm_eps": 1e-5},
        tiny={"vocab_size": 512, "dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "head_dim": 16,
              "ffn_dim": 176},
        hf_model="LlamaForCausalLM",
        hf_config="LlamaConfig",
        mfu_min=0.38,
        snapshots=True,
    ),
    "qwen3": TimedShape(
        title="Qwen3-1.7B",
        model={"vocab_size": 151936, "dim": 2048, "n_layers": 28, "n_heads": 16, "n_kv_heads": 8, "head_dim": 128,
               "ffn_dim": 6144, "rope_theta": 1000000.0, "norm_eps": 1e-6, "qk_norm": True, "tie_embeddings": True},
        # head_dim x n_heads != dim here, as in the smaller Qwen3s: the attention width is its own.
        tiny={"vocab_size": 512, "dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "head_dim": 32,
              "ffn_dim": 192},
        hf_model="Qwen3ForCausalLM",
        hf_config="Qwen3Config",
        mfu_min=0.50,  # head_dim 128: the attention kernels' best shape
    ),
}

VARIANTS = ("trainer", "trainer_snapshots", "plain", "hf")
FULL_SEQ, TINY_SEQ = 32768, 256


# ---- FLOPs ------------------------------------------------------------------------------------


def matmul_params(model: Mapping[str, Any]) -> int:
    """N_mm: parameters that take part in matrix multiplies (see the module docstring)."""
    dim, ffn, layers = model["dim"], model["ffn_dim"], model["n_layers"]
    q_width = model["n_heads"] * model["head_dim"]
    kv_width = model["n_kv_heads"] * model["head_dim"]
    per_layer = dim * q_width + 2 * dim * kv_width + q_width * dim + 3 * dim * ffn
    return layers * per_layer + model["vocab_size"] * dim


def flops_per_token(model: Mapping[str, Any], seq: int) -> dict[str, float]:
    """Model FLOPs per token by the causal formula and by the 12 L d S convention."""
    dense = 6.0 * matmul_params(model)
    causal_attention = 6.0 * model["n_layers"] * model["n_heads"] * model["head_dim"] * seq
    return {"causal": dense + causal_attention, "convention_12lds": dense + 2 * causal_attention}


# ---- one variant, in its own process ---------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """One variant of one shape, as its process runs it."""

    shape: str
    variant: str
    device: str  # cuda | cpu
    tiny: bool
    seq: int
    warmup: int
    steps: int
    zero: int
    kernel: str
    snapshot_every: int
    snapshot_staging: str = "auto"
    profiled: bool = False  # a trainer variant of a shape the snapshot variant runs on: one step profiled

    @property
    def model(self) -> dict[str, Any]:
        return SHAPES[self.shape].model_keys(self.tiny)


def job_overrides(case: Case) -> list[str]:
    """The job every variant of ``case`` trains: its shape, one sequence per step, one device."""
    snapshot_every = case.snapshot_every if case.variant == "trainer_snapshots" else 0
    return [
        *model_overrides(case.model),
        f"data.seq_len={case.seq}",
        "train.global_batch=1",
        "train.micro_batch=1",
        f"train.steps={max(1000, case.warmup + case.steps)}",
        "mesh.dp=1",
        "mesh.cp=1",
        f"zero.stage={case.zero}",
        f"attention.kernel={case.kernel}",
        f"checkpoint.snapshot_every={snapshot_every}",
        f"checkpoint.snapshot_staging={case.snapshot_staging}",
        f"cluster.device={case.device}",
    ]


def load_job(case: Case) -> JobConfig:
    from ringtrain import config

    return config.load(None, job_overrides(case))


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def synchronize(device: torch.device) -> None:
    """Wait for the training stream, as a training loop's own ``loss.item()`` does. Not the whole
    device: a snapshot's copy runs on a side stream while the next step computes, and whatever it
    costs that step (the fence before the optimizer, shared bandwidth) shows in that step's time."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def timed_steps(step: Callable[[], float], case: Case, device: torch.device) -> tuple[list[float], list[float]]:
    """Step times (s) and losses of the timed steps, after the untimed warm-up steps."""
    times, losses = [], []
    for i in range(case.warmup + case.steps):
        synchronize(device)
        t0 = time.perf_counter()
        loss = step()
        synchronize(device)
        if i >= case.warmup:
            times.append(time.perf_counter() - t0)
            losses.append(loss)
    return times, losses


def random_tokens(vocab_size: int, case: Case, device: torch.device) -> torch.Tensor:
    """[1, seq + 1] token ids: the inputs and, shifted by one, their labels."""
    gen = torch.Generator(device=device).manual_seed(0)
    return torch.randint(0, vocab_size, (1, case.seq + 1), device=device, generator=gen)


def ringtrain_recipe(job: JobConfig, model: Transformer, device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    """What ringtrain's model runs here: recompute mode, attention kernel, fused ops, dtype."""
    from ringtrain.train.attention.kernels import get_kernel
    from ringtrain.train.fused import kernels_run

    kernel = get_kernel(job.attention.kernel, device_type=device.type, dtype=dtype, head_dim=job.head_dim)
    liger = kernels_run(model.fused, device.type)
    return {
        "dtype": str(dtype).removeprefix("torch."),
        "checkpointing": model.savers.checkpointing,
        "recompute_layers": model.savers.recompute_layers,
        "attention_kernel": kernel.name,
        "fused_kernels": "liger" if liger else "eager",
        "fused_projections": model.fused.projections,
    }


def run_trainer(case: Case) -> dict[str, Any]:
    """ringtrain's Trainer, one rank in a world of one; snapshots per ``case.variant``."""
    device = device_of(case.device)
    join_world_of_one(device)
    from ringtrain.train.model import num_params
    from ringtrain.train.trainer import Trainer

    job = load_job(case)
    trainer = Trainer(job, rank=0, device=device)
    reports: list[Any] = []
    copies: dict[int, Any] = {}  # step -> its snapshot's CopyProfile, as the snapshotter keeps the newest

    def step() -> float:
        reports.append(trainer.train_step())
        if trainer.snapshotter is not None:
            copies.update(trainer.snapshotter.profiles)
        return float(reports[-1].loss)

    try:
        times, losses = timed_steps(step, case, device)
        timed = reports[case.warmup :]
        snapshots = snapshot_profiles(trainer.snapshotter, [r.step for r in timed], copies) if trainer.snapshotter else {}
        # The profiled step is for the snapshot's cost: the shape snapshots run on, with and without.
        # A profiler that fails (CUPTI) costs the table, not the steps measured above it.
        try:
            table = profiled_step(step, device) if case.profiled else ""
        except Exception as exc:  # noqa: BLE001 - any failure of the profiler; SIGINT still ends the run
            table = f"profiling failed: {exc!r}"
        return {
            "step_s": times,
            "losses": losses,
            "tokens_per_step": timed[-1].num_tokens,
            "num_params": num_params(trainer.model),
            # The Trainer resets the peak at each step's start: the largest step's is the run's.
            "peak_memory_bytes": max(r.memory_bytes for r in timed),
            "reported_step_s": [r.step_time_s for r in timed],  # its own clock, snapshot launch excluded
            "snapshot_s": [r.snapshot_s for r in timed],
            **({"snapshot_steps": snapshots} if snapshots else {}),
            **({"profile_table": table} if table else {}),
            "device_name": device_name(device),
            **ringtrain_recipe(job, trainer.model, device, trainer.dtype),
        }
    finally:
        trainer.close()


def snapshot_profiles(snapshotter: Any, steps: list[int], copies: dict[int, Any]) -> dict[str, Any]:
    """Per timed step: the fence's wait before its optimizer step (on the snapshot of the step
    before), and that step's own snapshot's ``CopyProfile`` fields; and the first capture's
    allocations (in the warm-up: the host buffers, page-locked on a GPU, and the staging buffer
    where there is one)."""
    from ringtrain.train.snapshot import CopyProfile

    snapshotter.settle()
    copies.update(snapshotter.profiles)
    out: dict[str, Any] = {"fence_wait_s": [snapshotter.fence_wait_s(s - 1) for s in steps]}
    for name in [*(f.name for f in fields(CopyProfile)), "host_write_gbps"]:
        out[name] = [getattr(copies[s], name) if s in copies else None for s in steps]
    out["first_capture_alloc_s"] = copies[min(copies)].alloc_s if copies else None
    return out


def profiled_step(step: Callable[[], float], device: torch.device) -> str:
    """On CUDA, one more step under torch.profiler: its ops by device time, then by host time."""
    if device.type != "cuda":
        return ""
    from torch.profiler import ProfilerActivity, profile

    synchronize(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize(device)  # the side stream's copies too
    averages = prof.key_averages()
    return "\n\n".join(averages.table(sort_by=key, row_limit=PROFILE_ROWS)
                        for key in ("self_cuda_time_total", "self_cpu_time_total"))


def snapshot_breakdown(variants: Mapping[str, dict[str, Any]]) -> Optional[dict[str, Any]]:
    """What the snapshots added to the median step, split into the fence's wait, the capture's
    issue and the rest, with the copy's medians beside."""
    pair = ("trainer", "trainer_snapshots")
    if not set(pair) <= set(variants) or any("error" in variants[v] for v in pair):
        return None
    snap = variants["trainer_snapshots"]
    steps = snap.get("snapshot_steps")
    if not steps:
        return None

    def median(key: str) -> Optional[float]:
        values = [v for v in steps[key] if v is not None and v != float("inf")]
        return float(statistics.median(values)) if values else None

    added = snap["median_step_s"] - variants["trainer"]["median_step_s"]
    out = {"added_s": added, **{key: median(key) for key in
           ("fence_wait_s", "issue_s", "stage_s", "copy_s", "checksum_s", "host_write_gbps", "buffer_wait_s")},
           "alloc_s": steps["first_capture_alloc_s"],
           "staged": any(steps["staged"]), "page_locked": all(v for v in steps["page_locked"] if v is not None),
           "num_bytes": median("num_bytes")}  # fmt: skip
    out["rest_s"] = added - sum(out[key] or 0.0 for key in ("fence_wait_s", "issue_s", "buffer_wait_s"))
    return out


def describe_breakdown(b: Mapping[str, Any]) -> str:
    def ms(key: str) -> str:
        return "n/a" if b.get(key) is None else f"{1e3 * b[key]:.1f} ms"

    return (f"  snapshot step: {1e3 * b['added_s']:+.1f} ms a step = fence wait {ms('fence_wait_s')} + capture issue "
            f"{ms('issue_s')} + waiting for a host buffer {ms('buffer_wait_s')} + rest {ms('rest_s')} (the step's "
            "own work beside the copy); "
            f"{'staged on the device ' + ms('stage_s') + ', ' if b['staged'] else 'not staged, '}"
            f"{(b['num_bytes'] or 0) / 1e9:.2f} GB into {'page-locked' if b.get('page_locked') else 'pageable'} host "
            f"memory in {ms('copy_s')} "
            f"({b['host_write_gbps'] or 0:.1f} GB/s), checksum {ms('checksum_s')}, buffers allocated {ms('alloc_s')} "
            "(first capture)")


def run_plain(case: Case) -> dict[str, Any]:
    """The Trainer's model and optimizer recipe in a loop of plain PyTorch."""
    from ringtrain.topology import CPLayout
    from ringtrain.train.attention import build_attention
    from ringtrain.train.engine import resolve_dtype
    from ringtrain.train.model import num_params
    from ringtrain.train.trainer import build_model

    device = device_of(case.device)
    job = load_job(case)
    dtype = resolve_dtype(job, device)
    attention_fn = build_attention(CPLayout(1, 1), job.attention.kernel, ring_group=None, ulysses_group=None)
    with device:  # drawn on the device: a 1-2B model's initialisation on the host takes long
        model = build_model(job, attention_fn, device).to(dtype=dtype)
    model.train()
    optimizer = MasterWeightAdamW(model, job, fused=device.type == "cuda")
    tokens = random_tokens(job.model.vocab_size, case, device)
    input_ids, labels = tokens[:, :-1], tokens[:, 1:]
    positions = torch.arange(case.seq, device=device)[None]

    def step() -> float:
        loss = model(input_ids, positions, labels) / labels.numel()  # the model returns the sum
        loss.backward()
        optimizer.step()
        return float(loss.item())  # the Trainer reports each step's loss too

    reset_peak_memory(device)
    times, losses = timed_steps(step, case, device)
    return {
        "step_s": times,
        "losses": losses,
        "tokens_per_step": case.seq,
        "num_params": num_params(model),
        "peak_memory_bytes": peak_memory(device),
        "device_name": device_name(device),
        **ringtrain_recipe(job, model, device, dtype),
    }


def run_hf(case: Case) -> dict[str, Any]:
    """transformers' model of the same shape, trained the way a user would train it."""
    import transformers

    from ringtrain.train.engine import resolve_dtype

    device = device_of(case.device)
    job = load_job(case)
    dtype = resolve_dtype(job, device)
    model = hf_model(SHAPES[case.shape], job, case.seq, device, dtype)
    optimizer = MasterWeightAdamW(model, job, fused=device.type == "cuda")
    input_ids = random_tokens(job.model.vocab_size, case, device)[:, :-1]
    reset_peak_memory(device)
    times, losses = timed_steps(lambda: hf_step(model, optimizer, input_ids), case, device)
    return {
        "step_s": times,
        "losses": losses,
        "tokens_per_step": case.seq,
        "num_params": sum(p.numel() for p in model.parameters()),
        "peak_memory_bytes": peak_memory(device),
        "device_name": device_name(device),
        "dtype": str(dtype).removeprefix("torch."),
        "checkpointing": "full",
        "attention_kernel": model.config._attn_implementation,
        "transformers": transformers.__version__,
    }


RUNNERS: dict[str, Callable[[Case], dict[str, Any]]] = {
    "trainer": run_trainer,
    "plain": run_plain,
    "hf": run_hf,
    "trainer_snapshots": run_trainer,
}


def _variant_main(case: Case, results: Any) -> None:
    try:
        results.put(RUNNERS[case.variant](case))
    except BaseException as exc:  # noqa: BLE001 - a failure is a result; the parent records it
        lines = traceback.format_exc().rstrip().splitlines()
        oom = isinstance(exc, torch.OutOfMemoryError)
        results.put({"error": "\n".join(lines[-ERROR_LINES:]), "out_of_memory": oom})


# ---- the parent: run each variant, score, report ----------------------------------------------


def run_variant(case: Case, timeout_s: float) -> dict[str, Any]:
    """``case`` in a process of its own (``ringtrain_dev.try_process``): its result, or {"error": ...}."""
    ended = run_to_end(case.device, _variant_main, case, timeout_s=timeout_s)
    if ended.result is not None:
        out = dict(ended.result)
    elif ended.timed_out:
        out = {"error": f"no result within --timeout {timeout_s:g} s", "timed_out": True}
    else:
        out = {"error": f"the process exited with code {ended.exitcode} before reporting"}
    out["wall_s"] = round(ended.wall_s, 1)
    return out


def gpu_peak_flops(name: str, override_tflops: Optional[float]) -> tuple[Optional[float], str]:
    """The GPU's peak dense bf16 FLOP/s and where the number comes from (None: unknown)."""
    from ringtrain.planner.devices import DEVICES

    if override_tflops:
        return override_tflops * 1e12, "--peak-tflops"
    lowered = name.lower()
    for key, spec in DEVICES.items():
        if key in lowered:
            if "pcie" in lowered or "nvl" in lowered:
                return None, f"{name} is not the SXM part of the planner's table; pass --peak-tflops"
            return spec.peak_flops, f"ringtrain.planner.devices ({key})"
    return None, f"{name} is not in ringtrain.planner.devices; pass --peak-tflops"


def peak_flops(device_type: str, name: str, override_tflops: Optional[float]) -> tuple[Optional[float], str]:
    if device_type == "cuda" or override_tflops:
        return gpu_peak_flops(name, override_tflops)
    from ringtrain.planner.devices import peak_flops as nominal

    cores = os.cpu_count() or 1
    return nominal("cpu", cpu_cores=cores), f"ringtrain.planner.devices (nominal CPU, {cores} cores)"


def score(out: dict[str, Any], flops: Mapping[str, float], peak: Optional[float]) -> None:
    """Add median step time, tokens/s and MFU to a variant's result."""
    if "error" in out:
        return
    out["median_step_s"] = statistics.median(out["step_s"])
    out["tokens_per_s"] = out["tokens_per_step"] / out["median_step_s"]
    if peak:
        out["mfu_causal"] = flops["causal"] * out["tokens_per_s"] / peak
        out["mfu_12lds"] = flops["convention_12lds"] * out["tokens_per_s"] / peak


def _metric(variants: Mapping[str, dict[str, Any]], variant: str, key: str) -> tuple[Optional[float], str]:
    out = variants[variant]
    if "error" in out:
        return None, f"{variant} failed"
    if key not in out:
        return None, f"{variant} has no {key}: the device's peak is unknown"
    return float(out[key]), ""


def _ratio(variants: Mapping[str, dict[str, Any]], num: str, den: str, key: str) -> tuple[Optional[float], str]:
    (a, why_a), (b, why_b) = _metric(variants, num, key), _metric(variants, den, key)
    if a is None or b is None:
        return None, why_a or why_b
    return a / b, ""


def targets_for(name: str, variants: Mapping[str, dict[str, Any]]) -> list[Target]:
    """The targets of one shape whose variants ran (a target of a variant left out is not one)."""
    ran = set(variants)
    out = []
    if "trainer" in ran:
        value, why = _metric(variants, "trainer", "mfu_causal")
        out.append(Target(name, "trainer MFU (causal)", value, SHAPES[name].mfu_min, "%", missing=why))
    for baseline, bound in (("plain", PLAIN_RATIO_MIN), ("hf", HF_RATIO_MIN)):
        if {"trainer", baseline} <= ran:
            value, why = _ratio(variants, "trainer", baseline, "tokens_per_s")
            out.append(Target(name, f"trainer / {baseline} tokens/s", value, bound, missing=why))
    if {"trainer", "trainer_snapshots"} <= ran:
        value, why = _ratio(variants, "trainer_snapshots", "trainer", "median_step_s")
        what = "trainer_snapshots / trainer step time"
        out.append(Target(name, what, value, SNAPSHOT_RATIO_MAX, at_most=True, missing=why))
    return out


def describe(label: str, out: Mapping[str, Any]) -> str:
    """One variant's line; ``label`` names it (shape/variant: a shape's variants do not run together)."""
    if "error" in out:
        why = "out of memory" if out.get("out_of_memory") else out["error"].splitlines()[-1]
        return f"  {label:<28} FAILED after {out['wall_s']:g} s: {why}"
    mfu = f"MFU {out['mfu_causal']:5.1%} causal, {out['mfu_12lds']:5.1%} 12LdS" if "mfu_causal" in out else "MFU n/a"
    layers = f" (first {out['recompute_layers']} layers)" if out.get("recompute_layers") is not None else ""
    recipe = f"recompute {out['checkpointing']}{layers}, attention {out['attention_kernel']}"
    if "fused_kernels" in out:
        recipe += f", fused {out['fused_kernels']}{' + qkv/gate-up GEMMs' if out['fused_projections'] else ''}"
    return (f"  {label:<28} {out['tokens_per_s']:>10,.0f} tokens/s {out['median_step_s']:8.3f} s/step  {mfu}  "
            f"peak {out['peak_memory_bytes'] / 2**30:.2f} GiB  {out['dtype']}, {recipe}  (process {out['wall_s']:g} s)")


def snapshots_on(name: str, args: argparse.Namespace) -> bool:
    """Whether the trainer_snapshots variant runs on shape ``name``."""
    return name in args.snapshot_shapes and args.snapshot_every > 0


def plan(args: argparse.Namespace) -> list[tuple[str, str]]:
    """(shape, variant) pairs to run, in order: a variant for every shape before the next
    variant, so that a run cut short by its time box has measured the first variants listed
    (``--variants``' order) of every shape."""
    pairs = []
    for variant in args.variants:
        for name in args.shapes:
            if variant == "trainer_snapshots" and not snapshots_on(name, args):
                continue
            pairs.append((name, variant))
    return pairs


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = one_device_parser(__doc__)
    p.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated, of: " + ", ".join(SHAPES))
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated, of: " + ", ".join(VARIANTS))
    p.add_argument("--seq", type=int, default=None,
                   help=f"tokens per step, one sequence ({FULL_SEQ}; {TINY_SEQ} with --tiny)")
    p.add_argument("--steps", type=int, default=4, help="timed steps per variant")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    p.add_argument("--zero", type=int, default=2, help="the Trainer's ZeRO stage")
    p.add_argument("--kernel", default="auto", help="attention.kernel of ringtrain's variants")
    p.add_argument("--snapshot-every", type=int, default=1, help="trainer_snapshots' snapshot interval (0: not run)")
    p.add_argument("--snapshot-shapes", default=",".join(name for name, shape in SHAPES.items() if shape.snapshots),
                   help="comma-separated shapes the trainer_snapshots variant runs on")
    p.add_argument("--snapshot-staging", default="auto", choices=SNAPSHOT_STAGINGS,
                   help="trainer_snapshots' checkpoint.snapshot_staging")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per variant, process start included")
    p.add_argument("--peak-tflops", type=float, default=None, help="peak dense bf16 TFLOP/s of a GPU the table lacks")
    p.add_argument("--check", action="store_true", help="exit 1 when a target is missed or not measured")
    p.add_argument("--out", type=Path, default=None, help="the JSON's path (default bench/results/<name>-<device>.json)")
    p.add_argument("--name", default="train",
                   help="the JSON's name before the device, so that two runs on one device keep both (default train)")
    args = p.parse_args(argv)
    args.shapes = listed(args.shapes, tuple(SHAPES), "--shapes", "train")
    args.variants = listed(args.variants, VARIANTS, "--variants", "train")
    args.snapshot_shapes = listed(args.snapshot_shapes, tuple(SHAPES), "--snapshot-shapes", "train")
    if args.seq is None:
        args.seq = TINY_SEQ if args.tiny else FULL_SEQ
    if args.seq < 2 or args.steps < 1 or args.warmup < 0:
        raise SystemExit(bad_input("train", "--seq must be >= 2, --steps >= 1 and --warmup >= 0"))
    return args


def shape_records(args: argparse.Namespace, base: Case) -> dict[str, dict[str, Any]]:
    """Each selected shape's sizes and FLOPs per token; its variants' results go in as they come."""
    from ringtrain.planner.models import from_job
    from ringtrain.planner.throughput import flops_per_token as planner_flops_per_token

    records = {}
    for name in args.shapes:
        case = replace(base, shape=name, variant="trainer")
        planner = planner_flops_per_token(from_job(load_job(case)), args.seq, checkpointing=False)[0]
        records[name] = {
            "title": SHAPES[name].title,
            "model": case.model,
            "seq": args.seq,
            "matmul_params": matmul_params(case.model),
            "flops_per_token": {**flops_per_token(case.model, args.seq), "planner_causal": planner},
            "variants": {},
        }
    return records


def shape_header(name: str, record: Mapping[str, Any], tiny: bool) -> str:
    model = record["model"]
    return (f"{name} ({SHAPES[name].title}{' family, tiny' if tiny else ''}): "
            f"{record['flops_per_token']['causal'] / 1e9:.3g} GFLOP per token (causal), {model['n_layers']} layers, "
            f"dim {model['dim']}, {model['n_heads']} heads x {model['head_dim']}, {model['n_kv_heads']} KV heads")


@dataclass
class Peak:
    """The device's peak FLOP/s, looked up from the name the first variant reports."""

    flops: Optional[float] = None
    source: str = "no variant reported its device"
    device_name: str = ""

    def learn(self, out: Mapping[str, Any], args: argparse.Namespace) -> None:
        if "device_name" in out and not self.device_name:
            self.device_name = out["device_name"]
            self.flops, self.source = peak_flops(args.device, self.device_name, args.peak_tflops)


def run_plan(args: argparse.Namespace, base: Case, shapes: dict[str, dict[str, Any]], peak: Peak) -> bool:
    """Run each (shape, variant) of the plan, one after the other, into ``shapes``; whether a
    SIGINT (a time box's) ended it: the variant in flight is then recorded as interrupted and
    the rest are not run."""
    name, variant = "", ""
    try:
        for name, variant in plan(args):
            variants = shapes[name]["variants"]
            if not variants:
                print(shape_header(name, shapes[name], args.tiny))
            profiled = variant in ("trainer", "trainer_snapshots") and snapshots_on(name, args)
            out = run_variant(replace(base, shape=name, variant=variant, profiled=profiled), args.timeout)
            peak.learn(out, args)
            score(out, shapes[name]["flops_per_token"], peak.flops)
            variants[variant] = out
            print(describe(f"{name}/{variant}", out), flush=True)
            if "error" in out:
                print(f"{name}/{variant} failed:\n{out['error']}", file=sys.stderr)
    except KeyboardInterrupt:
        if name and variant not in shapes[name]["variants"]:
            shapes[name]["variants"][variant] = {"error": INTERRUPTED, "interrupted": True}
        print(f"interrupted at {name}/{variant}: what comes after it is not run", file=sys.stderr)
        return True
    return False


def main(argv: list[str]) -> int:
    interrupt_on_sigint()
    args = parse_args(argv)
    if args.device == "cuda" and (no_gpu := without_cuda("train", " (or make gpu-check)")) is not None:
        return no_gpu
    if args.device == "cpu" and not args.tiny:
        return bad_input("train", "--device cpu runs only with --tiny (a 32K-token step of a 1B model takes hours on a CPU)")
    run = Run("train")
    smoke = args.device == "cpu"
    # Fewer allocator retries at 32K tokens; the same setting for every variant (inherited).
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    base = Case(shape="", variant="", device=args.device, tiny=args.tiny, seq=args.seq, warmup=args.warmup,
                steps=args.steps, zero=args.zero, kernel=args.kernel, snapshot_every=args.snapshot_every,
                snapshot_staging=args.snapshot_staging)
    shapes = shape_records(args, base)
    peak = Peak()
    print(f"{'tiny shapes, ' if args.tiny else ''}{args.seq} tokens per step on {args.device}"
          f"{f' ({SMOKE})' if smoke else ''}")
    interrupted = run_plan(args, base, shapes, peak)
    targets = [t for name in args.shapes for t in targets_for(name, shapes[name]["variants"])]
    for name in args.shapes:
        breakdown = snapshot_breakdown(shapes[name]["variants"])
        if breakdown is not None:
            shapes[name]["snapshot_profile"] = breakdown
            print(f"{name}:\n{describe_breakdown(breakdown)}")
    print(f"peak: {peak.source}")
    for target in targets:
        print(target.line(smoke))
    failed = [f"{name}/{v}" for name in shapes for v, out in shapes[name]["variants"].items() if "error" in out]
    device_label = peak.device_name if args.device == "cuda" and peak.device_name else args.device
    run.write(
        {
            "config": {**vars(args), "out": str(args.out) if args.out else None},
            "smoke": smoke,
            "peak_flops": peak.flops,
            "peak_flops_source": peak.source,
            "flops_note": "model FLOPs per token: causal 6 N_mm + 6 L A S, convention_12lds 6 N_mm + 12 L A S, "
                          "A = n_heads x head_dim; planner_causal: the planner's flops_per_token (A = model.dim)",
            "shapes": shapes,
            "targets": [{**asdict(t), "met": t.met} for t in targets],
            "failed": failed,
            "interrupted": interrupted,
        },
        device_type=args.device,
        out=args.out or RESULTS_DIR / f"{args.name}-{slug(device_label)}{'-tiny' if args.tiny else ''}.json",
    )
    if failed or interrupted:
        print(f"failed: {', '.join(failed) or 'none'}{'; interrupted' if interrupted else ''}", file=sys.stderr)
        return 1
    if args.check and not smoke and not all(t.met for t in targets):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
