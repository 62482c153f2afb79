"""Benchmark: training throughput and MFU of a ~1B Llama at 32K tokens on one GPU, ringtrain's
Trainer against plain PyTorch around the same model and attention kernel, in the same run.

Model: TinyLlama-1.1B's shape (dim 2048, 22 layers, 32 heads, 4 KV heads, FFN 5632) with a
32,000-token vocabulary, activation checkpointing per layer (a 32K-token sequence's activations
do not fit in 80 GB otherwise), bf16, one 32,768-token sequence per optimizer step.

- ringtrain: the ``Trainer`` of one rank in an NCCL world of one, as a worker runs it: DeepSpeed
  bf16 with ZeRO ``--zero`` and torch's AdamW, the stdlib corpus as data, the step's loss
  all-reduced and reported; snapshots off (``--snapshot-every N`` adds a run with them).
- plain PyTorch: the same ``Transformer`` module and attention function, bf16 weights with fp32
  master copies stepped by torch's AdamW and copied back (DeepSpeed's bf16 recipe, written out),
  the same gradient clipping and loss, random tokens.

Each runs in a process of its own (a fresh CUDA context, allocator and process group), one after
the other, ``--warmup`` untimed steps then ``--steps`` timed ones, each step timed from a
synchronized GPU to a synchronized GPU; the median step time gives tokens/s.

MFU is model FLOPs per token (6 N_matmul + 6 L d S, the platform's own MFU metric; the
recomputation of checkpointed activations is not counted) x tokens/s over the device's peak
dense bf16 FLOP/s (the planner's table, ``ringtrain.planner.devices``; ``--peak-tflops`` for a
GPU it lacks). Targets: the Trainer's MFU >= 45%, and its tokens/s within 5% of plain PyTorch's
(>= 0.95x). ``--check`` makes a missed target exit 1.

    PYTHONPATH=platform python bench/train.py [--steps 6] [--warmup 2] [--seq 32768] [--kernel auto]
        [--zero 2] [--snapshot-every N] [--peak-tflops T] [--check]

Writes bench/results/train-<device>.json (commit, device, torch and CUDA versions, every step
time). Needs CUDA: without it, it exits 2 at once with a message.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import queue
import re
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from record import RESULTS_DIR, Run  # noqa: E402

EXIT_NO_CUDA = 2
MFU_TARGET = 0.45
PARITY_TARGET = 0.95  # ringtrain's tokens/s over plain PyTorch's

# TinyLlama-1.1B (Zhang et al. 2024, "TinyLlama: An Open-Source Small Language Model", Table 1)
# with Llama 2's 32K vocabulary: a 1B Llama whose 32K-token logits still fit beside the model.
MODEL = {
    "vocab_size": 32000,
    "dim": 2048,
    "n_layers": 22,
    "n_heads": 32,
    "n_kv_heads": 4,
    "ffn_dim": 5632,
}


def job_overrides(args: argparse.Namespace, *, snapshot_every: int) -> list[str]:
    """The job both variants train: the model above, one sequence per step, one GPU."""
    return [
        *(f"model.{key}={value}" for key, value in MODEL.items()),
        "model.activation_checkpointing=true",
        f"data.seq_len={args.seq}",
        "train.global_batch=1",
        "train.micro_batch=1",
        "train.dtype=bf16",
        f"train.steps={max(1000, args.warmup + args.steps)}",
        "mesh.dp=1",
        "mesh.cp=1",
        f"zero.stage={args.zero}",
        f"attention.kernel={args.kernel}",
        f"checkpoint.snapshot_every={snapshot_every}",
        "cluster.device=cuda",
    ]


def _timed_steps(step: Any, args: argparse.Namespace) -> tuple[list[float], list[float]]:
    """Step times (s) and losses of the timed steps, after the untimed warm-up steps."""
    times, losses = [], []
    for i in range(args.warmup + args.steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = step()
        torch.cuda.synchronize()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
            losses.append(loss)
    return times, losses


def run_trainer(args: argparse.Namespace, snapshot_every: int) -> dict[str, Any]:
    import logging

    import torch.distributed as dist
    from deepspeed.utils import logger as ds_logger

    from ringtrain import config
    from ringtrain.train.model import num_params
    from ringtrain.train.trainer import Trainer, set_rank_env

    ds_logger.setLevel(logging.WARNING)
    device = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.set_device(device)
    set_rank_env(rank=0, world_size=1, device=device)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=device)
    trainer = Trainer(config.load(None, job_overrides(args, snapshot_every=snapshot_every)), rank=0, device=device)
    reports: list[Any] = []

    def step() -> float:
        reports.append(trainer.train_step())
        return reports[-1].loss

    try:
        times, losses = _timed_steps(step, args)
        return {
            "step_s": times,
            "losses": losses,
            "tokens_per_step": reports[-1].num_tokens,
            "num_params": num_params(trainer.model),
            "peak_memory_bytes": max(r.memory_bytes for r in reports),
        }
    finally:
        trainer.close()


def run_plain(args: argparse.Namespace) -> dict[str, Any]:
    import torch.nn.functional as F

    from ringtrain import config
    from ringtrain.train.attention import build_attention
    from ringtrain.train.engine import param_groups
    from ringtrain.train.model import num_params
    from ringtrain.train.trainer import build_model

    device = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.set_device(device)
    job = config.load(None, job_overrides(args, snapshot_every=0))
    t = job.train
    attention_fn = build_attention("local", job.attention.kernel, ring_group=None, ulysses_group=None)
    model = build_model(job, attention_fn).to(device=device, dtype=torch.bfloat16)
    model.train()
    weights = list(model.parameters())
    masters = {id(p): p.detach().float().clone() for p in weights}
    groups = [
        {"params": [masters[id(p)] for p in group["params"]], "weight_decay": group["weight_decay"]}
        for group in param_groups(model, t.weight_decay)
    ]
    optimizer = torch.optim.AdamW(groups, lr=t.lr, betas=(t.beta1, t.beta2), eps=1e-8)
    gen = torch.Generator(device=device).manual_seed(0)
    tokens = torch.randint(0, MODEL["vocab_size"], (1, args.seq + 1), device=device, generator=gen)
    input_ids, labels = tokens[:, :-1], tokens[:, 1:]
    positions = torch.arange(args.seq, device=device)[None]

    def step() -> float:
        logits = model(input_ids, positions)
        loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())
        loss.backward()
        for p in weights:
            assert p.grad is not None
            masters[id(p)].grad = p.grad.float()
            p.grad = None
        torch.nn.utils.clip_grad_norm_(list(masters.values()), t.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            for p in weights:
                p.copy_(masters[id(p)])
        return float(loss.item())  # the Trainer reports each step's loss too

    torch.cuda.reset_peak_memory_stats(device)
    times, losses = _timed_steps(step, args)
    return {
        "step_s": times,
        "losses": losses,
        "tokens_per_step": args.seq,
        "num_params": num_params(model),
        "peak_memory_bytes": int(torch.cuda.max_memory_allocated(device)),
    }


def _variant_main(kind: str, args: argparse.Namespace, results: Any) -> None:
    try:
        if kind == "plain":
            out = run_plain(args)
        elif kind == "trainer":
            out = run_trainer(args, snapshot_every=0)
        else:
            out = run_trainer(args, snapshot_every=args.snapshot_every)
        results.put(out)
    except BaseException:  # noqa: BLE001 - reported by the parent, which decides the exit code
        results.put({"error": traceback.format_exc()})


def run_variant(kind: str, args: argparse.Namespace) -> dict[str, Any]:
    """``kind`` in a spawned process of its own; its result, or {"error": ...}."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    proc = ctx.Process(target=_variant_main, args=(kind, args, results))
    proc.start()
    try:
        out: dict[str, Any] = results.get(timeout=args.timeout)
    except queue.Empty:
        out = {"error": f"no result within {args.timeout:g} s"}
    finally:
        proc.join(timeout=60)
        if proc.is_alive():
            proc.kill()
            proc.join()
    if "error" not in out:
        median = statistics.median(out["step_s"])
        out["median_step_s"] = median
        out["tokens_per_s"] = out["tokens_per_step"] / median
    return out


