"""Benchmark: what per-step snapshots cost the step on their real delivery path, and how fast a
snapshot is persisted and restored.

Four TrainWorker actors (dp=2 x cp=2, ZeRO-2 by default) train the quickstart model
(jobs/quickstart.yaml: dim 128, 4 layers, 4 heads, 2 KV heads, seq 2048, global batch 4) on a
local Ray cluster of two nodes (bound to 127.0.0.1, two logical CPUs each, so each replica's
ring packs onto one node). ringtrain's WorkerGroup places, spawns and steps them as the
Controller does, and starts a SnapshotHolder on each node. A snapshot travels as in a job: the
rank's Snapshotter copies, encodes and checksums it on its background thread, then hands it to
the holders: one ``ray.put`` into the object store, and a ``put`` on the holder of the rank's
node and on the buddy node's holder, each of which keeps a private copy.

- Step-time overhead: in the same actors and run, blocks of steps with snapshots on alternate
  with blocks with them off (the Trainer's Snapshotter set aside for the block, through
  ``__ray_call__``), in the order on/off/off/on. A step's time is the driver's wall time of
  ``WorkerGroup.train_step()``: what the Controller waits for. Every block ends with a drain call
  on every worker (on: wait for the last capture and for its holders' puts; off: the same call,
  with nothing to wait for), timed with the block's last step, so the snapshot tail of a block
  is charged to it. The ratio is over neighbouring on/off blocks (``ringtrain_dev.blocks``): the
  mean of their log ratios and its 95% confidence interval. Rounds of four blocks run until the
  interval's half-width is within ``--resolve`` (1% of the step: a fifth of the target's
  margin) or ``--max-blocks`` ran, so the noise of a busy shared machine buys more blocks
  rather than a wider answer. It decides PASS/FAIL: the upper end of the interval must be
  within the target, so noise cannot pass a real overhead; a run too noisy to tell fails and
  says so.
- CPU overhead: the CPU time every process of the cluster used (workers, holders, raylets,
  GCS) per block, paired the same way: the extra work itself, which other load on the machine
  barely changes. With four ranks on two cores every CPU second the snapshots take is one the
  steps wait for, so on this testbed it predicts the wall-clock ratio; the per-step CPU time
  of the workers, the holders and Ray's own processes, on and off, says where it goes.
- Snapshot: bytes per rank; ``copy_s`` (what the next optimizer step may wait for), ``total_s``
  (copy + encode + checksum) and ``deliver_s`` (the snapshot thread's hand-off to the holders).
- Holders: after the blocks, each node's holder must hold every rank's newest snapshot (its
  own node's ranks and its buddy's), byte-identical to the worker's.
- Persist: the Persister, as the Controller runs it, on the workers' pending ``snapshot(step)``
  results, to a ``file://`` store; then ``latest_valid`` reads it back (every shard verified).
- Restore: every rank restores the shards read from a holder (its own node's, then its buddy
  node's, alternately), after one more step moved the state on, as recovery does; the restored
  parameters must equal the ones at the snapshot's step.

Target: <= 1.05 on the CPU testbed, where the workers train on CPU over gloo (the GPU target,
1.02, needs a Ray node with four GPUs, which this script does not drive).

    PYTHONPATH=platform python bench/checkpoint.py [--resolve 0.01] [--max-blocks 240] [--steps 2]

Writes bench/results/checkpoint-<cpu|cuda>.json.

``--pipeline`` times a rank's snapshot pipeline alone, without Ray or training, on a synthetic
state of ``--gb`` GB in as many arrays as TinyLlama-1.1B's: the Snapshotter as it is (the copy
lands in the blob's own buffer, the capture writes the header, a tree checksum runs on every
core) against the pipeline of commit 8e797a0, kept here as the baseline (per-array buffers,
an encoder that copies the state twice, one sha256 of the whole blob). Rounds alternate which
runs first. It reports GB/s, the per-core hashing rate in CPU time (which other load barely
moves), the Python bytes each snapshot allocates and the host buffers allocated, and projects
the per-step host work for issue 30's case, a 13.2 GB state on a 16-core GPU node with a 1.24 s
step. Target: that projection within the step, so the copy thread keeps up.

    PYTHONPATH=platform python bench/checkpoint.py --pipeline [--gb 2] [--reps 4] [--pipeline-steps 2]

Writes bench/results/checkpoint-pipeline-cpu.json.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator

from ringtrain_dev.blocks import OutsideLoad, block_means, own_cpu_s, paired_ratio, schedule
from ringtrain_dev.ray_head import TORCH_EXTENSIONS_DIR
from ringtrain_dev.record import Run

ROOT = Path(__file__).resolve().parents[1]

MB = 1e6
TARGET = 1.05
NUM_NODES = 2


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stage", type=int, default=2, help="ZeRO stage (0-3)")
    p.add_argument("--min-blocks", type=int, default=24, help="timed blocks before the interval may stop the run")
    p.add_argument("--max-blocks", type=int, default=240, help="timed blocks at most, half with snapshots on")
    p.add_argument("--resolve", type=float, default=0.01,
                   help="stop once the 95%% interval's half-width is within this fraction of the step")
    p.add_argument("--steps", type=int, default=2, help="steps per block")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per mode before the blocks")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--dp", type=int, default=2)
    p.add_argument("--cp", type=int, default=2)
    p.add_argument("--restores", type=int, default=4, help="timed restores, alternately from own and buddy holders")
    p.add_argument("--persists", type=int, default=3, help="timed saves to the file store (median reported)")
    p.add_argument("--pipeline", action="store_true",
                   help="time the snapshot pipeline alone (copy + encode + checksum) on a synthetic state, old against new")
    p.add_argument("--gb", type=float, default=2.0, help="--pipeline: the synthetic state's size")
    p.add_argument("--reps", type=int, default=4, help="--pipeline: rounds of old and new, alternating their order")
    p.add_argument("--pipeline-steps", type=int, default=2, help="--pipeline: timed snapshots per round and pipeline")
    p.add_argument("--out", type=Path, default=None,
                   help="default: bench/results/checkpoint-<device>.json (--pipeline: checkpoint-pipeline-cpu.json)")
    args = p.parse_args(argv)
    if args.min_blocks < 4 or args.max_blocks < args.min_blocks or args.steps < 1:
        p.error("--min-blocks must be >= 4 (two on/off pairs), --max-blocks >= --min-blocks, --steps >= 1")
    if args.gb <= 0 or args.reps < 1 or args.pipeline_steps < 1:
        p.error("--gb must be > 0, --reps and --pipeline-steps >= 1")
    return args


def overrides(args: argparse.Namespace) -> list[str]:
    # The schedule spans every step this run takes, so no step is the run's last (which the
    # Trainer always snapshots) and the learning rate never hits an edge of the schedule.
    total = 2 * args.warmup + args.max_blocks * args.steps + args.restores + 8
    return [
        "model.vocab_size=256", f"model.dim={args.dim}", f"model.n_layers={args.layers}", "model.n_heads=4",
        "model.n_kv_heads=2", f"data.seq_len={args.seq_len}", f"mesh.dp={args.dp}", f"mesh.cp={args.cp}",
        "mesh.spares=0", "attention.impl=ring", f"zero.stage={args.stage}", "train.global_batch=4",
        "train.micro_batch=1", "train.lr=3e-3", f"train.warmup_steps={min(15, total // 4)}", f"train.steps={total}",
        "checkpoint.snapshot_every=1", "checkpoint.persist_every=0", "checkpoint.buddy=true",
        "cluster.cpus_per_worker=1",
    ]


# --- run inside the worker actors (through __ray_call__; they see only ringtrain and ray) --------


class _ObservedDelivery:
    """Passes each snapshot on to the worker's real delivery, noting its size and timings."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.seen: list[dict[str, Any]] = []

    def __call__(self, snap: Any) -> None:
        t0 = time.perf_counter()
        self.inner(snap)
        self.seen.append({"step": snap.step, "bytes": snap.num_bytes, "copy_s": snap.copy_s, "total_s": snap.total_s,
                          "deliver_s": time.perf_counter() - t0})


