"""Benchmark: crash recovery of ringtrain against torchrun with per-step disk checkpoints.

Workload, the same on both sides: 4 gloo ranks on CPU (dp 2 x cp 2, zigzag ring attention,
ZeRO-2), a ~1.6M-parameter Llama (dim 128, 8 layers, 4 heads, 2 KV heads, byte vocabulary) on
the stdlib corpus, micro batch 1; seq_len 512 and global batch 2 give a ~0.3-0.4 s step on a
2-core machine (global batch 4, two micro batches per replica, took ~0.55 s). Everything
launched shares the repo's TORCH_EXTENSIONS_DIR, so DeepSpeed builds its CPU comm op once
rather than in every new process (~25 s).

Method. After step ``--first-kill``'s record appears the bench sleeps a random 0.3-0.7 of the
median step time, so the kill lands mid-step, and SIGKILLs the process of one random rank
(seeded). Each later kill comes ``--kill-every`` steps after the last, and only once the first
step after the last kill is done and the run is back at full strength (workers.json: dp 2 and
the scenario's warm spares), so every kill of a scenario tests the same recovery path. Per kill:

- kill -> next step: the first step record timed after the kill, minus the kill time;
- redone steps: last step completed before the kill - (that record's step - 1);
- ringtrain only: detection = incident ``detected_at`` - kill time, and the incident's
  ``lost_steps``; a kill owns the failure incidents detected in [its time, the next kill).

Baseline: torchrun (PyTorch elastic), ``--standalone --nnodes 1 --nproc-per-node 4
--max-restarts 3 --monitor-interval 0.1``, TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (see RDZV).
Each rank is this file run with ``--worker``: it builds ringtrain's Trainer, restores the newest
step whose 4 rank files all exist, and after every step writes ``trainer.snapshot(step).blob``
(tmp name + os.replace; the last 2 steps kept). A torchrun run stops at step first-kill +
kill-every (``train.stop_at_step``: the same schedule); a ringtrain run trains ``--steps``.

ringtrain: ``python -m ringtrain run <job.yaml> key=value ...`` on an embedded Ray cluster
(``cluster.num_cpus=4``) in three scenarios: ``shrink`` (no spare, min_dp 1), ``warm_spare``
(one warm spare actor), ``cold_replace`` (no spare, min_dp 2: a new actor must start). The
victim's pid comes from ``<run_dir>/workers.json``, read at every kill; step records from
``metrics.jsonl``, incidents from ``incidents/*.json``, the outcome from ``summary.json``.

Ratios: each scenario's kill -> next step p50 over torchrun's, measured in the same run. The
machine may be shared: each kill records the 1-minute load average (ours included).

    PYTHONPATH=platform python bench/recovery.py [--scenarios shrink,warm_spare,cold_replace,torchrun]
        [--kills 4] [--runs 5] [--steps 200] [--seed 0]

Writes bench/results/recovery-cpu.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from record import RESULTS_DIR, Run  # noqa: E402

TORCH_EXTENSIONS_DIR = ROOT / ".ringtrain-cache" / "torch_extensions"
WORLD = 4
# shrink: grows back 2 s after capacity returns (default 10 s), so kills can come every few steps.
RINGTRAIN_SCENARIOS: dict[str, dict[str, float]] = {
    "shrink": {"mesh.spares": 0, "mesh.min_dp": 1, "controllers.grow_after_s": 2},
    "warm_spare": {"mesh.spares": 1},
    "cold_replace": {"mesh.spares": 0, "mesh.min_dp": 2},
}
FAILURE_KINDS = ("crash", "node_lost", "hang", "error")
# torchrun rendezvous: launcher flags, agent environment. Tried on torch 2.13: by default the c10d
# agent of --standalone keeps one TCPStore for every round, and restarted ranks read the dead
# ranks' gloo addresses from it: the restart failed ("Gloo connectFullMesh failed ... Connection
# refused") or hung in init_process_group. The static backend reuses its store the same way and
# failed every restart until --max-restarts ran out. A fresh store per round (rank 0 hosts it on a
# free port) recovered every time: the default here; --rdzv picks the others to reproduce this.
RDZV: dict[str, tuple[list[str], dict[str, str]]] = {
    "standalone": (["--standalone"], {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}),
    "standalone-shared-store": (["--standalone"], {}),
    "static": (["--rdzv-backend", "static", "--master-addr", "127.0.0.1", "--master-port", "{port}"], {}),
}
POLL_S = 0.01
Records = list[dict[str, Any]]


class RunFailed(Exception):
    """The run under test broke the contract the bench relies on; the message says how."""


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scenarios", default="shrink,warm_spare,cold_replace,torchrun")
    p.add_argument("--kills", type=int, default=4, help="kills per ringtrain run")
    p.add_argument("--runs", type=int, default=5, help="torchrun runs, one kill each")
    p.add_argument("--steps", type=int, default=200, help="steps of a ringtrain run (its schedule everywhere)")
    p.add_argument("--first-kill", type=int, default=10, help="the first kill lands in the step after this one")
    p.add_argument("--kill-every", type=int, default=8, help="steps between kills")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--global-batch", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rdzv", choices=sorted(RDZV), default="standalone", help="torchrun rendezvous")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one run may take")
    p.add_argument("--startup-timeout", type=float, default=180.0, help="seconds for workers.json to appear")
    p.add_argument("--out", type=Path, default=RESULTS_DIR / "recovery-cpu.json")
    p.add_argument("--worker", type=Path, help=argparse.SUPPRESS)  # a torchrun rank; the value is its workdir
    args = p.parse_args(argv)
    args.scenarios = [s for s in args.scenarios.split(",") if s]
    unknown = set(args.scenarios) - set(RINGTRAIN_SCENARIOS) - {"torchrun"}
    if unknown:
        p.error(f"unknown scenarios {sorted(unknown)}")
    if args.steps < args.first_kill + (args.kills - 1) * args.kill_every + 5:
        p.error("--steps leaves no room for the kills: raise it or lower --kills / --kill-every")
    return args


def workload(args: argparse.Namespace) -> list[str]:
    return [
        "model.vocab_size=256", "model.dim=128", "model.n_layers=8", "model.n_heads=4", "model.n_kv_heads=2",
        "data.path=stdlib", f"data.seq_len={args.seq_len}", "mesh.dp=2", "mesh.cp=2", "attention.impl=ring",
        "zero.stage=2", f"train.global_batch={args.global_batch}", "train.micro_batch=1",
        f"train.steps={args.steps}", "train.warmup_steps=5", f"train.seed={args.seed}", "checkpoint.snapshot_every=1",
    ]


# --- a torchrun rank ----------------------------------------------------------------------------


def ckpt_file(folder: Path, step: int, rank: int) -> Path:
    return folder / f"step-{step:06d}-rank-{rank}.bin"


def complete_steps(folder: Path) -> list[int]:
    """Steps whose every rank file exists, oldest first."""
    counts: dict[int, int] = {}
    for f in folder.glob("step-*-rank-*.bin"):
        step = int(f.name.split("-")[1])
        counts[step] = counts.get(step, 0) + 1
    return sorted(s for s, n in counts.items() if n == WORLD)


def append_jsonl(path: Path, record: dict[str, Any]) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")


def process_age_s() -> float:
    """Seconds since this process started (Linux; to a clock tick)."""
    start_ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
    return float(Path("/proc/uptime").read_text().split()[0]) - start_ticks / os.sysconf("SC_CLK_TCK")


def worker_main(workdir: Path) -> int:
    import logging

    import torch
    import torch.distributed as dist
    from deepspeed.utils import logger as ds_logger

    from ringtrain import config
    from ringtrain.train.trainer import Trainer, set_rank_env

    imported = time.time()
    created = imported - process_age_s()
    torch.set_num_threads(1)
    ds_logger.setLevel(logging.WARNING)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    (workdir / f"pid-{rank}").write_text(str(os.getpid()))
    device = torch.device("cpu")
    set_rank_env(rank=rank, world_size=world, device=device)
    dist.init_process_group("gloo")  # env:// from torchrun
    trainer = Trainer(config.load(None, json.loads((workdir / "overrides.json").read_text())), rank=rank, device=device)
    ckpt, progress = workdir / "ckpt", workdir / "progress.jsonl"
    done = complete_steps(ckpt)
    resumed = trainer.restore([ckpt_file(ckpt, done[-1], r).read_bytes() for r in range(world)]) if done else 0
    if rank == 0:
        start = {"time": time.time(), "created": created, "imported": imported, "resumed_step": resumed}
        append_jsonl(progress, {"event": "start", **start})
    while trainer.step < trainer.job.last_step:
        trainer.train_step()
        step, tmp = trainer.step, ckpt / f".tmp-{rank}"
        tmp.write_bytes(trainer.snapshot(step).blob)
        os.replace(tmp, ckpt_file(ckpt, step, rank))
        # Every rank finished writing step - 1 before this step's collectives let us get here.
        ckpt_file(ckpt, step - 2, rank).unlink(missing_ok=True)
        if rank == 0:
            append_jsonl(progress, {"step": step, "time": time.time(), "pid": os.getpid()})
    trainer.close()
    return 0


# --- processes ----------------------------------------------------------------------------------


def launch(cmd: list[str], tmp: Path, extra_env: dict[str, str], cwd: Path) -> subprocess.Popen[bytes]:
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    env.update(
        extra_env,
        TORCH_EXTENSIONS_DIR=str(TORCH_EXTENSIONS_DIR),
        PYTHONPATH=os.pathsep.join([str(ROOT / "platform"), env.get("PYTHONPATH", "")]),
        RINGTRAIN_BENCH_TMP=str(tmp),  # every process of the run inherits it: how stop() finds them
    )
    with open(tmp / "out.log", "wb") as log:
        return subprocess.Popen(cmd, env=env, cwd=cwd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def ours(tmp: Path) -> set[int]:
    """Pids of the live processes started for the run whose temp dir is ``tmp``."""
    import psutil

    found = set()
    for proc in psutil.process_iter():
        try:
            if proc.environ().get("RINGTRAIN_BENCH_TMP") == str(tmp):
                found.add(proc.pid)
        except (psutil.Error, OSError):
            continue
    return found


def stop(proc: subprocess.Popen[bytes], tmp: Path) -> None:
    """SIGKILL the run's session and every process carrying its marker (torchrun's ranks and
    Ray's workers start sessions of their own), by pid."""
    for _ in range(3):
        for kill, pid in [(os.killpg, proc.pid), *((os.kill, p) for p in ours(tmp))]:
            try:
                kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait(timeout=30)
        time.sleep(0.2)
        if not ours(tmp):
            return


