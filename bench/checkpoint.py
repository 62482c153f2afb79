"""Benchmark: what per-step snapshots cost the step, and how fast a snapshot is persisted and restored.

Four ranks (dp=2 x cp=2, ZeRO-2 by default) train the quickstart model (jobs/quickstart.yaml:
dim 128, 4 layers, 4 heads, 2 KV heads, seq 2048, global batch 4) through ringtrain's own
Trainer, as tests/dist/test_equivalence.py does (spawned processes, FileStore rendezvous).

- Step-time overhead: in the same processes and the same run, blocks of steps with snapshots on
  (the Trainer's Snapshotter as built, a capture every step) alternate with blocks with them
  off (``trainer.snapshotter = None`` for the block). The blocks run in an on/off/off/on order,
  so a linear drift (caches, allocator, thermal) weighs on both modes alike. A step's time is
  the wall time of ``train_step()`` (the capture it starts included), maximum over ranks; the
  last step of an "on" block also waits for its snapshot to finish, so a block's snapshot tail
  is charged to "on" rather than leaking into the next "off" block. Snapshots go to a
  SnapshotHolder in the rank's own process (the stand-in for the node's holder actor), so the
  private copy the holder keeps is part of the cost. Three more views of the same steps: the
  median step, the median ratio of neighbouring on/off blocks (robust to bursts of outside
  load on a shared machine), and the CPU time of a step summed over ranks (the extra work
  itself, which outside load barely changes).
- Snapshot throughput: bytes per rank over ``Snapshot.total_s`` (copy + encode + checksum) and
  over ``Snapshot.copy_s`` (the part the next optimizer step may wait for).
- Persist throughput: every rank's blob of one step is gathered to rank 0 and saved to a
  ``file://`` store, as the Persister does (``CheckpointRef.bytes_per_second``); then read back
  with ``latest_valid`` (every shard verified).
- Restore: ``trainer.restore(blobs)`` (decode + FragmentIndex + load) on every rank, maximum
  over ranks, after one more step moved the state on; the restored parameters must equal the
  ones at the snapshot's step.

The baseline of the ratio is the "off" blocks of the same run. Target: <= 1.02 on GPU, <= 1.05
on the CPU testbed. With CUDA and at least world-size GPUs it runs one rank per GPU over NCCL.

    PYTHONPATH=platform python bench/checkpoint.py [--stage 2] [--blocks 12] [--steps 4] [--dim 128]

Writes bench/results/checkpoint-<cpu|cuda>.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import platform
import queue
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = ROOT / "bench" / "results"
MB = 1e6
TARGET = {"cpu": 1.05, "cuda": 1.02}


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stage", type=int, default=2, help="ZeRO stage (0-3)")
    p.add_argument("--blocks", type=int, default=12, help="timed blocks, half with snapshots on")
    p.add_argument("--steps", type=int, default=4, help="steps per block")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per mode before the blocks")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--dp", type=int, default=2)
    p.add_argument("--cp", type=int, default=2)
    p.add_argument("--restores", type=int, default=3, help="timed restores (median reported)")
    p.add_argument("--persists", type=int, default=3, help="timed saves to the file store (median reported)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds to wait for the ranks")
    p.add_argument("--out", type=Path, default=None, help="default: bench/results/checkpoint-<device>.json")
    args = p.parse_args(argv)
    if args.blocks < 2 or args.steps < 1:
        p.error("--blocks must be >= 2 (both modes need a block) and --steps >= 1")
    return args


def overrides(args: argparse.Namespace) -> list[str]:
    # The schedule spans every step this run takes, so no step is the run's last (which the
    # Trainer always snapshots) and the learning rate never hits an edge of the schedule.
    total = 2 * args.warmup + args.blocks * args.steps + 8
    return [
        "model.vocab_size=256",
        f"model.dim={args.dim}",
        f"model.n_layers={args.layers}",
        "model.n_heads=4",
        "model.n_kv_heads=2",
        f"data.seq_len={args.seq_len}",
        f"mesh.dp={args.dp}",
        f"mesh.cp={args.cp}",
        "attention.impl=ring",
        f"zero.stage={args.stage}",
        "train.global_batch=4",
        "train.micro_batch=1",
        "train.lr=3e-3",
        f"train.warmup_steps={min(15, total // 4)}",
        f"train.steps={total}",
        "checkpoint.snapshot_every=1",
        "checkpoint.persist_every=0",
    ]


def schedule(num_blocks: int) -> list[bool]:
    """on, off, off, on, on, off, ...: both modes see the same mean position in the run."""
    return [b % 4 in (0, 3) for b in range(num_blocks)]


def machine_busy_s() -> float | None:
    """CPU seconds every process on this machine has used since boot (Linux), or None."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    except OSError:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def children_cpu_s() -> float:
    t = os.times()
    return t.children_user + t.children_system


