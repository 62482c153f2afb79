"""Benchmark: what the experiment trackers cost a training step.

Two measurements in one run, against a real MLflow tracking server started here on loopback
(sqlite backend) and W&B in offline mode:

1. The step's critical path: the driver's time inside the trackers' ``step`` call (the sinks
   only queue; a thread per tracker sends), over ``--records`` metrics records.
2. End to end: the quickstart job (``--steps`` steps, dp 1 x cp 2, tiny sequences) run with
   both trackers off and on, alternately, ``--repeats`` times each; the median step time of
   each (the first two steps of a run left out: start-up). PASS when on / off <= 1.01.

On this CPU testbed the driver, the workers and the tracker threads share two cores, so (2) is
an upper bound of what a GPU node, whose driver has a core of its own, would see.

Usage: python bench/trackers.py [--steps 12] [--repeats 2] [--records 500] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ringtrain_dev.record import Run
from ringtrain_dev.tiny import TINY_MODEL

ROOT = Path(__file__).resolve().parents[1]

TARGET = 1.01
WARMUP_STEPS = 2
TINY = [*TINY_MODEL, "data.seq_len=256", "train.global_batch=4", "mesh.dp=1", "mesh.cp=2", "cluster.num_cpus=2"]


def critical_path(uri: str, folder: Path, records: int) -> dict[str, float]:
    from ringtrain import config
    from ringtrain.telemetry.rundir import RunDir
    from ringtrain.telemetry.trackers import open_trackers
    from ringtrain_dev.fake_run import step_record

    job = config.load(str(ROOT / "jobs" / "quickstart.yaml"), [
        f"telemetry.mlflow.tracking_uri={uri}", "telemetry.wandb.project=bench", "telemetry.wandb.mode=offline"])  # fmt: skip
    run_dir = RunDir(folder / "critical")
    trackers = open_trackers(job, run_dir, print)
    assert trackers is not None
    times = []
    for step in range(1, records + 1):
        record = step_record(step)
        started = time.perf_counter()
        trackers.step(record)
        times.append(time.perf_counter() - started)
    trackers.close()
    run_dir.close()
    started = time.perf_counter()
    trackers.finish("finished")
    return {
        "records": records,
        "step_call_median_s": statistics.median(times),
        "step_call_p99_s": sorted(times)[int(0.99 * len(times)) - 1],
        "step_call_max_s": max(times),
        "finish_s": time.perf_counter() - started,
    }


def median_step_time(run_dir: Path) -> float:
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return statistics.median(r["step_time_s"] for r in lines[WARMUP_STEPS:])


def train(folder: Path, name: str, steps: int, extra: list[str]) -> float:
    run_dir = folder / name
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true", "PYTHONPATH": str(ROOT / "platform")}
    command = [sys.executable, "-m", "ringtrain", "run", str(ROOT / "jobs" / "quickstart.yaml"), *TINY,
               f"train.steps={steps}", f"run_dir={run_dir}", "telemetry.progress=false", *extra]  # fmt: skip
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise SystemExit(f"{name}: exit {done.returncode}: {done.stderr[-2000:]}")
    return median_step_time(run_dir)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--records", type=int, default=500)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    from ringtrain_dev.mlflow_server import running_mlflow

    run = Run("trackers")
    with tempfile.TemporaryDirectory(prefix="rt-trackers-") as tmp:
        folder = Path(tmp)
        with running_mlflow(folder / "mlflow") as server:
            path = critical_path(server.uri, folder, args.records)
            on_args = [f"telemetry.mlflow.tracking_uri={server.uri}", "telemetry.wandb.project=bench", "telemetry.wandb.mode=offline"]
            off, on = [], []
            for i in range(args.repeats):
                off.append(train(folder, f"off-{i}", args.steps, []))
                on.append(train(folder, f"on-{i}", args.steps, on_args))
    ratio = statistics.median(on) / statistics.median(off)
    ok = ratio <= TARGET
    print(f"critical path: trackers.step median {path['step_call_median_s'] * 1e6:.0f} us, p99 {path['step_call_p99_s'] * 1e6:.0f} us, "
          f"max {path['step_call_max_s'] * 1e3:.2f} ms over {args.records} records; finish {path['finish_s']:.2f} s")  # fmt: skip
    print(f"step time, median of {args.repeats} runs each: off {statistics.median(off):.4f} s, on {statistics.median(on):.4f} s")
    print(f"trackers on / off: {ratio:.4f} (target <= {TARGET}) {'PASS' if ok else 'FAIL'}")
    out = run.write(
        {"target_ratio": TARGET, "pass": ok, "ratio": ratio, "step_time_off_s": off, "step_time_on_s": on,
         "critical_path": path, "steps": args.steps, "warmup_steps": WARMUP_STEPS, "job": TINY},  # fmt: skip
        device_type="cpu",
        out=args.out,
    )
    print(f"wrote {out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