def log_tail(tmp: Path, num_chars: int = 2000) -> str:
    return (tmp / "out.log").read_text(errors="replace")[-num_chars:] if (tmp / "out.log").exists() else ""


def read_jsonl(path: Path) -> Records:
    """The complete JSON lines of a file another process appends to."""
    out = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a line still being written
            continue
    return out


def wait_for(found: Callable[[], Any], proc: subprocess.Popen[bytes], deadline: float) -> Any:
    """Poll until ``found()`` is truthy; None once the process has exited or the deadline passed."""
    while time.time() < deadline:
        value = found()
        if value or proc.poll() is not None:
            return value or found() or None
        time.sleep(POLL_S)
    return None


# --- the kills ----------------------------------------------------------------------------------


def median_step_s(records: Records, since: float) -> float:
    """Median time between consecutive step records after ``since`` (the latest kill)."""
    recent = [r for r in records if r["time"] > since]
    gaps = [b["time"] - a["time"] for a, b in zip(recent, recent[1:]) if b["step"] == a["step"] + 1]
    return statistics.median(gaps) if gaps else 0.3


def drive_kills(
    proc: subprocess.Popen[bytes],
    steps: Callable[[], Records],
    victims: Callable[[], list[tuple[int, int]]],
    ready: Callable[[], bool],
    num_kills: int,
    args: argparse.Namespace,
    rng: random.Random,
    deadline: float,
) -> Records:
    """SIGKILL a random rank mid-step ``num_kills`` times: in the step after step ``--first-kill``,
    then ``--kill-every`` steps after the last kill, or later: only once ``ready()`` (the run is at
    full strength again) was seen before a step completed. Returns the kills made."""

    def newest(after: float) -> Optional[dict[str, Any]]:
        records = steps()
        return records[-1] if records and records[-1]["time"] > after else None

    kills: Records = []
    planned = args.first_kill
    while len(kills) < num_kills:
        since = kills[-1]["time"] if kills else 0.0
        if not wait_for(lambda: (newest(since) or {"step": 0})["step"] >= planned - 1 and ready(), proc, deadline):
            break
        seen = time.time()
        rec = wait_for(lambda: newest(seen), proc, deadline)
        candidates = victims() if rec else []
        if not candidates:
            break
        rank, pid = rng.choice(candidates)
        fraction = rng.uniform(0.3, 0.7)
        time.sleep(max(0.0, rec["time"] + fraction * median_step_s(steps(), since) - time.time()))
        t = time.time()
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            break
        kills.append({"time": t, "after_step": rec["step"], "rank": rank, "pid": pid, "fraction": fraction,
                      "loadavg_1m": os.getloadavg()[0]})
        if wait_for(lambda: any(r["time"] > t for r in steps()), proc, deadline) is None:
            break
        planned = rec["step"] + args.kill_every
    return kills