def use_cuda(world: int) -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.device_count() >= world


# --- one rank -----------------------------------------------------------------------------------


def _rank_main(
    rank: int, world: int, rendezvous: str, ckpt_root: str, args: argparse.Namespace, results: Any
) -> None:
    import logging

    import torch
    import torch.distributed as dist

    from ringtrain import config
    from ringtrain.train.trainer import set_rank_env

    torch.set_num_threads(1)
    cuda = use_cuda(world)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    set_rank_env(rank=rank, world_size=world, device=device)
    dist.init_process_group(
        "nccl" if cuda else "gloo", store=dist.FileStore(rendezvous, world), rank=rank, world_size=world
    )
    try:
        from deepspeed.utils import logger as ds_logger

        ds_logger.setLevel(logging.WARNING)
        logging.getLogger("ringtrain.checkpoint.store").setLevel(logging.WARNING)
        job = config.load(None, overrides(args))
        out = _measure(job, rank, world, device, ckpt_root, args)
        gathered: list[Any] = [None] * world if rank == 0 else []
        dist.gather_object(out, gathered if rank == 0 else None, dst=0)
        if rank == 0:
            results.put(gathered)
    except BaseException as exc:  # surface the rank's failure instead of a queue timeout
        results.put(exc)
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _measure(
    job: Any, rank: int, world: int, device: Any, ckpt_root: str, args: argparse.Namespace
) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from ringtrain.actors.holder import SnapshotHolder
    from ringtrain.actors.persister import shard_name
    from ringtrain.actors.resume import checkpoint_meta, incompatibility
    from ringtrain.checkpoint import open_store
    from ringtrain.train.snapshot import FragmentIndex, Snapshot, decode
    from ringtrain.train.trainer import Trainer

    holder = SnapshotHolder(keep=job.checkpoint.keep_in_memory)
    snaps: list[dict[str, Any]] = []

    def deliver(snap: Snapshot) -> None:
        t0 = time.perf_counter()
        holder.put(snap.rank, snap.step, snap.world_size, snap.blob, snap.checksum)
        snaps.append(
            {"step": snap.step, "bytes": snap.num_bytes, "copy_s": snap.copy_s, "total_s": snap.total_s,
             "holder_put_s": time.perf_counter() - t0}
        )

    trainer = Trainer(job, rank=rank, device=device, deliver=deliver)
    snapshotter = trainer.snapshotter
    assert snapshotter is not None, "checkpoint.snapshot_every=1 builds a Snapshotter"

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def timed_step(drain: bool) -> tuple[float, float, float]:
        sync()
        t0, cpu0 = time.perf_counter(), time.process_time()
        report = trainer.train_step()
        if drain:
            snapshotter.wait()
        sync()
        # process_time counts every thread of the rank (main, snapshot, gloo): the work itself,
        # which other load on the machine barely changes, where wall time is what it costs.
        return time.perf_counter() - t0, report.step_time_s, time.process_time() - cpu0

    # Warm up both paths: allocator, gloo buffers, the snapshot's host buffers.
    for on in (True, False):
        trainer.snapshotter = snapshotter if on else None
        for i in range(args.warmup):
            timed_step(drain=on and i == args.warmup - 1)
    first_timed = trainer.step + 1

    steps: list[dict[str, Any]] = []
    for block, on in enumerate(schedule(args.blocks)):
        trainer.snapshotter = snapshotter if on else None
        for i in range(args.steps):
            wall, inner, cpu = timed_step(drain=on and i == args.steps - 1)
            steps.append(
                {"step": trainer.step, "block": block, "on": on, "wall_s": wall, "train_s": inner, "cpu_s": cpu}
            )
    trainer.snapshotter = snapshotter

    # One more step, so the snapshot used below is one this rank's holder has too.
    trainer.train_step()
    step = trainer.step
    snap = trainer.snapshot(step)
    held = holder.get(rank, step)
    assert held == snap.blob, "the holder keeps a byte-identical copy"

    # Persist: every rank's shard to rank 0, saved as the Persister does.
    gathered: list[Any] = [None] * world if rank == 0 else []
    t0 = time.perf_counter()
    dist.gather_object(snap.blob, gathered if rank == 0 else None, dst=0)
    gather_s = time.perf_counter() - t0
    persist: list[dict[str, Any]] = []
    readback: list[float] = []
    if rank == 0:
        shards = {shard_name(r): blob for r, blob in enumerate(gathered)}
        meta = dict(checkpoint_meta(job), step=step, world_size=world)
        for rep in range(args.persists):
            store = open_store(Path(ckpt_root, f"rep-{rep}").as_uri(), keep=1)
            ref = store.save(step, shards, meta)
            persist.append({"bytes": ref.num_bytes, "seconds": ref.seconds, "bytes_per_second": ref.bytes_per_second})
            t1 = time.perf_counter()
            loaded = store.latest_valid(incompatibility(job))
            readback.append(time.perf_counter() - t1)
            assert loaded is not None and loaded.step == step
            assert all(loaded.shards[name] == blob for name, blob in shards.items())

    # Restore: every rank loads every rank's shard, after one more step moved the state on.
    blobs: list[Any] = [None] * world
    dist.all_gather_object(blobs, snap.blob)
    expected = trainer.parameters_fp32()
    trainer.snapshotter = None
    trainer.train_step()
    moved = max(float((trainer.parameters_fp32()[k] - v).abs().max()) for k, v in expected.items())
    restores: list[dict[str, float]] = []
    for _ in range(args.restores):
        dist.barrier()
        t0 = time.perf_counter()
        index = FragmentIndex([decode(b) for b in blobs])
        t1 = time.perf_counter()
        resumed = trainer.restore(blobs)
        sync()
        t2 = time.perf_counter()
        assert resumed == step and index.step == step
        restores.append({"decode_index_s": t1 - t0, "restore_s": t2 - t1})
    restored = trainer.parameters_fp32()
    diff = max(float((restored[k] - v).abs().max()) for k, v in expected.items())
    trainer.snapshotter = snapshotter

    timed_snaps = [s for s in snaps if s["step"] >= first_timed and s["step"] <= steps[-1]["step"]]
    snapshotter.close()
    return {
        "rank": rank,
        "steps": steps,
        "snapshots": timed_snaps,
        "snapshot_errors": [repr(e) for e in snapshotter.errors],
        "holder_bytes": holder.num_bytes(),
        "gather_s": gather_s,
        "persist": persist,
        "readback_s": readback,
        "restores": restores,
        "restore_param_max_abs_diff": diff,
        "param_change_by_one_step": moved,
    }


