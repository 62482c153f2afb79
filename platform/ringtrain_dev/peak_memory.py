"""The planner's peak memory per rank against the peak measured training small jobs on CPU (gloo
ranks, fp32): shared by tests/dist/test_planner_memory.py and bench/planner_memory.py.

Each config trains through ringtrain's own Trainer on real gloo ranks (``ranks``). The
measurement is the peak of torch-allocated CPU memory during the training steps, relative to
just before the Trainer is built: ``LiveBytes`` adds up the bytes of every live tensor storage,
which counts the same things the planner predicts (parameters, gradients, optimizer states,
DeepSpeed's buffers, activations and the backward's working set) and nothing outside torch (the
data's numpy arrays, gloo's own buffers).

Two choices make the run measure the steady state the planner models:

- Each config runs two optimizer steps of two micro batches: Adam's moments exist from the
  first step on, and gradients are resident from the second micro batch on.
- Python's cycle collector runs between optimizer steps. DeepSpeed's ZeRO-1 step leaves a
  reference cycle holding a gradient-sized buffer that otherwise lives until the collector
  happens to run; the collection makes the number depend on the model, not on GC timing.

In-memory snapshots are switched off (``checkpoint.snapshot_every=0`` where the config has
it): on a GPU they live in host memory, so the planner does not count them.

The reference is the planner's estimate for the same config with ``device_type="cpu"``
(fp32 training). This measures CPU only; peak memory on a GPU (bf16, CUDA allocator) needs a
GPU machine and is left to a run there.
"""

from __future__ import annotations

import dataclasses
import gc
import tempfile
from pathlib import Path
from typing import Any

from ringtrain_dev.live_bytes import LiveBytes
from ringtrain_dev.ranks import gloo_rank, run_ranks

STEPS = 2

# The quickstart model (jobs/quickstart.yaml) and a wider one whose model states weigh more.
QUICKSTART = ["model.dim=128", "model.n_layers=4", "model.n_heads=4", "model.n_kv_heads=2"]
WIDE = ["model.dim=256", "model.n_layers=4", "model.n_heads=4", "model.n_kv_heads=2"]

# Two ranks each (the tests run these): every ZeRO stage, ring and Ulysses, checkpointing, the
# unfused kernel.
CONFIGS: dict[str, list[str]] = {
    "ring-zero0": QUICKSTART + ["data.seq_len=2048", "mesh.dp=1", "mesh.cp=2", "attention.impl=ring", "zero.stage=0"],
    "ulysses-zero2": QUICKSTART
    + ["data.seq_len=2048", "mesh.dp=1", "mesh.cp=2", "attention.impl=ulysses", "zero.stage=2"],
    "dp2-zero1-ckpt": WIDE
    + ["data.seq_len=1024", "mesh.dp=2", "mesh.cp=1", "zero.stage=1", "model.activation_checkpointing=full"],
    "dp2-zero3": WIDE + ["data.seq_len=512", "mesh.dp=2", "mesh.cp=1", "zero.stage=3"],
    "ring-math-zero0": QUICKSTART
    + ["data.seq_len=1024", "mesh.dp=1", "mesh.cp=2", "attention.kernel=math", "zero.stage=0"],
}
# The long-context savers, each alone and combined, on the ring-zero0 layout with a vocabulary
# large enough for the loss to matter (train/loss.py, train/offload.py, train/recompute.py).
SAVERS_BASE = QUICKSTART + [
    "model.vocab_size=8192", "data.seq_len=2048", "mesh.dp=1", "mesh.cp=2", "attention.impl=ring", "zero.stage=0"
]
SAVER_CONFIGS: dict[str, list[str]] = {
    "savers-selective": SAVERS_BASE + ["model.activation_checkpointing=selective"],
    "savers-tiles": SAVERS_BASE + ["model.mlp_tiles=4"],
    "savers-chunked-loss": SAVERS_BASE + ["train.loss_chunk_tokens=128"],
    "savers-offload": SAVERS_BASE + ["model.activation_offload_layers=2"],
    "savers-all": SAVERS_BASE
    + [
        "model.activation_checkpointing=full",
        "model.mlp_tiles=4",
        "train.loss_chunk_tokens=128",
        "model.activation_offload_layers=4",
    ],
    "savers-selective-chunked": SAVERS_BASE + ["model.activation_checkpointing=selective", "train.loss_chunk_tokens=128"],
}
# ZeRO optimizer offload (stage 3): on CPU only the sum of what stays and what moves is checked.
ZERO_OFFLOAD_CONFIGS: dict[str, list[str]] = {
    "dp2-zero3-opt-offload": WIDE + ["data.seq_len=512", "mesh.dp=2", "mesh.cp=1", "zero.stage=3", "zero.offload_optimizer=true"],
}
# Four ranks: measured by the bench only, to keep the test tier quick on small machines.
EXTRA_CONFIGS: dict[str, list[str]] = {
    "hybrid-zero2": QUICKSTART
    + ["data.seq_len=2048", "mesh.dp=1", "mesh.cp=4", "mesh.ulysses=2", "attention.impl=hybrid", "zero.stage=2"],
}