def _observe(worker: Any) -> None:
    snapshotter = worker._trainer.snapshotter
    worker._bench_snapshotter = snapshotter
    snapshotter.deliver = _ObservedDelivery(snapshotter.deliver)


def _set_snapshots(worker: Any, on: bool) -> None:
    worker._trainer.snapshotter = worker._bench_snapshotter if on else None


def _drain(worker: Any) -> None:
    """Wait until the newest snapshot is taken and its holders have their copies (nothing when
    snapshots are off)."""
    import ray

    snapshotter = worker._trainer.snapshotter
    if snapshotter is None:
        return
    snapshotter.wait()
    pending = list(snapshotter.deliver.inner._in_flight)  # the holders' puts of the last round
    if pending:
        ray.wait(pending, num_returns=len(pending))


def _delivered(worker: Any) -> list[dict[str, Any]]:
    return list(worker._bench_snapshotter.deliver.seen)


def _keep_parameters(worker: Any) -> int:
    worker._bench_expected = worker._trainer.parameters_fp32()
    return int(worker._trainer.step)


def _parameter_diff(worker: Any) -> float:
    now = worker._trainer.parameters_fp32()
    return max(float((now[k] - v).abs().max()) for k, v in worker._bench_expected.items())


# --- the driver ---------------------------------------------------------------------------------


@contextlib.contextmanager
def local_cluster(num_nodes: int, cpus_per_node: int) -> Iterator[Any]:
    """A Ray cluster of ``num_nodes`` nodes on this machine, bound to 127.0.0.1, with its own
    temp dir and HOME (Ray writes there) and token auth off; stopped through its handle."""
    assert "ray" not in sys.modules, "Ray reads RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER when imported"
    temp_dir = tempfile.mkdtemp(prefix="rtb-", dir="/tmp")  # short: Ray's socket paths live below it
    saved = dict(os.environ)
    os.environ.pop("RAY_ADDRESS", None)
    # Ray resolves 127.0.0.1 to the host's routable address unless told that this is a one-host
    # cluster (on Linux the variable only picks the node address: the loopback one). RAY_TMPDIR
    # keeps Ray's record of "the current cluster" out of the shared /tmp/ray; the workers
    # import ringtrain from an absolute path, as their working directory is Ray's.
    os.environ.update(RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", HOME=temp_dir, RAY_TMPDIR=temp_dir, RAY_AUTH_MODE="disabled",
                      TORCH_EXTENSIONS_DIR=os.environ.get("TORCH_EXTENSIONS_DIR", str(TORCH_EXTENSIONS_DIR)),
                      PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT / "platform"), os.environ.get("PYTHONPATH")])))
    import ray
    from ray.cluster_utils import Cluster

    (Path(temp_dir) / "ray").mkdir()
    node = {"num_cpus": cpus_per_node, "node_ip_address": "127.0.0.1"}
    cluster = Cluster(initialize_head=True, head_node_args={**node, "temp_dir": temp_dir, "include_dashboard": False})
    try:
        for _ in range(num_nodes - 1):
            cluster.add_node(**node)
        ray.init(address=cluster.address, log_to_driver=False, logging_level=logging.WARNING)
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()
        os.environ.clear()
        os.environ.update(saved)
        shutil.rmtree(temp_dir, ignore_errors=True)