def measure_kill(kill: dict[str, Any], records: Records) -> dict[str, Any]:
    last = max((r["step"] for r in records if r["time"] <= kill["time"]), default=0)
    nxt = min((r for r in records if r["time"] > kill["time"]), key=lambda r: r["time"], default=None)
    out = dict(kill, last_step_before=last, next_step=None, next_step_s=None, redone_steps=None)
    if nxt is not None:
        out.update(next_step=nxt["step"], next_step_s=nxt["time"] - kill["time"], redone_steps=last - (nxt["step"] - 1))
    return out


# --- torchrun -----------------------------------------------------------------------------------


def torchrun_overrides(args: argparse.Namespace) -> list[str]:
    """The workload, ended early (same schedule): one kill needs no more steps than this."""
    return [*workload(args), f"train.stop_at_step={args.first_kill + args.kill_every}"]


def torchrun_cmd(workdir: Path, rdzv: str) -> list[str]:
    port = random.SystemRandom().randrange(20000, 30000)  # static only; above Ray's 10002-19999
    flags = [f.format(port=port) for f in RDZV[rdzv][0]]
    return [sys.executable, "-m", "torch.distributed.run", *flags, "--nnodes", "1", "--nproc-per-node", str(WORLD),
            "--max-restarts", "3", "--monitor-interval", "0.1", str(Path(__file__).resolve()), "--worker", str(workdir)]