def job_overrides(overrides: list[str]) -> list[str]:
    """``overrides`` plus two micro batches per rank per step and no snapshots (see module doc)."""
    from ringtrain import config

    job = config.load(None, overrides)
    extra = [f"train.global_batch={2 * job.mesh.dp * job.train.micro_batch}", f"train.steps={STEPS}"]
    if hasattr(job, "checkpoint") and hasattr(job.checkpoint, "snapshot_every"):
        extra.append("checkpoint.snapshot_every=0")
    return overrides + extra


def predict(overrides: list[str]) -> dict[str, int]:
    """The planner's per-rank breakdown for the config, on CPU."""
    from ringtrain import config
    from ringtrain.planner.layout import layout_of, workload_of
    from ringtrain.planner.memory import estimate

    job = config.load(None, job_overrides(overrides))
    est = estimate(workload_of(job, "cpu"), layout_of(job))
    # On CPU the offloaded activations' "host" copies, and ZeRO offload's host states, are in the
    # same memory the measurement counts: they are added back. So on CPU the check is that offload
    # moves bytes without adding any; which side of PCIe they sit on is for a GPU to measure.
    states_host = estimate(workload_of(job, "cpu"), dataclasses.replace(layout_of(job), offload_layers=0)).host
    offloaded = est.host - states_host
    return {
        "offloaded_activations": offloaded,
        "offloaded_states": states_host,
        "params": est.params,
        "grads": est.grads,
        "optimizer": est.optimizer,
        "zero_buffers": est.zero_buffers,
        "activations": est.activations,
        "total": est.total + offloaded + states_host,
    }


def _measure(job: Any, rank: int) -> int:
    import torch

    from ringtrain.train.trainer import Trainer

    gc.collect()
    tracker = LiveBytes("cpu")
    with tracker:
        trainer = Trainer(job, rank=rank, device=torch.device("cpu"))
        tracker.reset_peak()  # building the engine copies parameters once; training is what counts
        for _ in range(STEPS):
            trainer.train_step()
            gc.collect()
    peak = tracker.peak
    del trainer
    gc.collect()
    return peak


def _rank_main(rank: int, world: int, store_path: str, configs: dict[str, list[str]], results: Any) -> None:
    import torch.distributed as dist

    from ringtrain import config

    with gloo_rank(rank, world, store_path, results):
        peaks = {name: _measure(config.load(None, job_overrides(ov)), rank) for name, ov in configs.items()}
        # Every rank of these layouts holds the same amount; report the largest.
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, peaks)
        if rank == 0:
            results.put({name: max(p[name] for p in gathered) for name in configs})


def measure(configs: dict[str, list[str]], *, timeout_s: float = 300) -> dict[str, int]:
    """Peak torch-allocated bytes per rank of each config; configs of one world size share processes."""
    from ringtrain import config

    by_world: dict[int, dict[str, list[str]]] = {}
    for name, ov in configs.items():
        by_world.setdefault(config.load(None, ov).world_size, {})[name] = ov
    out: dict[str, int] = {}
    for world, group in by_world.items():
        with tempfile.TemporaryDirectory() as tmp:
            # the ranks train on the CPU: forked, not spawned, on a GPU machine too
            out.update(run_ranks(_rank_main, world, Path(tmp), group, timeout=timeout_s, device="cpu"))
    return out


def compare(configs: dict[str, list[str]]) -> list[dict[str, Any]]:
    """One row per config: overrides, predicted breakdown, measured peak, ratio measured / predicted."""
    measured = measure(configs)
    rows = []
    for name, ov in configs.items():
        pred = predict(ov)
        bucket = pred["zero_buffers"]
        rows.append(
            {
                "config": name,
                "overrides": job_overrides(ov),
                "predicted": pred,
                "measured": measured[name],
                "ratio": measured[name] / pred["total"],
                # DeepSpeed's 5e8-element reduce bucket dwarfs a small model on CPU; the ratio
                # without it shows how well the rest is predicted.
                "ratio_without_zero_buffers": (measured[name] - bucket) / (pred["total"] - bucket),
            }
        )
    return rows
