"""Benchmark: what a graceful stop's save costs, against a plain stop in the same session.

The tiny CPU job of the Ray-tier tests (``ringtrain_dev.tiny.TINY``: dp 2 x cp 2 on an
embedded cluster) runs with durable checkpoints every 50 steps and gets SIGTERM once step
``--at`` is recorded, between two durable checkpoints:

- plain: ``checkpoint.stop_persist_timeout_s=0``: the stop saves nothing (the steps since the
  last durable checkpoint are lost, as before the stop's save existed);
- saving: the default bound: the stop writes the newest in-memory snapshot to the store.

Each stop is timed from the signal to the process's exit (the summary, the report and the
cluster's shutdown included, on both sides); the extra seconds are the saving stop's median
minus the plain stop's. Repeats alternate the two sides.

    PYTHONPATH=platform python bench/stop.py [--repeats 1] [--at 4]

Writes bench/results/stop-cpu.json.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import signal
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from ringtrain_dev.cli_runs import QUICKSTART, Background
from ringtrain_dev.record import Run
from ringtrain_dev.tiny import TINY

TARGET_EXTRA_S = 10.0  # the stop's save adds less than this (its bound's default is 20 s, Kubernetes' grace 30 s)
SIDES = {"plain": ["checkpoint.stop_persist_timeout_s=0"], "saving": []}


def stop_once(side: str, at: int, work: Path) -> dict[str, Any]:
    """One run of ``side`` stopped by SIGTERM once step ``at`` is recorded."""
    ray_tmp = Path(tempfile.mkdtemp(prefix="rtb-", dir="/tmp"))  # short: Ray's socket paths live below it
    run_dir = work / "run"
    try:
        args = [str(QUICKSTART), *TINY, "train.steps=100000", "checkpoint.persist_every=50", f"run_dir={run_dir}", *SIDES[side]]
        run = Background(args, home=work, ray_tmp=ray_tmp, logs=work / "logs")
        try:
            run.wait_for_steps(run_dir, at)
            code, seconds = run.stop(signal.SIGTERM)
        finally:
            run.kill()
        summary = json.loads((run_dir / "summary.json").read_text())
        line = next((ln for ln in run.stdout.splitlines() if ln.startswith("stop: ")), "")
        saved = re.search(r" in ([0-9.]+) s$", line) if line.startswith("stop: saved") else None
        return {
            "side": side,
            "exit_code": code,
            "stop_s": round(seconds, 3),
            "final_step": summary["final_step"],
            "last_durable_step": summary["last_durable_step"],
            "stop_line": line,
            "save_s": float(saved.group(1)) if saved else None,
        }
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--at", type=int, default=4, help="SIGTERM once this many steps are recorded")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    run = Run("stop")
    stops: list[dict[str, Any]] = []
    for repeat in range(args.repeats):
        for side in SIDES:
            with tempfile.TemporaryDirectory(prefix="bench-stop-") as work:
                stops.append(stop_once(side, args.at, Path(work)))
            print(f"repeat {repeat + 1} {side}: {json.dumps(stops[-1])}", flush=True)
    plain = statistics.median(s["stop_s"] for s in stops if s["side"] == "plain")
    saving = statistics.median(s["stop_s"] for s in stops if s["side"] == "saving")
    lost_nothing = all(s["last_durable_step"] == s["final_step"] for s in stops if s["side"] == "saving")
    extra = saving - plain
    ok = extra < TARGET_EXTRA_S and lost_nothing and all(s["exit_code"] == 1 for s in stops)
    print(
        f"stop: plain {plain:.2f} s, saving the newest snapshot {saving:.2f} s: +{extra:.2f} s "
        f"(ratio {saving / plain:.2f}); saved the last recorded step: {lost_nothing}; "
        f"target +{TARGET_EXTRA_S:g} s: {'PASS' if ok else 'FAIL'}"
    )
    run.write(
        {
            "job": "tests/ray/test_run_e2e.py TINY (dp 2 x cp 2, embedded Ray, CPU), checkpoint.persist_every=50",
            "signal_at_step": args.at,
            "repeats": args.repeats,
            "plain_stop_s": round(plain, 3),
            "saving_stop_s": round(saving, 3),
            "extra_s": round(extra, 3),
            "ratio": round(saving / plain, 3),
            "target_extra_s": TARGET_EXTRA_S,
            "lost_no_step": lost_nothing,
            "pass": ok,
            "stops": stops,
        },
        device_type="cpu",
        out=args.out,
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