def cluster_cpu_s() -> dict[str, float]:
    """CPU seconds of every process the cluster runs (all started by this driver, not the driver
    itself): "total", and by kind among the live ones: the workers, the holders, and Ray's own
    (raylets, GCS, agents); Ray titles its actor processes ``ray::<Class>...``."""
    import psutil

    t = os.times()
    out = {"total": own_cpu_s() - (t.user + t.system), "workers": 0.0, "holders": 0.0, "ray": 0.0}
    for proc in psutil.Process().children(recursive=True):
        try:
            title, c = " ".join(proc.cmdline()), proc.cpu_times()
        except psutil.Error:  # exited meanwhile
            continue
        kind = "workers" if "TrainWorker" in title else "holders" if "SnapshotHolder" in title else "ray"
        out[kind] += c.user + c.system
    return out


def on_every(group: Any, fn: Any, *args: Any) -> list[Any]:
    import ray

    return ray.get([w.__ray_call__.remote(fn, *args) for w in group.workers])


def measure_blocks(group: Any, args: argparse.Namespace) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Per timed step: block, mode, driver wall time, slowest rank's StepReport.step_time_s;
    per block: its mode and the cluster's CPU seconds. Runs whole on/off/off/on rounds until the
    paired ratio's interval is as narrow as ``--resolve`` (past ``--min-blocks``) or
    ``--max-blocks`` ran: a stopping rule on the precision, not on the estimate, so it does not
    steer the ratio."""
    steps: list[dict[str, Any]] = []
    blocks: list[dict[str, Any]] = []
    modes = schedule(args.max_blocks)
    for block, on in enumerate(modes):
        if block % 4 == 0 and block >= args.min_blocks:
            half = paired_ratio(block_means(steps))["half_width"]
            if half is not None and half <= args.resolve:
                break
        on_every(group, _set_snapshots, on)
        cpu0 = cluster_cpu_s()
        for i in range(args.steps):
            t0 = time.perf_counter()
            reports = group.train_step().reports_or_raise()
            if i == args.steps - 1:
                on_every(group, _drain)
            steps.append({"block": block, "on": on, "step": reports[0].step, "wall_s": time.perf_counter() - t0,
                          "train_s": max(r.step_time_s for r in reports)})
        cpu1 = cluster_cpu_s()
        blocks.append({"block": block, "on": on, "cpu_s": (cpu1["total"] - cpu0["total"]) / args.steps,
                       "cpu_by_kind_s": {k: (cpu1[k] - cpu0[k]) / args.steps for k in ("workers", "holders", "ray")}})
    on_every(group, _set_snapshots, True)
    return steps, blocks


def check_holders(group: Any, step: int) -> dict[str, Any]:
    """Every holder has every rank's snapshot of ``step`` (its node's and its buddies'), equal to
    the worker's bytes."""
    import ray

    on_every(group, _drain)
    blobs = [blob for blob, _ in ray.get(group.snapshot_refs(step))]
    held = {node: ray.get(h.inventory.remote()).get(step) for node, h in group.holders.items()}
    identical = all(ray.get(h.get.remote(rank, step)) == blob
                    for h in group.holders.values() for rank, blob in enumerate(blobs))
    return {"num_holders": len(group.holders), "ranks_held": {n[:8]: (v[1] if v else []) for n, v in held.items()},
            "every_holder_has_every_rank": all(v is not None and v[1] == list(range(len(blobs))) for v in held.values()),
            "byte_identical": identical,
            "bytes_per_holder": {n[:8]: ray.get(h.num_bytes.remote()) for n, h in group.holders.items()}}