def run_torchrun(args: argparse.Namespace, rng: random.Random) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="rtb-tr-", dir="/tmp"))
    (tmp / "ckpt").mkdir()
    (tmp / "overrides.json").write_text(json.dumps(torchrun_overrides(args)))
    progress = tmp / "progress.jsonl"
    proc = launch(torchrun_cmd(tmp, args.rdzv), tmp, {"OMP_NUM_THREADS": "1", **RDZV[args.rdzv][1]}, ROOT)
    deadline = time.time() + args.timeout

    def steps() -> Records:
        return [r for r in read_jsonl(progress) if "step" in r]

    def victims() -> list[tuple[int, int]]:
        alive = ours(tmp)  # a pid file may still name a rank of the last attempt
        pids = [(r, int((tmp / f"pid-{r}").read_text())) for r in range(WORLD)]
        return [(r, pid) for r, pid in pids if pid in alive]

    try:
        kills = drive_kills(proc, steps, victims, lambda: True, 1, args, rng, deadline)
        exited = wait_for(lambda: proc.poll() is not None, proc, deadline)
        records, starts = steps(), [r for r in read_jsonl(progress) if r.get("event") == "start"]
        measured = [measure_kill(k, records) for k in kills]
        for k in measured:  # where the time went: rank 0 respawned, torch + DeepSpeed imported, restored
            start = next((s for s in starts if s["time"] > k["time"]), None)
            if start is not None:
                k.update(created_s=start["created"] - k["time"], imported_s=start["imported"] - k["time"],
                         restored_s=start["time"] - k["time"])
        last = args.first_kill + args.kill_every
        finished = bool(exited) and proc.returncode == 0 and max((r["step"] for r in records), default=0) == last
        return {"finished": finished, "returncode": proc.poll(), "restarts": len(starts) - 1,
                "resumed_steps": [s["resumed_step"] for s in starts[1:]], "step_s": median_step_s(records, 0.0),
                "kills": measured, "log_tail": None if finished else log_tail(tmp)}
    finally:
        stop(proc, tmp)
        shutil.rmtree(tmp, ignore_errors=True)