# --- the driver ---------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    world = args.dp * args.cp
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="ringtrain-bench-ckpt-") as tmp:
        rendezvous = str(Path(tmp) / "rendezvous")
        ckpt_root = str(Path(tmp) / "checkpoints")
        procs = [
            ctx.Process(target=_rank_main, args=(r, world, rendezvous, ckpt_root, args, results))
            for r in range(world)
        ]
        for p in procs:
            p.start()
        try:
            got = results.get(timeout=args.timeout)
        except queue.Empty:
            got = RuntimeError(f"no result from the ranks within {args.timeout} s")
        finally:
            for p in procs:
                p.join(timeout=60)
                if p.is_alive():
                    p.kill()
    if isinstance(got, BaseException):
        raise got
    return sorted(got, key=lambda r: r["rank"])


def summarize(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    # Ranks meet in collectives every step, so a step takes as long as its slowest rank; the
    # CPU time of a step is summed over ranks (the work the whole job did).
    per_step: dict[int, dict[str, Any]] = {}
    for r in ranks:
        for s in r["steps"]:
            row = per_step.setdefault(
                s["step"], {"on": s["on"], "block": s["block"], "wall_s": 0.0, "train_s": 0.0, "cpu_s": 0.0}
            )
            row["wall_s"] = max(row["wall_s"], s["wall_s"])
            row["train_s"] = max(row["train_s"], s["train_s"])
            row["cpu_s"] += s["cpu_s"]
    modes: dict[str, dict[str, Any]] = {}
    for name, on in (("on", True), ("off", False)):
        rows = [row for row in per_step.values() if row["on"] == on]
        walls = [row["wall_s"] for row in rows]
        modes[name] = {
            "num_steps": len(walls),
            "mean_s": statistics.fmean(walls),
            "median_s": statistics.median(walls),
            "stdev_s": statistics.stdev(walls) if len(walls) > 1 else 0.0,
            "min_s": min(walls),
            "max_s": max(walls),
            # StepReport.step_time_s: forward, backward and optimizer step, without the capture.
            "train_mean_s": statistics.fmean(row["train_s"] for row in rows),
            "cpu_mean_s": statistics.fmean(row["cpu_s"] for row in rows),
            "steps_s": walls,
        }
    blocks: dict[int, dict[str, Any]] = {}
    for row in per_step.values():
        block = blocks.setdefault(row["block"], {"block": row["block"], "on": row["on"], "walls": []})
        block["walls"].append(row["wall_s"])
    block_means = [
        {"block": b["block"], "on": b["on"], "mean_s": statistics.fmean(b["walls"])}
        for _, b in sorted(blocks.items())
    ]
    # Neighbouring blocks (one on, one off) share the machine's state of the moment, so their
    # ratio cancels slow changes in outside load; the median of those ratios resists bursts.
    pairs = [
        (a["mean_s"] / b["mean_s"]) if a["on"] else (b["mean_s"] / a["mean_s"])
        for a, b in zip(block_means[0::2], block_means[1::2])
        if a["on"] != b["on"]
    ]

    snaps = [s for r in ranks for s in r["snapshots"]]
    bytes_per_rank = {r["rank"]: max((s["bytes"] for s in r["snapshots"]), default=0) for r in ranks}
    persist = ranks[0]["persist"]
    num_restores = len(ranks[0]["restores"])
    restore = [max(r["restores"][i]["restore_s"] for r in ranks) for i in range(num_restores)]
    decode_index = [max(r["restores"][i]["decode_index_s"] for r in ranks) for i in range(num_restores)]
    return {
        "ratio_mean": modes["on"]["mean_s"] / modes["off"]["mean_s"],
        "ratio_median": modes["on"]["median_s"] / modes["off"]["median_s"],
        "ratio_paired_blocks": statistics.median(pairs) if pairs else None,
        "ratio_cpu": modes["on"]["cpu_mean_s"] / modes["off"]["cpu_mean_s"],
        "modes": modes,
        "blocks": block_means,
        "snapshot": {
            "num_snapshots": len(snaps),
            "bytes_per_rank": bytes_per_rank,
            "total_bytes": sum(bytes_per_rank.values()),
            "copy_s_median": statistics.median(s["copy_s"] for s in snaps),
            "total_s_median": statistics.median(s["total_s"] for s in snaps),
            "holder_put_s_median": statistics.median(s["holder_put_s"] for s in snaps),
            "mb_per_s_total": statistics.median(s["bytes"] / s["total_s"] / MB for s in snaps),
            "mb_per_s_copy": statistics.median(s["bytes"] / s["copy_s"] / MB for s in snaps),
            "errors": [e for r in ranks for e in r["snapshot_errors"]],
        },
        "persist": {
            "bytes": persist[0]["bytes"],
            "seconds_median": statistics.median(p["seconds"] for p in persist),
            "mb_per_s": statistics.median(p["bytes_per_second"] / MB for p in persist),
            "gather_s": ranks[0]["gather_s"],
            "readback_verify_s_median": statistics.median(ranks[0]["readback_s"]),
        },
        "restore": {
            "seconds_median": statistics.median(restore),
            "seconds_all": restore,
            "decode_index_s_median": statistics.median(decode_index),
            "param_max_abs_diff": max(r["restore_param_max_abs_diff"] for r in ranks),
            "param_change_by_one_step": max(r["param_change_by_one_step"] for r in ranks),
        },
    }


def report(summary: dict[str, Any], device: str, load: dict[str, Any]) -> str:
    on, off = summary["modes"]["on"], summary["modes"]["off"]
    snap, persist, restore = summary["snapshot"], summary["persist"], summary["restore"]
    row = "{:<14}{:>6}{:>10.4f}{:>10.4f}{:>10.4f}{:>10.4f}{:>10.4f}"
    columns = ("num_steps", "mean_s", "median_s", "stdev_s", "train_mean_s", "cpu_mean_s")
    lines = [
        f"{'mode':<14}{'steps':>6}{'mean s':>10}{'median s':>10}{'stdev s':>10}{'train s':>10}{'cpu s':>10}",
        row.format("snapshots on", *(on[c] for c in columns)),
        row.format("snapshots off", *(off[c] for c in columns)),
        "(wall time: max over ranks; train s: StepReport.step_time_s, without the capture; cpu s: sum over ranks)",
        "",
        f"snapshot: {snap['total_bytes'] / MB:.2f} MB over all ranks "
        f"({max(snap['bytes_per_rank'].values()) / MB:.2f} MB per rank); "
        f"copy {snap['copy_s_median'] * 1e3:.2f} ms ({snap['mb_per_s_copy']:.0f} MB/s), "
        f"copy+encode+checksum {snap['total_s_median'] * 1e3:.2f} ms ({snap['mb_per_s_total']:.0f} MB/s), "
        f"holder put {snap['holder_put_s_median'] * 1e3:.2f} ms",
        f"persist:  {persist['bytes'] / MB:.2f} MB to file:// in {persist['seconds_median'] * 1e3:.1f} ms "
        f"({persist['mb_per_s']:.0f} MB/s); read back + verify {persist['readback_verify_s_median'] * 1e3:.1f} ms",
        f"restore:  {restore['seconds_median'] * 1e3:.1f} ms (max over ranks; decode + index alone "
        f"{restore['decode_index_s_median'] * 1e3:.1f} ms); "
        f"restored params differ by {restore['param_max_abs_diff']:.1e} "
        f"(one step moves them {restore['param_change_by_one_step']:.1e})",
        "",
    ]
    outside = load["outside_cpu_fraction"]
    if outside is not None:
        lines.append(
            f"other processes used {outside:.0%} of the machine's {load['num_cpus']} CPUs during the run "
            f"({load['num_ranks']} ranks here)"
        )
        if outside > 0.1:
            lines.append(
                "warning: wall-time ratios are noisy with other work on the CPUs; the paired and CPU ratios less so"
            )
    paired = summary["ratio_paired_blocks"]
    paired_text = "n/a" if paired is None else f"{paired:.3f}x"
    lines += [
        f"snapshot overhead: {summary['ratio_mean']:.3f}x step time (mean; median {summary['ratio_median']:.3f}x, "
        f"paired blocks {paired_text}; CPU time {summary['ratio_cpu']:.3f}x) "
        f"(target <= {TARGET[device]:.2f} on {'CPU' if device == 'cpu' else 'GPU'})",
    ]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    import torch

    world = args.dp * args.cp
    device = "cuda" if use_cuda(world) else "cpu"
    started = time.perf_counter()
    busy0, ours0, wall0 = machine_busy_s(), children_cpu_s(), time.perf_counter()
    ranks = run(args)
    busy1, ours1, wall1 = machine_busy_s(), children_cpu_s(), time.perf_counter()
    # What the rest of the machine used while the ranks ran: the CPU time of every process
    # minus that of the ranks (this process's children, all joined by now).
    outside = None
    if busy0 is not None and busy1 is not None:
        outside = max(0.0, (busy1 - busy0) - (ours1 - ours0)) / ((wall1 - wall0) * (os.cpu_count() or 1))
    load = {"outside_cpu_fraction": outside, "num_cpus": os.cpu_count(), "num_ranks": world}
    summary = summarize(ranks)
    print(report(summary, device, load))
    if device == "cuda":
        device_name = torch.cuda.get_device_name(0)
    else:
        device_name = f"cpu {platform.processor() or platform.machine()}"
    record = {
        "bench": "checkpoint",
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": device_name,
        "device_type": device,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "config": {
            "world_size": world, "dp": args.dp, "cp": args.cp, "zero_stage": args.stage, "dim": args.dim,
            "n_layers": args.layers, "seq_len": args.seq_len, "global_batch": 4, "blocks": args.blocks,
            "steps_per_block": args.steps, "warmup_steps_per_mode": args.warmup, "threads_per_rank": 1,
            "overrides": overrides(args),
        },
        "target_ratio": TARGET[device],
        "ratio_mean": summary["ratio_mean"],
        "ratio_median": summary["ratio_median"],
        "ratio_paired_blocks": summary["ratio_paired_blocks"],
        "ratio_cpu": summary["ratio_cpu"],
        "machine_load": load,
        "step_time": summary["modes"],
        "blocks": summary["blocks"],
        "snapshot": summary["snapshot"],
        "persist": summary["persist"],
        "restore": summary["restore"],
        "wall_s": round(time.perf_counter() - started, 1),
    }
    out = args.out or RESULTS_DIR / f"checkpoint-{device}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {out.relative_to(ROOT) if out.is_relative_to(ROOT) else out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