def measure_persist(group: Any, job: Any, step: int, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    from ringtrain.actors.persister import Persister
    from ringtrain.actors.resume import checkpoint_meta, incompatibility
    from ringtrain.checkpoint import open_store

    saves, readbacks = [], []
    for rep in range(args.persists):
        store = open_store(Path(tmp, f"rep-{rep}").as_uri(), keep=1)
        persister = Persister(store, checkpoint_meta(job))
        persister.submit(step, group.snapshot_refs(step))
        (done,) = persister.flush()
        persister.close()
        saves.append(done)
        t0 = time.perf_counter()
        loaded = store.latest_valid(incompatibility(job))
        readbacks.append(time.perf_counter() - t0)
        assert loaded is not None and loaded.step == step, "the persisted checkpoint reads back"
    return {"bytes": saves[0].num_bytes, "seconds_median": statistics.median(p.seconds for p in saves),
            "mb_per_s": statistics.median(p.num_bytes / p.seconds / MB for p in saves),
            "readback_verify_s_median": statistics.median(readbacks)}


def measure_restore(group: Any, step: int, args: argparse.Namespace) -> dict[str, Any]:
    """Restore ``step`` from the holders after one more step moved the state on."""
    on_every(group, _keep_parameters)
    group.train_step().reports_or_raise()
    moved = max(on_every(group, _parameter_diff))
    nodes = list(group.holders)
    own = [group.infos[rank].node_id for rank in range(len(group.workers))]
    times: dict[str, list[float]] = {"own": [], "buddy": []}
    diffs = []
    for rep in range(args.restores):
        source = "own" if rep % 2 == 0 else "buddy"
        holders = [group.holders[n if source == "own" else next(m for m in nodes if m != n)] for n in own]
        t0 = time.perf_counter()
        resumed = group.restore_refs([h.get.remote(rank, step) for rank, h in enumerate(holders)])
        times[source].append(time.perf_counter() - t0)
        assert resumed == step, f"restored step {resumed}, expected {step}"
        diffs.append(max(on_every(group, _parameter_diff)))
    return {"seconds_median_own_holder": statistics.median(times["own"]),
            "seconds_median_buddy_holder": statistics.median(times["buddy"]) if times["buddy"] else None,
            "seconds_all": times, "param_max_abs_diff": max(diffs), "param_change_by_one_step": moved}


def run(args: argparse.Namespace) -> dict[str, Any]:
    from ringtrain import config
    from ringtrain.actors.group import WorkerGroup

    job = config.load(None, overrides(args))
    cpus_per_node = (args.dp * args.cp) // NUM_NODES
    with local_cluster(NUM_NODES, cpus_per_node), tempfile.TemporaryDirectory(prefix="ringtrain-bench-ckpt-") as tmp:
        group = WorkerGroup(job, "cpu")
        try:
            t0 = time.perf_counter()
            group.start()
            start_s = time.perf_counter() - t0
            on_every(group, _observe)
            for on in (True, False):  # allocator, gloo buffers, the snapshots' host buffers
                on_every(group, _set_snapshots, on)
                for _ in range(args.warmup):
                    group.train_step().reports_or_raise()
                on_every(group, _drain)
            load = OutsideLoad()
            load.start()
            steps, blocks = measure_blocks(group, args)
            machine_load = load.stop()
            delivered = on_every(group, _delivered)
            group.train_step().reports_or_raise()  # a step whose snapshot every holder has
            step = steps[-1]["step"] + 1
            holders = check_holders(group, step)
            persist = measure_persist(group, job, step, args, Path(tmp))
            restore = measure_restore(group, step, args)
            layout = group.layout()
        finally:
            group.shutdown()
    first, last = steps[0]["step"], steps[-1]["step"]
    return {"steps": steps, "blocks": blocks, "machine_load": machine_load, "start_s": start_s,
            "snapshots": [[s for s in rank if first <= s["step"] <= last] for rank in delivered],
            "holders": holders, "persist": persist, "restore": restore,
            "nodes_of_ranks": [w["node_id"][:8] for w in layout["workers"]]}


def summarize(measured: dict[str, Any]) -> dict[str, Any]:
    steps = measured["steps"]
    modes: dict[str, dict[str, Any]] = {}
    for name, on in (("on", True), ("off", False)):
        rows = [s for s in steps if s["on"] == on]
        walls = [s["wall_s"] for s in rows]
        modes[name] = {"num_steps": len(walls), "mean_s": statistics.fmean(walls), "median_s": statistics.median(walls),
                       "stdev_s": statistics.stdev(walls), "min_s": min(walls), "max_s": max(walls),
                       # StepReport.step_time_s: forward, backward and optimizer step, without the capture.
                       "train_mean_s": statistics.fmean(s["train_s"] for s in rows),
                       "cpu_mean_s": statistics.fmean(b["cpu_s"] for b in measured["blocks"] if b["on"] == on),
                       "steps_s": walls}
    wall = paired_ratio(block_means(steps))
    cpu = paired_ratio([(b["on"], b["cpu_s"]) for b in measured["blocks"]])
    by_kind = {name: {k: statistics.fmean(b["cpu_by_kind_s"][k] for b in measured["blocks"] if b["on"] == on)
                      for k in ("workers", "holders", "ray")} for name, on in (("on", True), ("off", False))}
    snaps = [s for rank in measured["snapshots"] for s in rank]
    bytes_per_rank = [max((s["bytes"] for s in rank), default=0) for rank in measured["snapshots"]]
    return {
        "overhead": wall,
        "cpu_overhead": cpu,
        "cpu_per_step_by_kind_s": by_kind,
        "ratio_mean": modes["on"]["mean_s"] / modes["off"]["mean_s"],
        "ratio_median": modes["on"]["median_s"] / modes["off"]["median_s"],
        "step_time": modes,
        "blocks": [{**b, "mean_s": m} for b, (_, m) in zip(measured["blocks"], block_means(steps))],
        "snapshot": {
            "num_snapshots": len(snaps), "bytes_per_rank": bytes_per_rank, "total_bytes": sum(bytes_per_rank),
            "copy_s_median": statistics.median(s["copy_s"] for s in snaps),
            "total_s_median": statistics.median(s["total_s"] for s in snaps),
            "deliver_s_median": statistics.median(s["deliver_s"] for s in snaps),
            "mb_per_s_total": statistics.median(s["bytes"] / s["total_s"] / MB for s in snaps),
            "mb_per_s_copy": statistics.median(s["bytes"] / s["copy_s"] / MB for s in snaps),
        },
    }


def verdict(summary: dict[str, Any], target: float) -> bool:
    ci = summary["overhead"]["ci95"]
    return ci is not None and ci[1] <= target


def report(summary: dict[str, Any], measured: dict[str, Any], target: float, passed: bool) -> str:
    on, off = summary["step_time"]["on"], summary["step_time"]["off"]
    snap, persist, restore, holders = summary["snapshot"], measured["persist"], measured["restore"], measured["holders"]
    wall, cpu = summary["overhead"], summary["cpu_overhead"]
    row = "{:<14}{:>6}{:>10.4f}{:>10.4f}{:>10.4f}{:>10.4f}{:>10.4f}"
    columns = ("num_steps", "mean_s", "median_s", "stdev_s", "train_mean_s", "cpu_mean_s")
    outside = measured["machine_load"]["outside_cpu_fraction"]
    lines = [
        f"{'mode':<14}{'steps':>6}{'mean s':>10}{'median s':>10}{'stdev s':>10}{'train s':>10}{'cpu s':>10}",
        row.format("snapshots on", *(on[c] for c in columns)),
        row.format("snapshots off", *(off[c] for c in columns)),
        "(wall: the driver's WorkerGroup.train_step; train s: slowest rank's StepReport.step_time_s, without the "
        "capture; cpu s: every cluster process)",
        "",
        f"snapshot: {snap['total_bytes'] / MB:.2f} MB over all ranks ({max(snap['bytes_per_rank']) / MB:.2f} MB per "
        f"rank); copy {snap['copy_s_median'] * 1e3:.2f} ms ({snap['mb_per_s_copy']:.0f} MB/s), copy+encode+checksum "
        f"{snap['total_s_median'] * 1e3:.2f} ms ({snap['mb_per_s_total']:.0f} MB/s), hand-off to the holders "
        f"{snap['deliver_s_median'] * 1e3:.2f} ms",
        f"holders:  {holders['num_holders']} (one per node); every holder has every rank's snapshot: "
        f"{holders['every_holder_has_every_rank']}, byte-identical to the workers': {holders['byte_identical']}",
        f"persist:  {persist['bytes'] / MB:.2f} MB to file:// through the Persister in "
        f"{persist['seconds_median'] * 1e3:.1f} ms ({persist['mb_per_s']:.0f} MB/s); read back + verify "
        f"{persist['readback_verify_s_median'] * 1e3:.1f} ms",
        f"restore:  from the holders, every rank: {restore['seconds_median_own_holder'] * 1e3:.1f} ms (own node), "
        f"{(restore['seconds_median_buddy_holder'] or float('nan')) * 1e3:.1f} ms (buddy node); restored params "
        f"differ by {restore['param_max_abs_diff']:.1e} (one step moves them {restore['param_change_by_one_step']:.1e})",
        "",
    ]
    if outside is not None:
        lines.append(f"other processes used {outside:.0%} of the machine's {measured['machine_load']['num_cpus']} CPUs "
                     "during the blocks")
    kinds = summary["cpu_per_step_by_kind_s"]
    lines += [
        "CPU per step, on - off: " + ", ".join(f"{k} {(kinds['on'][k] - kinds['off'][k]) * 1e3:+.0f} ms"
                                               for k in ("workers", "holders", "ray")),
        f"CPU overhead (cluster CPU time, {cpu['num_pairs']} block pairs): {cpu['ratio']:.3f}x, "
        f"95% CI [{cpu['ci95'][0]:.3f}, {cpu['ci95'][1]:.3f}]",
        f"all steps: mean {summary['ratio_mean']:.3f}x, median {summary['ratio_median']:.3f}x (not paired: drift and "
        "bursts of outside load weigh on them)",
        f"snapshot overhead (decides; step wall time, {wall['num_pairs']} neighbouring on/off block pairs): "
        f"{wall['ratio']:.3f}x, 95% CI [{wall['ci95'][0]:.3f}, {wall['ci95'][1]:.3f}] (resolves "
        f"+-{wall['half_width']:.1%}), median pair {wall['median']:.3f}x",
        f"{'PASS' if passed else 'FAIL'}: upper end of the 95% CI {wall['ci95'][1]:.4f} "
        f"{'<=' if passed else '>'} target {target:.2f}" + ("" if passed else (
            " (the whole interval is above it)" if wall["ci95"][0] > target
            else " (the interval straddles the target: the overhead cannot be shown to be within it)")),
    ]
    return "\n".join(lines)


# --- the snapshot pipeline alone (--pipeline) ---------------------------------------------------

# Issue 30's case: TinyLlama-1.1B on one H100, one rank at ZeRO-2 holding the whole optimizer
# state (fp32 master + Adam's two moments: 12 bytes x 1.1e9 parameters), stepping in 1.24 s at
# 32K tokens without snapshots, on a node of 16 cores.
NODE_STATE_GB = 13.2
NODE_STEP_S = 1.24
NODE_CORES = 16
PIPELINE_ARRAYS = 201  # TinyLlama's parameters: each a fragment of three arrays in the blob


class SyntheticState:
    """What the Snapshotter reads from a ZeroState: ``PIPELINE_ARRAYS`` fragments of fp32 CPU
    tensors (the three state keys each), ``num_bytes`` in all, values changing every step."""

    def __init__(self, num_bytes: int) -> None:
        import torch

        from ringtrain.checkpoint.wire import STATE_KEYS

        per = num_bytes // (4 * len(STATE_KEYS) * PIPELINE_ARRAYS)
        # Sizes spread around the mean as a model's are (a few large matrices, smaller norms).
        sizes = [max(1, int(per * (0.5 + (i % 7) / 6))) for i in range(PIPELINE_ARRAYS)]
        self.keys = STATE_KEYS
        self.tensors = [{key: torch.full((n,), float(i), dtype=torch.float32) for key in STATE_KEYS}
                        for i, n in enumerate(sizes)]
        self.num_bytes = sum(4 * t.numel() for frag in self.tensors for t in frag.values())

    def fragments(self) -> Iterator[Any]:
        from ringtrain.train.zero_state import Fragment

        for i, tensors in enumerate(self.tensors):
            yield Fragment(f"layers.{i}.w", (tensors["param"].numel(),), 0, dict(tensors))

    def step(self, step: int) -> None:
        for tensors in self.tensors:
            tensors["exp_avg"][:1] = float(step)  # a change each step; the copies do not care


def _old_encode(step: int, rank: int, world_size: int, scalars: dict[str, Any], arrays: list[tuple[Any, dict[str, Any]]]) -> bytes:
    """The encoder before the blob was laid out in place (commit 8e797a0's ``wire.encode``): each
    array's bytes copied out, then joined, a second copy of the whole state."""
    import json
    import struct

    import numpy as np

    entries, chunks, offset = [], [], 0
    for frag, values in arrays:
        for key, arr in values.items():
            data = np.ascontiguousarray(arr, dtype="<f4").tobytes()
            entries.append({"name": frag.name, "key": key, "shape": list(frag.shape), "start": frag.start,
                            "numel": int(arr.size), "offset": offset})
            chunks.append(data)
            offset += len(data)
    header = json.dumps({"format": 1, "step": step, "rank": rank, "world_size": world_size, "scalars": scalars,
                         "arrays": entries}).encode()
    return b"".join([b"RTSNAP01", struct.pack("<Q", len(header)), header, *chunks])


class OldPipeline:
    """The snapshot thread's work before (commit 8e797a0): copy into per-array host buffers
    allocated once, encode by two copies, one sha256 of the whole blob on one thread."""

    def __init__(self, state: SyntheticState) -> None:
        import torch

        self.state = state
        self.buffers = [{k: torch.empty(t.numel(), dtype=torch.float32) for k, t in frag.tensors.items()}
                        for frag in state.fragments()]
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="old-snapshot")

    def snapshot(self, step: int, scalars: dict[str, Any]) -> dict[str, float]:
        """On a thread of its own, as the old Snapshotter's copy thread ran it."""
        return self._thread.submit(self._snapshot, step, scalars).result()

    def close(self) -> None:
        self._thread.shutdown()

    def _snapshot(self, step: int, scalars: dict[str, Any]) -> dict[str, float]:
        import hashlib

        fragments = list(self.state.fragments())
        t0, c0 = time.perf_counter(), time.thread_time()
        for frag, host in zip(fragments, self.buffers):
            for key, tensor in frag.tensors.items():
                host[key].copy_(tensor)
        t1, c1 = time.perf_counter(), time.thread_time()
        blob = _old_encode(step, 0, 1, scalars, [(f, {k: b.numpy() for k, b in h.items()}) for f, h in zip(fragments, self.buffers)])
        t2, c2 = time.perf_counter(), time.thread_time()
        hashlib.sha256(blob).hexdigest()
        t3, c3 = time.perf_counter(), time.thread_time()
        return {"copy_s": t1 - t0, "encode_s": t2 - t1, "checksum_s": t3 - t2, "total_s": t3 - t0,
                "encode_cpu_s": c2 - c1, "checksum_cpu_s": c3 - c2, "bytes": len(blob)}