# --- ringtrain ----------------------------------------------------------------------------------


def scenario_overrides(scenario: str) -> list[str]:
    return [f"{key}={value}" for key, value in RINGTRAIN_SCENARIOS[scenario].items()]


def runtime_overrides(run_dir: Path) -> list[str]:
    """ringtrain's own settings: where the run writes, no exporters, an embedded 4-CPU Ray cluster."""
    return [f"run_dir={run_dir}", "telemetry.metrics=false", "telemetry.tensorboard=false", "cluster.num_cpus=4"]


def incidents_of(run_dir: Path) -> Records:
    folder = run_dir / "incidents"
    return [json.loads(f.read_text()) for f in sorted(folder.glob("*.json"))] if folder.is_dir() else []


def match_incidents(kills: Records, incidents: Records) -> None:
    """Give each kill the failure incidents detected in its window [kill, next kill)."""
    failures = sorted((i for i in incidents if i.get("kind") in FAILURE_KINDS), key=lambda i: i["detected_at"])
    for k, kill in enumerate(kills):
        end = kills[k + 1]["time"] if k + 1 < len(kills) else float("inf")
        mine = [i for i in failures if kill["time"] <= i["detected_at"] < end]
        first: dict[str, Any] = mine[0] if mine else {}
        kill.update(
            incident_ids=[i["id"] for i in mine],
            kind=first.get("kind"),
            action=first.get("action"),
            detect_s=first["detected_at"] - kill["time"] if first else None,
            recover_s=first.get("recover_s"),
            lost_steps=first.get("lost_steps"),
            lost_steps_agree=bool(first) and first.get("lost_steps") == kill["redone_steps"],
            dp_before=first.get("dp_before"),
            dp_after=first.get("dp_after"),
        )


def watch_ringtrain(args: argparse.Namespace, scenario: str, proc: subprocess.Popen[bytes], tmp: Path,
                    rng: random.Random) -> dict[str, Any]:
    run_dir = tmp / "run"
    deadline, workers = time.time() + args.timeout, run_dir / "workers.json"
    if wait_for(workers.exists, proc, min(deadline, time.time() + args.startup_timeout)) is None:
        state = f"exited with {proc.returncode}" if proc.poll() is not None else "still running"
        raise RunFailed(f"{workers} never appeared within {args.startup_timeout:.0f} s (ringtrain {state})")

    def steps() -> Records:
        records = read_jsonl(run_dir / "metrics.jsonl")
        if records and "time" not in records[0]:
            raise RunFailed(f"{run_dir}/metrics.jsonl has no 'time' (unix seconds) in its records")
        return records

    def victims() -> list[tuple[int, int]]:
        alive = ours(tmp)
        return [(w["rank"], w["pid"]) for w in json.loads(workers.read_text())["workers"] if w["pid"] in alive]

    def ready() -> bool:
        """Back at full strength: every replica, and the warm spares the scenario keeps."""
        layout = json.loads(workers.read_text())
        return layout["dp"] >= 2 and len(layout.get("spares", [])) >= RINGTRAIN_SCENARIOS[scenario]["mesh.spares"]

    kills = drive_kills(proc, steps, victims, ready, args.kills, args, rng, deadline)
    wait_for(lambda: proc.poll() is not None, proc, deadline)
    measured = [measure_kill(k, steps()) for k in kills]
    match_incidents(measured, incidents_of(run_dir))
    summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").exists() else {}
    return {"finished": proc.poll() == 0 and summary.get("status") == "finished", "returncode": proc.poll(),
            "step_s": median_step_s(steps(), 0.0), "kills": measured, "goodput": summary.get("goodput"),
            "ledger": summary.get("ledger"), "num_recoveries": len(summary.get("recoveries", []))}


