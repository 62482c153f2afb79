"""Benchmark: steps redone after a kill that lands right after a step's record.

Each run is ``ringtrain run`` with 4 workers, dp 4, ZeRO-0 (a quickstart-sized model on gloo);
``--delay-ms`` after step ``--kill-after``'s line appears in metrics.jsonl, rank 1's pid (from
workers.json) gets SIGKILL. The incident's ``lost_steps`` counts the completed steps the
recovery redid: nonzero when the newest snapshot of the dead rank had not reached a holder yet
and could not be written from elsewhere. ``--rebuild`` on/off compares the ZeRO-0 rebuild of
such a shard from a survivor (``controllers.rebuild_from_replicas``) with restoring the newest
step held whole.

    PYTHONPATH=platform python bench/redone_steps.py --kills 10 --rebuild on,off

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
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from record import RESULTS_DIR, Run  # noqa: E402
from recovery import launch, log_tail, read_jsonl, stop  # noqa: E402

JOB = [
    "model.vocab_size=256", "model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
    "data.path=stdlib", "data.seq_len=256", "mesh.dp=4", "mesh.cp=1", "mesh.min_dp=1", "zero.stage=0",
    "train.global_batch=4", "train.micro_batch=1", "train.warmup_steps=2", "checkpoint.snapshot_every=1",
    "checkpoint.persist_every=0", "telemetry.metrics=false", "telemetry.tensorboard=false", "controllers.grow_after_s=600",
]  # fmt: skip


def one_kill(args: argparse.Namespace, rebuild: bool) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="rt-redone-", dir="/tmp"))
    run_dir = tmp / "run"
    (tmp / "job.yaml").write_text("name: bench-redone\n")
    overrides = [*JOB, f"train.steps={args.kill_after + 3}", f"run_dir={run_dir}",
                 f"controllers.rebuild_from_replicas={str(rebuild).lower()}", f"cluster.num_cpus={args.num_cpus}"]
    cmd = [sys.executable, "-m", "ringtrain", "run", str(tmp / "job.yaml"), *overrides]
    proc = launch(cmd, tmp, {"RAY_AUTH_MODE": "disabled", "HOME": str(tmp)}, tmp)
    try:
        deadline = time.monotonic() + args.timeout
        while not any(r["step"] >= args.kill_after for r in read_jsonl(run_dir / "metrics.jsonl")):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"no step {args.kill_after}:\n{log_tail(tmp)}")
            time.sleep(0.002)
        seen = time.monotonic()
        victim = json.loads((run_dir / "workers.json").read_text())["workers"][1]["pid"]
        time.sleep(max(0.0, args.delay_ms / 1000 - (time.monotonic() - seen)))
        os.kill(victim, signal.SIGKILL)
        proc.wait(timeout=args.timeout)
        incidents = [json.loads(p.read_text()) for p in sorted((run_dir / "incidents").glob("*.json"))]
        summary = json.loads((run_dir / "summary.json").read_text())
        return {
            "status": summary["status"],
            "lost_steps": sum(i["lost_steps"] for i in incidents),
            "incidents": [(i["kind"], i["action"], i["detected_at_step"]) for i in incidents],
            "snapshot_s": [r["snapshot_s"] for r in read_jsonl(run_dir / "metrics.jsonl")][-1],
        }
    finally:
        stop(proc, tmp)
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kills", type=int, default=10)
    p.add_argument("--kill-after", type=int, default=10)
    p.add_argument("--delay-ms", type=float, default=50.0)
    p.add_argument("--rebuild", default="on,off")
    p.add_argument("--num-cpus", type=int, default=4)
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--out", type=Path, default=RESULTS_DIR / "redone_steps-cpu.json")
    args = p.parse_args(argv)
    run = Run("redone_steps")
    results: dict[str, Any] = {"kill_after_step": args.kill_after, "delay_ms": args.delay_ms, "scenarios": {}}
    for mode in [m for m in args.rebuild.split(",") if m]:
        kills = [one_kill(args, mode == "on") for _ in range(args.kills)]
        redone = sum(1 for k in kills if k["lost_steps"])
        results["scenarios"][f"rebuild_{mode}"] = {"kills": kills, "runs_with_redone_steps": redone, "num_kills": len(kills)}
        print(f"rebuild {mode}: redone steps in {redone} of {len(kills)} kills", flush=True)
    run.write(results, device_type="cpu", out=args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