class NewPipeline:
    """The Snapshotter as the Trainer runs it on CPU (its thread copies straight into the blob,
    then checksums it on ``threads`` threads), one capture at a time."""

    def __init__(self, state: SyntheticState, threads: int) -> None:
        import torch

        from ringtrain.train.snapshot import Snapshotter

        self.snapshotter = Snapshotter(state, rank=0, world_size=1, device=torch.device("cpu"),  # type: ignore[arg-type]
                                       keep=1, hash_threads=threads)

    def snapshot(self, step: int, scalars: dict[str, Any]) -> dict[str, float]:
        t0 = time.perf_counter()
        self.snapshotter.capture(step, scalars)
        capture_s = time.perf_counter() - t0
        snap = self.snapshotter.wait()
        assert snap is not None
        return {"capture_s": capture_s, "copy_s": snap.copy_s, "checksum_s": snap.total_s - snap.copy_s,
                "total_s": snap.total_s, "bytes": snap.num_bytes}

    def close(self) -> dict[str, int]:
        self.snapshotter.close()
        return {"num_allocations": self.snapshotter.num_allocations}


def _scalars(step: int) -> dict[str, Any]:
    # As big as a real step's: the CPU RNG state alone is 5056 bytes, 10112 as hex.
    return {"trainer_step": step, "data_cursor": step, "optimizer_steps": step, "torch_rng": "ab" * 5056}


