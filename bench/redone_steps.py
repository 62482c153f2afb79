"""Benchmark: steps redone after a kill that lands right after a step's record.

Each run is ``ringtrain run`` with 4 workers, dp 4, ZeRO-0 (``--zero`` another stage; a
quickstart-sized model on gloo);
``--delay-ms`` after step ``--kill-after``'s line appears in metrics.jsonl, rank 1's pid (from
workers.json) gets SIGKILL. The incident's ``lost_steps`` counts the completed steps the
recovery redid: nonzero when the newest snapshot of the dead rank had not reached a holder yet
and could not be written from elsewhere. ``--rebuild`` on/off compares the ZeRO-0 rebuild of
such a shard from a survivor (``controllers.rebuild_from_replicas``) with restoring the newest
step held whole.

    PYTHONPATH=platform python bench/redone_steps.py --plan on@0x10,on@50x10,off@0x5

Each run's summary.json carries ``snapshot_transit``: per holder role (node, buddy), the time
from a step's record to that step's snapshot being readable at the holder (the holders stamp
each put). A kill later than the window's maximum finds every shard of the step off the dead
process. The embedded cluster is one node, so only the node holder is measured there;
``--nodes 2`` runs the same job on a two-node ``ray.cluster_utils.Cluster`` and adds the buddy.

Writes bench/results/redone_steps-cpu.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from statistics import quantiles
from typing import Any

from ringtrain_dev.launched import launch, log_tail, read_jsonl, stop
from ringtrain_dev.record import RESULTS_DIR, Run

JOB = [
    "model.vocab_size=256", "model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
    "data.path=stdlib", "data.seq_len=256", "mesh.dp=4", "mesh.cp=1", "mesh.min_dp=1",
    "train.global_batch=4", "train.micro_batch=1", "train.warmup_steps=2", "checkpoint.snapshot_every=1",
    "checkpoint.persist_every=0", "telemetry.metrics=false", "telemetry.tensorboard=false", "controllers.grow_after_s=600",
]  # fmt: skip


class StartFailed(RuntimeError):
    """The run never reached the step to kill after: no kill happened."""


def one_kill(args: argparse.Namespace, rebuild: bool, delay_ms: float, address: str = "") -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="rt-redone-", dir="/tmp"))
    run_dir = tmp / "run"
    (tmp / "job.yaml").write_text("name: bench-redone\n")
    overrides = [*JOB, f"zero.stage={args.zero}", f"train.steps={args.kill_after + 3}", f"run_dir={run_dir}",
                 f"controllers.rebuild_from_replicas={str(rebuild).lower()}",
                 f"cluster.address={address}" if address else f"cluster.num_cpus={args.num_cpus}"]
    cmd = [sys.executable, "-m", "ringtrain", "run", str(tmp / "job.yaml"), *overrides]
    proc = launch(cmd, tmp, {"RAY_AUTH_MODE": "disabled", "HOME": str(tmp)}, tmp)
    try:
        deadline = time.monotonic() + args.timeout
        while not any(r["step"] >= args.kill_after for r in read_jsonl(run_dir / "metrics.jsonl")):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise StartFailed(f"no step {args.kill_after}:\n{log_tail(tmp)}")
            time.sleep(0.002)
        seen = time.monotonic()
        victim = json.loads((run_dir / "workers.json").read_text())["workers"][1]["pid"]
        time.sleep(max(0.0, delay_ms / 1000 - (time.monotonic() - seen)))
        os.kill(victim, signal.SIGKILL)
        proc.wait(timeout=args.timeout)
        incidents = [json.loads(p.read_text()) for p in sorted((run_dir / "incidents").glob("*.json"))]
        summary = json.loads((run_dir / "summary.json").read_text())
        return {
            "status": summary["status"],
            "lost_steps": sum(i["lost_steps"] for i in incidents),
            "incidents": [(i["kind"], i["action"], i["detected_at_step"]) for i in incidents],
            "snapshot_s": [r["snapshot_s"] for r in read_jsonl(run_dir / "metrics.jsonl")][-1],
            "transit": summary.get("snapshot_transit", {}),
            "startup": summary.get("startup", {}),
        }
    finally:
        stop(proc, tmp)
        shutil.rmtree(tmp, ignore_errors=True)


def pooled(kills: list[dict[str, Any]]) -> dict[str, Any]:
    """The transit windows of every step of every run, per holder role, in ms."""
    out: dict[str, Any] = {}
    for role in sorted({r for k in kills for r in k["transit"]}):
        ms = sorted(v for k in kills for v in k["transit"].get(role, {}).get("ms", []))
        if len(ms) < 2:
            continue
        q = quantiles(ms, n=100, method="inclusive")
        out[role] = {"count": len(ms), "min_ms": ms[0], "p50_ms": q[49], "p90_ms": q[89], "p99_ms": q[98], "max_ms": ms[-1],
                     "after_reports": sum(1 for v in ms if v > 0)}
    return out


def load() -> float:
    return os.getloadavg()[0]


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--plan", default="on@0x10,on@50x10,off@0x5", help="rebuild@delay_ms x kills, comma separated")
    p.add_argument("--kill-after", type=int, default=10)
    p.add_argument("--zero", type=int, default=0, help="ZeRO stage (the rebuild covers stage 0 only)")
    p.add_argument("--num-cpus", type=int, default=4)
    p.add_argument("--nodes", type=int, default=0, help="run on a ray.cluster_utils.Cluster of this many nodes (0: embedded)")
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--max-failed-starts", type=int, default=3, help="runs that never reach the kill step, retried, per scenario")
    p.add_argument("--keep", action="store_true", help="keep the scenarios already in --out (others are added or replaced)")
    p.add_argument("--out", type=Path, default=RESULTS_DIR / "redone_steps-cpu.json")
    args = p.parse_args(argv)
    run = Run("redone_steps")
    cluster, address = None, ""
    if args.nodes:
        from ray.cluster_utils import Cluster

        os.environ["RAY_AUTH_MODE"] = "disabled"
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
        for _ in range(args.nodes):
            cluster.add_node(num_cpus=args.num_cpus // args.nodes)
        address = cluster.address
    results: dict[str, Any] = {"kill_after_step": args.kill_after, "zero_stage": args.zero, "nodes": args.nodes or 1, "scenarios": {},
                               "load_avg_1m": {"start": load()}}
    if args.keep and args.out.exists():
        results["scenarios"] = json.loads(args.out.read_text()).get("scenarios", {})
    try:
        for item in [x for x in args.plan.split(",") if x]:
            mode, rest = item.split("@")
            delay, count = rest.split("x")
            kills, failed_starts = [], []
            while len(kills) < int(count):
                try:
                    kills.append(one_kill(args, mode == "on", float(delay), address) | {"load_avg_1m": load()})
                except StartFailed as exc:  # e.g. Ray's node start timing out on a loaded host: not a kill
                    failed_starts.append(str(exc)[-400:])
                    if len(failed_starts) > args.max_failed_starts:
                        raise
            redone = sum(1 for k in kills if k["lost_steps"])
            results["scenarios"][f"rebuild_{mode}_delay_{delay}ms"] = {
                "rebuild": mode == "on", "delay_ms": float(delay), "num_kills": len(kills),
                "runs_with_redone_steps": redone, "transit": pooled(kills), "kills": kills, "failed_starts": failed_starts,
            }
            run.write(results, device_type="cpu", out=args.out)  # after each scenario: a later crash keeps it
            print(f"rebuild {mode}, {delay} ms: redone steps in {redone} of {len(kills)} kills; transit {pooled(kills)}", flush=True)
    finally:
        if cluster is not None:
            cluster.shutdown()
    results["load_avg_1m"]["end"] = load()
    results["all_transit"] = pooled([k for s in results["scenarios"].values() for k in s["kills"]])
    if max(results["load_avg_1m"].values()) > 4 or any(k["load_avg_1m"] > 4 for s in results["scenarios"].values() for k in s["kills"]):
        results["note"] = "machine loaded (1-minute load average above 4 on 2 cores) by other work while this ran"
    run.write(results, device_type="cpu", out=args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