def run_ringtrain(args: argparse.Namespace, scenario: str, rng: random.Random) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="rtb-", dir="/tmp"))  # short: Ray's socket paths live below it
    for sub in ("ray", "home"):
        (tmp / sub).mkdir()
    (tmp / "job.yaml").write_text(f"name: bench-recovery-{scenario}\n")
    env = {"HOME": str(tmp / "home"), "RAY_TMPDIR": str(tmp / "ray"), "RAY_AUTH_MODE": "disabled"}
    cmd = [sys.executable, "-m", "ringtrain", "run", str(tmp / "job.yaml"), *workload(args),
           *scenario_overrides(scenario), *runtime_overrides(tmp / "run")]
    proc = launch(cmd, tmp, env, tmp)
    try:
        result = watch_ringtrain(args, scenario, proc, tmp, rng)
    except RunFailed as exc:
        result = {"finished": False, "returncode": proc.poll(), "kills": [], "error": str(exc)}
    finally:
        stop(proc, tmp)
        tail = log_tail(tmp)
        shutil.rmtree(tmp, ignore_errors=True)
    return dict(result, log_tail=None if result["finished"] else tail)


# --- results ------------------------------------------------------------------------------------


def dist_stats(values: list[Any]) -> dict[str, Any]:
    """n, p50, p99 (numpy's linear interpolation between ranks) and max of the values given."""
    import numpy as np

    xs = [float(v) for v in values if v is not None]
    p50, p99 = (float(np.percentile(xs, q)) for q in (50, 99)) if xs else (None, None)
    return {"n": len(xs), "p50": p50, "p99": p99, "max": max(xs, default=None)}


def summarize(name: str, runs: list[dict[str, Any]], num_planned: int) -> dict[str, Any]:
    kills = [k for r in runs for k in r["kills"]]
    extra = ["created_s", "imported_s", "restored_s"] if name == "torchrun" else ["detect_s", "lost_steps"]
    return {
        "num_runs": len(runs), "num_finished": sum(r["finished"] for r in runs),
        "all_finished": bool(runs) and all(r["finished"] for r in runs),
        "num_kills": len(kills), "num_kills_planned": num_planned,
        "num_unrecovered": sum(k["next_step_s"] is None for k in kills),  # no step completed after the kill
        **({} if name == "torchrun" else {"num_undetected": sum(k["detect_s"] is None for k in kills)}),
        "kill_to_next_step_s": dist_stats([k["next_step_s"] for k in kills]),
        "redone_steps": dist_stats([k["redone_steps"] for k in kills]),
        **{key: dist_stats([k.get(key) for k in kills]) for key in extra},
        **({"restarts": sum(r["restarts"] for r in runs)} if name == "torchrun" else {}),
        "runs": runs,
    }


def targets(results: dict[str, dict[str, Any]]) -> Records:
    def p50(name: str) -> Optional[float]:
        return results[name]["kill_to_next_step_s"]["p50"] if name in results else None

    detect_s = [k["detect_s"] for n, r in results.items() if n != "torchrun" for run in r["runs"] for k in run["kills"]]
    detect = dist_stats(detect_s)
    undetected = None in detect_s  # a kill that no incident owns was never detected: fails detection
    rows = [
        ("detection p50, all ringtrain kills", detect["p50"], "<=", 0.2, undetected),
        ("detection p99, all ringtrain kills", detect["p99"], "<=", 1.0, undetected),
        ("shrink kill->next step p50", p50("shrink"), "<=", 1.0, False),
        ("warm_spare kill->next step p50", p50("warm_spare"), "<=", 1.0, False),
        ("cold_replace kill->next step p50, vs torchrun p50", p50("cold_replace"), "<", p50("torchrun"), False),
    ]
    out = []
    for name, value, op, bound, missed in rows:
        ok = None if value is None or bound is None else (value <= bound if op == "<=" else value < bound)
        out.append({"target": name, "value": value, "op": op, "bound": bound, "pass": False if missed else ok})
    return out


def fmt(*xs: Optional[float], spec: str = ".2f") -> str:
    return " / ".join("-" if x is None else format(x, spec) for x in xs)