def _hash_rates(blob: Any, threads: int) -> dict[str, float]:
    """Per core (CPU time of one thread, which the load of other processes barely moves) and
    wall clock on ``threads`` threads: the tree checksum, and the flat sha256 it replaces."""
    import hashlib

    from ringtrain.checkpoint.wire import checksum

    gb = len(blob) / 1e9
    c0 = time.thread_time()
    checksum(blob, threads=1)
    c1 = time.thread_time()
    hashlib.sha256(blob).hexdigest()
    c2 = time.thread_time()
    t0 = time.perf_counter()
    checksum(blob, threads=threads)
    wall = time.perf_counter() - t0
    return {"tree_gb_per_cpu_s": gb / (c1 - c0), "flat_sha256_gb_per_cpu_s": gb / (c2 - c1),
            "tree_gb_per_s_wall": gb / wall, "threads": threads}


def _allocated_per_step(pipeline: Any, step: int) -> int:
    """Peak bytes of Python objects allocated while one snapshot is taken (tracemalloc sees the
    bytes the old encoder makes, not torch's buffers, which are allocated once either way)."""
    import tracemalloc

    tracemalloc.start()
    try:
        pipeline.snapshot(step, _scalars(step))
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def measure_pipeline(args: argparse.Namespace) -> dict[str, Any]:
    """Old and new pipelines on one synthetic state, in rounds of old-new / new-old (each round
    builds its pipeline anew and takes one untimed snapshot first: allocation, page faults)."""
    state = SyntheticState(int(args.gb * 1e9))
    threads = len(os.sched_getaffinity(0))
    rows: dict[str, list[dict[str, float]]] = {"old": [], "new": []}
    extra: dict[str, Any] = {}
    step = 0
    load = OutsideLoad()
    load.start()
    for rep in range(args.reps):
        for name in ("old", "new") if rep % 2 == 0 else ("new", "old"):
            pipeline: Any = OldPipeline(state) if name == "old" else NewPipeline(state, threads)
            step += 1
            state.step(step)
            pipeline.snapshot(step, _scalars(step))
            for _ in range(args.pipeline_steps):
                step += 1
                state.step(step)
                rows[name].append(pipeline.snapshot(step, _scalars(step)))
            if rep == 0:
                extra[f"{name}_python_bytes_allocated_per_step"] = _allocated_per_step(pipeline, step + 1)
                step += 1
            if name == "old":
                pipeline.close()
            if name == "new":
                extra.setdefault("new_num_allocations", []).append(pipeline.close()["num_allocations"])
                if rep == 0:
                    extra["hash"] = _hash_rates(pipeline.snapshotter.newest().blob, threads)
            del pipeline
    machine_load = load.stop()
    return {"state_bytes": state.num_bytes, "num_arrays": PIPELINE_ARRAYS * len(state.keys), "rows": rows,
            "machine_load": machine_load, **extra}


