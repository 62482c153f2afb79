"""Measured vs predicted peak memory per rank of small jobs trained on CPU (gloo ranks, fp32).

Each config trains through ringtrain's own Trainer on real gloo ranks (spawned processes,
FileStore rendezvous), as tests/dist/test_equivalence.py does. The measurement is the peak of
torch-allocated CPU memory during the training steps, relative to just before the Trainer is
built: a ``TorchDispatchMode`` adds up the bytes of every live tensor storage (see
``StoragePeak``), which counts the same things the planner predicts (parameters, gradients,
optimizer states, DeepSpeed's buffers, activations and the backward's working set) and nothing
outside torch (the data's numpy arrays, gloo's own buffers).

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

    PYTHONPATH=platform python bench/planner_memory.py   # writes bench/results/planner_memory-cpu.json
"""

from __future__ import annotations

import dataclasses
import gc
import queue
import sys
import tempfile
import threading
import time
import weakref
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from record import Run  # noqa: E402
from try_process import context, try_process  # noqa: E402

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


class StoragePeak:
    """Live bytes of every tensor storage created while active, and their peak.

    A ``TorchDispatchMode`` sees every op's outputs, autograd's backward ops included (on CPU
    they run on the calling thread). Each new storage is counted once, however many views
    share it, and a weakref finalizer takes it off when the storage dies, on whichever thread
    drops the last reference (gloo's worker threads do for some communication buffers).
    Storages that already existed when the mode was entered are not counted.
    """

    def __init__(self) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        tracker = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
                out = func(*args, **(kwargs or {}))
                tracker._observe(out)
                return out

        self.mode = _Mode()
        self.live: dict[int, int] = {}
        self.current = 0
        self.peak = 0
        self._lock = threading.Lock()

    def _observe(self, out: Any) -> None:
        import torch
        from torch.utils._pytree import tree_leaves

        for leaf in tree_leaves(out):
            if not isinstance(leaf, torch.Tensor) or leaf.device.type != "cpu":
                continue
            storage = leaf.untyped_storage()
            key, nbytes = id(storage), storage.nbytes()
            with self._lock:
                known = key in self.live
                self.current += nbytes - self.live.get(key, 0)  # in-place resizes change nbytes
                self.live[key] = nbytes
            if not known:
                weakref.finalize(storage, self._forget, key)
        self.peak = max(self.peak, self.current)

    def _forget(self, key: int) -> None:
        with self._lock:
            self.current -= self.live.pop(key, 0)

    def reset_peak(self) -> None:
        self.peak = self.current


def _measure(job: Any, rank: int) -> int:
    import torch

    from ringtrain.train.trainer import Trainer

    gc.collect()
    tracker = StoragePeak()
    with tracker.mode:
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
    import torch
    import torch.distributed as dist

    from ringtrain import config
    from ringtrain.train.trainer import set_rank_env

    torch.set_num_threads(1)
    device = torch.device("cpu")
    set_rank_env(rank=rank, world_size=world, device=device)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    try:
        peaks = {name: _measure(config.load(None, job_overrides(ov)), rank) for name, ov in configs.items()}
        # Every rank of these layouts holds the same amount; report the largest.
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, peaks)
        if rank == 0:
            results.put({name: max(p[name] for p in gathered) for name in configs})
    except BaseException as exc:  # surface the rank's failure instead of a queue timeout
        results.put(exc)
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _wait(results: Any, procs: list[Any], timeout_s: float, names: list[str]) -> Any:
    """The ranks' answer, or an error as soon as a rank died without one or time ran out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            return results.get(timeout=1)
        except queue.Empty:
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if dead:
                return RuntimeError(f"a rank measuring {names} exited with code {dead[0]}")
    return RuntimeError(f"no measurement of {names} within {timeout_s} s")


def measure(configs: dict[str, list[str]], *, timeout_s: float = 300) -> dict[str, int]:
    """Peak torch-allocated bytes per rank of each config; configs of one world size share processes."""
    from ringtrain import config

    by_world: dict[int, dict[str, list[str]]] = {}
    for name, ov in configs.items():
        by_world.setdefault(config.load(None, ov).world_size, {})[name] = ov
    out: dict[str, int] = {}
    for world, group in by_world.items():
        results = context("cpu").Queue()  # the ranks train on the CPU: forked, not spawned
        with tempfile.TemporaryDirectory() as tmp:
            store = str(Path(tmp) / "store")
            procs = [try_process("cpu", _rank_main, r, world, store, group, results) for r in range(world)]
            for p in procs:
                p.start()
            try:
                got = _wait(results, procs, timeout_s, sorted(group))
            finally:
                for p in procs:
                    p.join(timeout=30)
                    if p.is_alive():
                        p.kill()
        if isinstance(got, BaseException):
            raise got
        out.update(got)
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


def main() -> int:
    run = Run("planner_memory")
    rows = compare({**CONFIGS, **SAVER_CONFIGS, **ZERO_OFFLOAD_CONFIGS, **EXTRA_CONFIGS})
    print(f"{'config':<18} {'predicted MB':>13} {'measured MB':>12} {'ratio':>6} {'w/o buffers':>12}")
    for row in rows:
        print(
            f"{row['config']:<18} {row['predicted']['total'] / 1e6:>13.2f} {row['measured'] / 1e6:>12.2f} "
            f"{row['ratio']:>6.3f} {row['ratio_without_zero_buffers']:>12.3f}"
        )
    run.write({"dtype": "fp32", "steps": STEPS, "rows": rows}, device_type="cpu")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT / "platform"))
    sys.exit(main())