def peak_flops(device_name: str, override_tflops: Optional[float]) -> tuple[Optional[float], str]:
    """The device's peak dense bf16 FLOP/s and where the number comes from (None: unknown)."""
    from ringtrain.planner.devices import DEVICES

    if override_tflops:
        return override_tflops * 1e12, "--peak-tflops"
    lowered = device_name.lower()
    for name, spec in DEVICES.items():
        if name in lowered:
            if "pcie" in lowered or "nvl" in lowered:
                return None, f"{device_name} is not the SXM part of the planner's table; pass --peak-tflops"
            return spec.peak_flops, f"ringtrain.planner.devices ({name})"
    return None, f"{device_name} is not in ringtrain.planner.devices; pass --peak-tflops"


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, default=32768, help="tokens per sequence (one sequence per step)")
    p.add_argument("--steps", type=int, default=6, help="timed steps per variant")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    p.add_argument("--kernel", default="auto", help="attention kernel for both variants")
    p.add_argument("--zero", type=int, default=2, help="ringtrain's ZeRO stage")
    p.add_argument("--snapshot-every", type=int, default=0, help="also time the Trainer snapshotting every N steps")
    p.add_argument("--peak-tflops", type=float, default=None, help="peak dense bf16 TFLOP/s of a GPU the table lacks")
    p.add_argument("--timeout", type=float, default=1200.0, help="seconds per variant")
    p.add_argument("--check", action="store_true", help="exit 1 when a target is missed")
    return p.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print(
            f"bench/train.py needs a CUDA GPU: this torch ({torch.__version__}, CUDA build "
            f"{torch.version.cuda or 'none'}) sees none. Run it (or make gpu-check) on a GPU machine.",
            file=sys.stderr,
        )
        return EXIT_NO_CUDA
    from ringtrain import config
    from ringtrain.planner.models import from_job
    from ringtrain.planner.throughput import flops_per_token
    from ringtrain.train.attention.kernels import resolve_kernel

    run = Run("train")
    # Fewer allocator retries at 32K tokens; the same setting for every variant.
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    job = config.load(None, job_overrides(args, snapshot_every=0))
    head_dim = MODEL["dim"] // MODEL["n_heads"]
    like = torch.empty(1, 2, MODEL["n_heads"], head_dim, device="cuda", dtype=torch.bfloat16)
    kernel = resolve_kernel(args.kernel, like).name
    model_flops, executed_flops = flops_per_token(from_job(job), args.seq, checkpointing=True)
    device_name = torch.cuda.get_device_name()
    peak, peak_source = peak_flops(device_name, args.peak_tflops)
    print(f"{device_name}: ~1B Llama, {args.seq} tokens per step, kernel {kernel}, ZeRO-{args.zero}; "
          f"{model_flops / 1e9:.2f} GFLOP per token (model), peak {peak_source}")

    kinds = ["plain", "trainer"] + (["trainer_snapshots"] if args.snapshot_every else [])
    variants: dict[str, dict[str, Any]] = {}
    for kind in kinds:
        out = variants[kind] = run_variant(kind, args)
        if "error" in out:
            print(f"{kind}: FAILED\n{out['error']}", file=sys.stderr)
            continue
        if peak is not None:
            out["mfu"] = model_flops * out["tokens_per_s"] / peak
            out["hfu"] = executed_flops * out["tokens_per_s"] / peak  # recomputation counted
        mfu = f", MFU {out['mfu']:.1%}" if "mfu" in out else ""
        print(f"{kind}: {out['tokens_per_s']:,.0f} tokens/s, {out['median_step_s']:.3f} s/step{mfu}, "
              f"peak memory {out['peak_memory_bytes'] / 2**30:.1f} GiB, {out['num_params'] / 1e9:.2f}B parameters")

    plain, trainer = variants["plain"], variants["trainer"]
    failed = [kind for kind, out in variants.items() if "error" in out]
    ratio = trainer["tokens_per_s"] / plain["tokens_per_s"] if not {"plain", "trainer"} & set(failed) else None
    targets = {
        "mfu_min": MFU_TARGET,
        "trainer_over_plain_min": PARITY_TARGET,
        "mfu_ok": bool(trainer.get("mfu") is not None and trainer["mfu"] >= MFU_TARGET),
        "parity_ok": bool(ratio is not None and ratio >= PARITY_TARGET),
    }
    if ratio is not None:
        print(f"ringtrain / plain PyTorch tokens/s: {ratio:.3f} (target >= {PARITY_TARGET}): "
              f"{'PASS' if targets['parity_ok'] else 'MISS'}")
    if trainer.get("mfu") is not None:
        verdict = "PASS" if targets["mfu_ok"] else "MISS"
        print(f"ringtrain MFU {trainer['mfu']:.1%} (target >= {MFU_TARGET:.0%}): {verdict}")
    else:
        print(f"ringtrain MFU: not computed ({peak_source})")

    result = {
        "config": vars(args),
        "model": {**MODEL, "head_dim": head_dim, "activation_checkpointing": True,
                  "model_flops_per_token": model_flops, "executed_flops_per_token": executed_flops},
        "kernel": kernel,
        "peak_flops": peak,
        "peak_flops_source": peak_source,
        "variants": variants,
        "trainer_over_plain": ratio,
        "targets": targets,
    }
    slug = re.sub(r"[^A-Za-z0-9]+", "-", device_name).strip("-").lower()
    run.write(result, device_type="cuda", out=RESULTS_DIR / f"train-{slug}.json")
    if failed:
        return 1
    if args.check and not (targets["mfu_ok"] and targets["parity_ok"]):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
