"""Benchmark: time from launch to the first completed step, ringtrain against torchrun.

The same job on each side: the quickstart model (jobs/quickstart.yaml) at dp 4 (``--ranks``),
cp 1, ZeRO-0, every rank on this machine: gloo on CPU, or NCCL with a GPU per rank
(``--device cuda``).

- ringtrain: ``python -m ringtrain run jobs/quickstart.yaml ...`` on an embedded Ray cluster, as
  a user starts it. The first step is done when every rank's report of it is in (its line in
  metrics.jsonl says when: ``reported_at``; the line itself is written once the step's
  snapshots are safe); the phases come from summary.json's ``startup``.
- ringtrain on a running cluster: the same command with RAY_ADDRESS naming a head started once
  for the bench (``ray start --head``, 4 CPUs), as a job lands on a KubeRay cluster that is up:
  like torchrun, which finds its machine running, it starts no cluster of its own.
- torchrun: ``python -m torch.distributed.run --nproc-per-node 4 bench/startup.py --rank-main``:
  each rank initialises gloo from torchrun's environment, builds ringtrain's Trainer (same model,
  DeepSpeed engine, data) and trains one step; rank 0 stamps the wall time after it.

Repeats alternate the two sides. Both share one TORCH_EXTENSIONS_DIR (DeepSpeed's CPU comm op
is built once, not per launch), as a user's ~/.cache/torch_extensions is.

    PYTHONPATH=platform python bench/startup.py --repeats 3 [--ranks 2] [--device cuda]

Writes bench/results/startup-<device>.json (``--out`` another file, e.g. for ``--ranks 2``).

Where the ranks outnumber the cores (4 ranks on a 2-core testbed) each process's own CPU adds
up, and a Ray worker spends about 0.5 CPU-s more than a bare process starting (Ray's own
imports and connection), the node's snapshot holder as much: measure where every rank has a
core, as on a GPU node, to compare the paths to the first step rather than the CPU they share.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator, Optional

from ringtrain_dev.ray_head import TORCH_EXTENSIONS_DIR, head_env, running_head

ROOT = Path(__file__).resolve().parents[1]

TARGET_RATIO = 1.0  # first step on a running cluster, at or below torchrun's on the same workload
RANKS = 4  # the job's dp (cp 1): ranks per side, all on this machine


DEVICES = ("cpu", "cuda")


def overrides(ranks: int, device: str = "cpu") -> list[str]:
    return [f"mesh.dp={ranks}", "mesh.cp=1", "zero.stage=0", f"cluster.device={device}",
            "telemetry.metrics=false", "telemetry.tensorboard=false"]  # fmt: skip


def _env(tmp: Path, root: Path = ROOT) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    env.update(
        HOME=str(tmp),
        RAY_AUTH_MODE="disabled",
        TORCH_EXTENSIONS_DIR=str(TORCH_EXTENSIONS_DIR),
        PYTHONPATH=os.pathsep.join([str(root / "platform"), env.get("PYTHONPATH", "")]),
    )
    return env


def _launch(cmd: list[str], env: dict[str, str], tmp: Path, timeout: float) -> subprocess.Popen[bytes]:
    """Run ``cmd`` to its end in a session of its own; on a timeout the session is killed."""
    with open(tmp / "out.log", "wb") as log:
        proc = subprocess.Popen(cmd, env=env, cwd=tmp, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise RuntimeError(f"timed out after {timeout:g} s:\n" + (tmp / "out.log").read_text()[-3000:]) from None
    return proc


def _first_record(path: Path) -> dict[str, Any] | None:
    if not path.exists():
        return None
    for line in path.read_text().splitlines():
        if line.endswith("}"):
            return json.loads(line)
    return None


def run_ringtrain(
    timeout: float, root: Path = ROOT, head: Optional[dict[str, str]] = None, ranks: int = RANKS, device: str = "cpu"
) -> dict[str, Any]:
    """One run; ``head``: the environment that points it at a running cluster (else embedded)."""
    tmp = Path(tempfile.mkdtemp(prefix="rt-start-", dir="/tmp"))
    run_dir = tmp / "run"
    cmd = [sys.executable, "-m", "ringtrain", "run", str(ROOT / "jobs" / "quickstart.yaml"), *overrides(ranks, device),
           "train.steps=1", f"run_dir={run_dir}"]  # fmt: skip
    try:
        t0 = time.time()
        proc = _launch(cmd, _env(tmp, root) | (head or {}), tmp, timeout)
        t_exit = time.time()
        if proc.returncode != 0:
            raise RuntimeError((tmp / "out.log").read_text()[-3000:])
        record = _first_record(run_dir / "metrics.jsonl")
        summary = json.loads((run_dir / "summary.json").read_text())
        assert record is not None
        done = record.get("reported_at", record["time"])  # "time": written, once its snapshots are safe
        return {"first_step_s": done - t0, "exit_s": t_exit - t0, "phases": summary["startup"],
                "step_wall_s": record.get("wall_s")}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def run_torchrun(timeout: float, ranks: int = RANKS, device: str = "cpu") -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="rt-start-", dir="/tmp"))
    out = tmp / "rank0.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--standalone",
           str(Path(__file__).resolve()), "--rank-main", str(out), device]  # fmt: skip
    env = _env(tmp)
    env["BENCH_T0"] = repr(time.time())
    try:
        t0 = float(env["BENCH_T0"])
        proc = _launch(cmd, env, tmp, timeout)
        t_exit = time.time()
        if proc.returncode != 0:
            raise RuntimeError((tmp / "out.log").read_text()[-3000:])
        got = json.loads(out.read_text())
        return {"first_step_s": got["done"] - t0, "exit_s": t_exit - t0,
                "phases": {k: got[k] - t0 for k in ("imported", "process_group", "trainer")}}  # fmt: skip
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def rank_main(out: str, device_type: str) -> None:
    """One torchrun rank: gloo (NCCL on CUDA), ringtrain's Trainer for the same job, one step."""
    t_start = time.time()
    import torch
    import torch.distributed as dist

    from ringtrain import config
    from ringtrain.train.trainer import Trainer, set_rank_env

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    job = config.load(str(ROOT / "jobs" / "quickstart.yaml"), overrides(world, device_type))
    if device_type == "cuda":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, int(job.cluster.cpus_per_worker)))  # as a ringtrain worker does
    imported = time.time()
    set_rank_env(rank=rank, world_size=world, device=device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=world)
    pg = time.time()
    trainer = Trainer(job, rank=rank, device=device)
    built = time.time()
    trainer.train_step()
    done = time.time()
    if rank == 0:
        Path(out).write_text(json.dumps({"start": t_start, "imported": imported, "process_group": pg, "trainer": built, "done": done}))
    trainer.close()  # leaves the process group too