def summarize_pipeline(measured: dict[str, Any]) -> dict[str, Any]:
    gb = measured["state_bytes"] / 1e9
    med = {name: {k: statistics.median(r[k] for r in rows) for k in rows[0]} for name, rows in measured["rows"].items()}
    old, new, hashing = med["old"], med["new"], measured["hash"]
    # Per step on the node: the old pipeline's host work runs on one thread (two copies and a
    # sha256 of the whole state), so its CPU time per GB scales to the node's state as it is;
    # the new one's is the tree checksum on every core, plus the header the capture writes.
    old_node_s = NODE_STATE_GB * (old["encode_cpu_s"] + old["checksum_cpu_s"]) / gb
    new_node_s = NODE_STATE_GB / (NODE_CORES * hashing["tree_gb_per_cpu_s"]) + new["capture_s"]
    return {
        "state_gb": gb,
        "median": med,
        "pipeline_gb_per_s": {"old": gb / old["total_s"], "new": gb / new["total_s"]},
        "host_work_gb_per_s": {"old": gb / (old["encode_s"] + old["checksum_s"]), "new": gb / new["checksum_s"]},
        "speedup_total": old["total_s"] / new["total_s"],
        "hash": hashing,
        "node_projection": {
            "state_gb": NODE_STATE_GB, "cores": NODE_CORES, "step_s": NODE_STEP_S,
            "old_host_s_per_step": old_node_s, "new_host_s_per_step": new_node_s,
            "new_over_step": new_node_s / NODE_STEP_S,
            "assumes": "the tree checksum scales over the node's cores at this machine's per-core sha256 rate "
                       "(memory bandwidth to spare: 13.2 GB read per step); the device-to-host copy is not "
                       "host work (a DMA on a side stream) and is not in these numbers",
        },
    }