def report(results: dict[str, dict[str, Any]], ratios: dict[str, Optional[float]], checks: Records) -> str:
    lines = [f"{'scenario':<14}{'kills':>6}{'finished':>10}{'detect p50/p99 s':>18}"
             f"{'kill->next step p50/p99/max s':>32}{'redone p50/max':>16}"]
    for name, r in results.items():
        d, n, redone = r.get("detect_s"), r["kill_to_next_step_s"], r["redone_steps"]
        lines.append(f"{name:<14}{r['num_kills']:>6}{str(r['num_finished']) + '/' + str(r['num_runs']):>10}"
                     f"{fmt(d['p50'], d['p99']) if d else '-':>18}{fmt(n['p50'], n['p99'], n['max']):>32}"
                     f"{fmt(redone['p50'], redone['max'], spec='.0f'):>16}")
    if "torchrun" in results:
        tr = results["torchrun"]
        lines.append(f"torchrun: {tr['restarts']} restarts; after the kill (p50): rank 0 respawned "
                     f"{fmt(tr['created_s']['p50'])} s, imports done {fmt(tr['imported_s']['p50'])} s, "
                     f"restored {fmt(tr['restored_s']['p50'])} s")
    lines += [f"{name}: kill->next step p50 = {fmt(ratio, spec='.3f')}x torchrun's" for name, ratio in ratios.items()]
    for c in checks:
        verdict = {True: "PASS", False: "FAIL", None: "n/a"}[c["pass"]]
        value, bound = fmt(c["value"], spec=".3f"), fmt(c["bound"], spec=".3f")
        lines.append(f"target {c['target']}: {value} {c['op']} {bound}: {verdict}")
    lines += [f"{name} run {i}: {run['error']}" for name, r in results.items()
              for i, run in enumerate(r["runs"]) if run.get("error")]
    lines += [f"{name}: {r['num_kills']} of {r['num_kills_planned']} kills made: the run ended, or was not back at "
              "full strength (dp 2 and its warm spares) in time" for name, r in results.items()
              if r["num_kills"] < r["num_kills_planned"]]
    lines += [f"{name}: {r[key]} kill(s) {what}" for name, r in results.items()
              for key, what in (("num_unrecovered", "never followed by a step"), ("num_undetected", "with no incident"))
              if r.get(key)]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.worker is not None:
        return worker_main(args.worker)
    run = Run("recovery")
    rng = random.Random(args.seed)
    results: dict[str, dict[str, Any]] = {}
    for name in args.scenarios:
        if name == "torchrun":
            runs, planned = [run_torchrun(args, rng) for _ in range(args.runs)], args.runs
        else:
            runs, planned = [run_ringtrain(args, name, rng)], args.kills
        results[name] = summarize(name, runs, planned)
        print(f"{name}: {results[name]['num_finished']}/{len(runs)} runs finished, {results[name]['num_kills']} kills",
              flush=True)
    base = results["torchrun"]["kill_to_next_step_s"]["p50"] if "torchrun" in results else None
    ratios = {n: r["kill_to_next_step_s"]["p50"] / base if base and r["kill_to_next_step_s"]["p50"] else None
              for n, r in results.items() if n != "torchrun"}
    checks = targets(results)
    print(report(results, ratios, checks))
    record = {
        "config": {
            "workload": workload(args),
            "ringtrain_scenarios": {n: scenario_overrides(n) for n in args.scenarios if n in RINGTRAIN_SCENARIOS},
            "ringtrain_runtime": runtime_overrides(Path("<tmp>/run")),
            "torchrun": {"argv": ["torchrun", *torchrun_cmd(Path("<workdir>"), args.rdzv)[3:]],
                         "env": RDZV[args.rdzv][1], "overrides": torchrun_overrides(args)},
            "kills_per_ringtrain_run": args.kills, "torchrun_runs": args.runs, "first_kill": args.first_kill,
            "kill_every": args.kill_every, "seed": args.seed, "timeout_s": args.timeout,
        },
        "results": results,
        "ratios_vs_torchrun_p50": ratios,
        "targets": checks,
    }
    run.write(record, device_type="cpu", out=args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