@contextlib.contextmanager
def cluster_for_runs() -> Iterator[dict[str, str]]:
    """A Ray head on free loopback ports for the bench's runs to join (``ringtrain_dev.ray_head``'s:
    its processes are ended by PID afterwards, never by ``ray stop``); the runs' environment."""
    temp_dir = Path(tempfile.mkdtemp(prefix="rts-", dir="/tmp"))  # short: Ray's socket paths live below it
    try:
        with running_head(temp_dir, head_env(temp_dir, temp_dir), dashboard=False) as (gcs, _):
            yield {"RAY_ADDRESS": f"127.0.0.1:{gcs}", "RAY_TMPDIR": str(temp_dir)}
    finally:
        shutil.rmtree(temp_dir, ignore_errors=True)


def _stats(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main(argv: list[str]) -> int:
    if argv[:1] == ["--rank-main"]:
        rank_main(argv[1], argv[2])
        return 0
    from ringtrain_dev.record import Run

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--ranks", type=int, default=RANKS, help="ranks per side (the job's mesh.dp), all on this machine")
    p.add_argument("--device", choices=DEVICES, default="cpu", help="cuda: a GPU per rank, NCCL")
    p.add_argument("--label", default="", help="stored with the result (e.g. before/after a change)")
    p.add_argument("--before-root", type=Path, help="a checkout of the code before a change: its ringtrain runs as a third side")
    p.add_argument("--out", type=Path, help="default: bench/results/startup-<device>.json")
    args = p.parse_args(argv)
    run = Run("startup")
    TORCH_EXTENSIONS_DIR.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as stack:
        return _compare(args, run, stack)


def _compare(args: argparse.Namespace, run: Any, stack: contextlib.ExitStack) -> int:
    head = stack.enter_context(cluster_for_runs())
    n, device = args.ranks, args.device
    sides: dict[str, Any] = {"ringtrain": lambda timeout: run_ringtrain(timeout, ranks=n, device=device),
                             "torchrun": lambda timeout: run_torchrun(timeout, ranks=n, device=device),
                             "ringtrain_on_cluster": lambda timeout: run_ringtrain(timeout, head=head, ranks=n, device=device)}
    if args.before_root:
        sides["ringtrain_before"] = lambda timeout: run_ringtrain(timeout, args.before_root.resolve(), ranks=n, device=device)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in sides}
    load = [os.getloadavg()[0]]
    for i in range(args.repeats):
        order = list(sides)[i % len(sides):] + list(sides)[: i % len(sides)]  # each side first in turn
        for name in order:
            got = sides[name](args.timeout) | {"load_avg_1m": os.getloadavg()[0]}
            runs[name].append(got)
            load.append(got["load_avg_1m"])
            print(f"{name}: first step {got['first_step_s']:.2f} s after launch (exit {got['exit_s']:.2f} s) {got['phases']}", flush=True)
    result: dict[str, Any] = {"job": "jobs/quickstart.yaml " + " ".join(overrides(n, device)), "ranks": n, "cores": os.cpu_count(),
                              "label": args.label, "runs": runs}
    if args.before_root:
        result["before_commit"] = subprocess.run(["git", "-C", str(args.before_root), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    for name in sides:
        result[name] = {"first_step_s": _stats([r["first_step_s"] for r in runs[name]])}
        phases = sorted({k for r in runs[name] for k in r["phases"]})
        result[name]["phases_median_s"] = {k: statistics.median(r["phases"][k] for r in runs[name] if k in r["phases"]) for k in phases}
    result["ratio_ringtrain_to_torchrun"] = result["ringtrain"]["first_step_s"]["median"] / result["torchrun"]["first_step_s"]["median"]
    result["ratio_on_cluster_to_torchrun"] = (
        result["ringtrain_on_cluster"]["first_step_s"]["median"] / result["torchrun"]["first_step_s"]["median"]
    )
    result["load_avg_1m"] = {"min": min(load), "max": max(load)}
    if max(load) > (os.cpu_count() or 1) * 2:
        result["note"] = f"machine loaded (1-minute load average above twice its {os.cpu_count()} cores) by other work while this ran"
    if args.before_root:
        result["ratio_ringtrain_to_before"] = result["ringtrain"]["first_step_s"]["median"] / result["ringtrain_before"]["first_step_s"]["median"]
    print(f"median first step: ringtrain {result['ringtrain']['first_step_s']['median']:.2f} s, "
          f"torchrun {result['torchrun']['first_step_s']['median']:.2f} s ({result['ratio_ringtrain_to_torchrun']:.2f}x); "
          f"ringtrain on a running cluster {result['ringtrain_on_cluster']['first_step_s']['median']:.2f} s "
          f"({result['ratio_on_cluster_to_torchrun']:.2f}x)")  # fmt: skip
    ratio = result["ratio_on_cluster_to_torchrun"]
    result["target"] = {"on_cluster_to_torchrun_max": TARGET_RATIO, "pass": ratio <= TARGET_RATIO}
    print(f"target first step on a running cluster vs torchrun: {ratio:.2f}x <= {TARGET_RATIO:g}x: "
          f"{'PASS' if ratio <= TARGET_RATIO else 'FAIL'}")
    run.write(result, device_type=device, out=args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