def report_pipeline(summary: dict[str, Any], measured: dict[str, Any], passed: bool) -> str:
    old, new, node, hashing = summary["median"]["old"], summary["median"]["new"], summary["node_projection"], summary["hash"]
    gb = summary["state_gb"]
    outside = measured["machine_load"]["outside_cpu_fraction"]
    lines = [
        f"snapshot pipeline on a synthetic {gb:.2f} GB state ({measured['num_arrays']} arrays), medians of "
        f"{len(measured['rows']['old'])} snapshots each, old and new interleaved:",
        f"{'':<6}{'copy s':>9}{'encode s':>10}{'checksum s':>12}{'total s':>9}{'GB/s':>7}",
        f"{'old':<6}{old['copy_s']:>9.3f}{old['encode_s']:>10.3f}{old['checksum_s']:>12.3f}{old['total_s']:>9.3f}"
        f"{summary['pipeline_gb_per_s']['old']:>7.2f}",
        f"{'new':<6}{new['copy_s']:>9.3f}{new['capture_s']:>10.4f}{new['checksum_s']:>12.3f}{new['total_s']:>9.3f}"
        f"{summary['pipeline_gb_per_s']['new']:>7.2f}   (encode: the header, written at capture)",
        f"speedup {summary['speedup_total']:.2f}x; host work after the copy {summary['host_work_gb_per_s']['old']:.2f} "
        f"-> {summary['host_work_gb_per_s']['new']:.2f} GB/s",
        f"hashing per core (CPU time): tree {hashing['tree_gb_per_cpu_s']:.2f} GB/s, flat sha256 "
        f"{hashing['flat_sha256_gb_per_cpu_s']:.2f} GB/s; tree on {hashing['threads']} threads "
        f"{hashing['tree_gb_per_s_wall']:.2f} GB/s wall",
        f"Python bytes allocated per snapshot: old {measured['old_python_bytes_allocated_per_step'] / 1e9:.2f} GB, "
        f"new {measured['new_python_bytes_allocated_per_step'] / 1e6:.2f} MB; host buffers allocated per run of "
        f"{1 + len(measured['rows']['new']) // max(1, len(measured['new_num_allocations']))} snapshots: "
        f"{measured['new_num_allocations']}",
    ]
    if outside is not None:
        lines.append(f"other processes used {outside:.0%} of the machine's {measured['machine_load']['num_cpus']} CPUs")
    lines += [
        f"projected per step for {node['state_gb']} GB on {node['cores']} cores: old {node['old_host_s_per_step']:.1f} s "
        f"(one thread), new {node['new_host_s_per_step']:.2f} s, {node['new_over_step']:.2f} of the {node['step_s']} s step",
        f"{'PASS' if passed else 'FAIL'}: the new pipeline's projected host work per step "
        f"{'<=' if passed else '>'} the step ({node['step_s']} s): the copy thread keeps up",
    ]
    return "\n".join(lines)


def pipeline_main(args: argparse.Namespace) -> int:
    record = Run("checkpoint-pipeline")
    measured = measure_pipeline(args)
    summary = summarize_pipeline(measured)
    passed = summary["node_projection"]["new_over_step"] <= 1.0
    print(report_pipeline(summary, measured, passed))
    record.write({
        "config": {"gb": args.gb, "reps": args.reps, "steps_per_rep": args.pipeline_steps,
                   "threads": len(os.sched_getaffinity(0)), "keep": 1},
        "target": "projected host work per step for 13.2 GB on 16 cores <= the 1.24 s step",
        "passed": passed, **summary,
        "rows": measured["rows"], "machine_load": measured["machine_load"],
        "python_bytes_allocated_per_step": {"old": measured["old_python_bytes_allocated_per_step"],
                                            "new": measured["new_python_bytes_allocated_per_step"]},
        "new_num_allocations": measured["new_num_allocations"],
    }, device_type="cpu", out=args.out)
    return 0 if passed else 1


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.pipeline:
        return pipeline_main(args)
    record = Run("checkpoint")
    measured = run(args)
    summary = summarize(measured)
    passed = verdict(summary, TARGET)
    print(report(summary, measured, TARGET, passed))
    record.write({
        "config": {"world_size": args.dp * args.cp, "dp": args.dp, "cp": args.cp, "zero_stage": args.stage,
                   "dim": args.dim, "n_layers": args.layers, "seq_len": args.seq_len, "global_batch": 4,
                   "blocks": len(measured["blocks"]), "min_blocks": args.min_blocks, "max_blocks": args.max_blocks,
                   "resolve": args.resolve, "steps_per_block": args.steps, "warmup_steps_per_mode": args.warmup,
                   "threads_per_rank": 1, "ray_nodes": NUM_NODES, "overrides": overrides(args)},
        "target_ratio": TARGET,
        "decided_by": "overhead.ci95[1]: upper end of the 95% CI of the paired-block step wall-time ratio",
        "passed": passed,
        **summary,
        "machine_load": measured["machine_load"],
        "holders": measured["holders"],
        "persist": measured["persist"],
        "restore": measured["restore"],
        "nodes_of_ranks": measured["nodes_of_ranks"],
        "group_start_s": measured["start_s"],
    }, device_type="cpu", out=args.out)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
