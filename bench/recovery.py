"""Benchmark: crash recovery of ringtrain against torchrun with per-step disk checkpoints.

Workload, the same on both sides: 4 gloo ranks on CPU (dp 2 x cp 2, zigzag ring attention,
ZeRO-2), a ~1.6M-parameter Llama (dim 128, 8 layers, 4 heads, 2 KV heads, byte vocabulary) on
the stdlib corpus, micro batch 1; seq_len 512 and global batch 2 give a ~0.3-0.4 s step on a
2-core machine (global batch 4, two micro batches per replica, took ~0.55 s). Everything
launched shares the repo's TORCH_EXTENSIONS_DIR (or $RINGTRAIN_BENCH_EXTENSIONS_DIR), so DeepSpeed
builds its CPU comm op once rather than in every new process (~25 s). Give the bench a folder of
its own on a machine where other processes build that op with other flags: ninja rebuilds it for
each change of command line, and a rebuild inside a run would be timed as recovery.

Method. After step ``--first-kill``'s record appears the bench sleeps a random 0.3-0.7 of the
median step time, so the kill lands mid-step, and SIGKILLs the process of one random rank
(seeded). Each later kill comes ``--kill-every`` steps after the last, and only once the first
step after the last kill is done and the run is back at full strength (workers.json: dp 2 and
the scenario's warm spares), so every kill of a scenario tests the same recovery path. Per kill:

- kill -> next step: the record of the first step done after the kill, minus the kill time (a
  ringtrain record is written once its snapshots are at the holders, as torchrun's progress line
  follows its checkpoint file; ``next_step_reported_s``: to when that step's reports were in);
- redone steps: last recorded step done before the kill - (that record's step - 1);
- ringtrain only: detection = incident ``detected_at`` - kill time, and the incident's
  ``lost_steps``; a kill owns the failure incidents detected in [its time, the next kill).

Baseline: torchrun (PyTorch elastic), ``--standalone --nnodes 1 --nproc-per-node 4
--max-restarts 3 --monitor-interval 0.1``, TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (see RDZV).
Each rank is this file run with ``--worker``: it builds ringtrain's Trainer, restores the newest
step whose 4 rank files all exist, and after every step writes ``trainer.snapshot(step).blob``
(tmp name + os.replace; the last 2 steps kept). A torchrun run stops at step first-kill +
kill-every (``train.stop_at_step``: the same schedule); a ringtrain run trains ``--steps``.

ringtrain: ``python -m ringtrain run <job.yaml> key=value ...`` on an embedded Ray cluster
(``cluster.num_cpus=4``, ``controllers.max_recoveries=100``) in these scenarios:

- ``shrink`` (no spare, min_dp 1), ``warm_spare`` (one warm spare actor), ``cold_replace`` (no
  spare, min_dp 2: a new actor must start): ``--kills`` kills in one run.
- ``double_failure`` (two warm spares): each kill is followed, once the first kill's incident
  file appears (the Controller saw it and is recovering), by a random 0..``--second-delay`` s
  wait and a SIGKILL of a surviving worker. Per pair: whether the second kill landed inside the
  first recovery (no step completed in between), its incident (``verdict.during_recovery``:
  the phase, warm, join or restore), and second kill -> next completed step.
- ``double_restore`` (two warm spares): the second death placed by chaos, ``crash_restoring``
  on another rank, which exits as it loads the snapshot in the first recovery. It fires once
  per run, so one run per kill; the process dies on its own, so the time is taken from its
  detection (the first kill's detect_s says how late detection is) to the next step.
- ``straggler`` (one warm spare, ``controllers.on_straggler=evict``, 10 logical CPUs: every
  eviction holds a slot back): ``--kills`` runs, each with one chaos ``slow`` fault (a random
  rank sleeps ``--slow-s`` before each of ``--slow-count`` consecutive steps) from step
  first-kill + 1, so every event meets a full world with its spare warm (in one run, an event
  soon after an eviction found the spare still starting, the job shrunk to dp 1 and the slow
  rank gone). Per event: the first slow step starts when the step before it is recorded; detection is the straggler incident's ``detected_at``; the eviction is done at
  the first step record after it; step time after the eviction (to the next event) against the
  steps before the event and against the ``clean`` run (same settings, no fault), which also
  counts false straggler reports.

Simulated: each ``warm_spare`` and ``cold_replace`` run is replayed on the simulated cluster
(``actors.simulated``) by the Controller itself, with the run's kills (step, rank), its mean step
time and its kills' mean detection and recovery; the goodput it predicts is held against the
run's own from its first step's start to its last step's end (no start-up, no stop), and its
lost steps against the redone steps measured, kill by kill.

The victim's pid comes from ``<run_dir>/workers.json``, read at every kill; step records from
``metrics.jsonl``, incidents from ``incidents/*.json``, the outcome from ``summary.json``. A run
has ``--steps`` as its schedule but is stopped by SIGTERM (``summary.json``: ``stopped``)
``--tail-steps`` steps after its last kill's recovery, or once a kill went
``--recovery-timeout`` s without a step: the steps after that measure nothing.

Ratios: each scenario's kill -> next step p50 over torchrun's, measured in the same run. The
machine may be shared: each kill records the 1-minute load average (ours included), the JSON
the load at the start and after each scenario.

    PYTHONPATH=platform python bench/recovery.py [--scenarios shrink,...,torchrun] [--kills 10]
        [--runs 10] [--seed 0]

Writes bench/results/recovery-cpu.json.
"""

from __future__ import annotations

import argparse
import io
import json
import math
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

from ringtrain_dev.launched import launch, log_tail, ours, read_jsonl, stop
from ringtrain_dev.record import RESULTS_DIR, Run, utc_now

ROOT = Path(__file__).resolve().parents[1]
WORLD = 4
# shrink: grows back 2 s after capacity returns (default 10 s), so kills can come every few steps.
RINGTRAIN_SCENARIOS: dict[str, dict[str, Any]] = {
    "shrink": {"mesh.spares": 0, "mesh.min_dp": 1, "controllers.grow_after_s": 2},
    "warm_spare": {"mesh.spares": 1},
    "cold_replace": {"mesh.spares": 0, "mesh.min_dp": 2},
    # A second worker killed while the recovery from the first is under way; both seats go to
    # warm spares, so the run is back at full strength (dp 2, 2 spares) before the next pair.
    "double_failure": {"mesh.spares": 2},
    # The same, the second death placed by chaos: crash_restoring makes a survivor exit as it
    # loads the snapshot in the first recovery. It fires once per run: one run per kill.
    "double_restore": {"mesh.spares": 2},
    # Chaos slow faults (one rank, count consecutive steps) evicted onto the warm spare. Each
    # eviction holds the straggler's slot back for good: 10 logical CPUs leave room for 10+.
    "straggler": {"mesh.spares": 1, "controllers.on_straggler": "evict", "cluster.num_cpus": 10},
    # The straggler scenario's settings without a fault: its step time, and false reports.
    "clean": {"mesh.spares": 1, "controllers.on_straggler": "evict", "cluster.num_cpus": 10},
}
KILL_SCENARIOS = ("shrink", "warm_spare", "cold_replace", "double_failure", "double_restore")
FAILURE_KINDS = ("crash", "node_lost", "hang", "error")
# Every kill is a recovery (a double failure two): more than controllers.max_recoveries' default.
MAX_RECOVERIES = 100
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
    p.add_argument("--scenarios", default="shrink,warm_spare,cold_replace,double_failure,double_restore,straggler,clean,torchrun")
    p.add_argument("--kills", type=int, default=10, help="kills per ringtrain run; runs of double_restore and straggler")
    p.add_argument("--runs", type=int, default=10, help="torchrun runs, one kill each")
    p.add_argument("--steps", type=int, default=400,
                   help="train.steps of a ringtrain run (its LR schedule everywhere); an upper bound: the bench "
                        "stops a run with SIGTERM --tail-steps steps after its last kill's recovery")
    p.add_argument("--tail-steps", type=int, default=3, help="steps trained after the last kill's recovery")
    p.add_argument("--second-delay", type=float, default=0.3,
                   help="double_failure: the second kill lands a random 0..this many seconds after the first "
                        "kill's incident appears")
    p.add_argument("--straggler-every", type=int, default=25, help="steps a straggler run trains from its event on")
    p.add_argument("--slow-s", type=float, default=1.0, help="seconds a straggler sleeps before each slow step")
    p.add_argument("--slow-count", type=int, default=8, help="consecutive slow steps of a straggler event")
    p.add_argument("--clean-steps", type=int, default=200, help="steps of the clean run")
    p.add_argument("--first-kill", type=int, default=10, help="the first kill lands in the step after this one")
    p.add_argument("--kill-every", type=int, default=8, help="steps between kills")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--global-batch", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rdzv", choices=sorted(RDZV), default="standalone", help="torchrun rendezvous")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds one run may take")
    p.add_argument("--recovery-timeout", type=float, default=120.0,
                   help="seconds a kill may go without a step after it before the run is stopped")
    p.add_argument("--startup-timeout", type=float, default=180.0, help="seconds for workers.json to appear")
    p.add_argument("--out", type=Path, default=RESULTS_DIR / "recovery-cpu.json")
    p.add_argument("--rescore", action="store_true",
                   help="recompute the summaries and targets of --out from its runs, measuring nothing")
    p.add_argument("--keep-failed", type=Path, metavar="DIR",
                   help="copy the run directory, output and Ray logs of every run that did not finish, or redid "
                        "a step, under DIR")
    p.add_argument("--worker", type=Path, help=argparse.SUPPRESS)  # a torchrun rank; the value is its workdir
    args = p.parse_args(argv)
    args.scenarios = [s for s in args.scenarios.split(",") if s]
    unknown = set(args.scenarios) - set(RINGTRAIN_SCENARIOS) - {"torchrun"}
    if unknown:
        p.error(f"unknown scenarios {sorted(unknown)}")
    if args.steps < args.first_kill + max((args.kills - 1) * args.kill_every, args.straggler_every) + 5:
        p.error("--steps leaves no room for the kills: raise it or lower --kills / --kill-every")
    return args


def workload(args: argparse.Namespace) -> list[str]:
    return [
        "model.vocab_size=256", "model.dim=128", "model.n_layers=8", "model.n_heads=4", "model.n_kv_heads=2",
        "data.path=stdlib", f"data.seq_len={args.seq_len}", "mesh.dp=2", "mesh.cp=2", "attention.impl=ring",
        "zero.stage=2", f"train.global_batch={args.global_batch}", "train.micro_batch=1",
        "train.warmup_steps=5", f"train.seed={args.seed}", "checkpoint.snapshot_every=1",
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
    second: Optional[Callable[[int], Optional[dict[str, Any]]]] = None,
) -> Records:
    """SIGKILL a random rank mid-step ``num_kills`` times: in the step after step ``--first-kill``,
    then ``--kill-every`` steps after the last kill, or later: only once ``ready()`` (the run is at
    full strength again) was seen before a step completed. ``second(pid)``, when given, kills
    another worker while the recovery from the kill of ``pid`` is under way and returns what it
    did (``kill["second"]``). Returns the kills made."""

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
        if second is not None:
            kills[-1]["second"] = second(pid)
        if wait_for(lambda: any(done_at(r) > t for r in steps()), proc, min(deadline, t + args.recovery_timeout)) is None:
            break  # never recovered (in time): the run is stopped
        planned = rec["step"] + args.kill_every
    return kills


def done_at(record: dict[str, Any]) -> float:
    """When a record's step was done: ringtrain's line is written once the step's snapshots are
    safe (``time``), possibly after a kill that came later; ``reported_at`` is when the step's
    reports were in. A torchrun progress line is written when the step is done."""
    return float(record.get("reported_at", record["time"]))


def next_done(records: Records, after: float) -> Optional[dict[str, Any]]:
    """The first step done after ``after``: a step done before it but recorded after (a
    recovery writes the held record of a step it restored) is not training resumed."""
    return min((r for r in records if done_at(r) > after), key=done_at, default=None)


def done_between(records: Records, start: float, end: float) -> bool:
    """Whether a step was done in (start, end]: a second failure with none is inside the
    first one's recovery."""
    return any(start < done_at(r) <= end for r in records)


def measure_kill(kill: dict[str, Any], records: Records) -> dict[str, Any]:
    last = max((r["step"] for r in records if done_at(r) <= kill["time"]), default=0)
    nxt = next_done(records, kill["time"])
    out = dict(kill, last_step_before=last, next_step=None, next_step_s=None, redone_steps=None)
    if nxt is not None:
        out.update(next_step=nxt["step"], next_step_s=nxt["time"] - kill["time"], redone_steps=last - (nxt["step"] - 1))
        if "reported_at" in nxt:  # ringtrain's: the step done, before its line waited for its snapshots
            out["next_step_reported_s"] = nxt["reported_at"] - kill["time"]
    return out


# --- torchrun -----------------------------------------------------------------------------------


def torchrun_overrides(args: argparse.Namespace) -> list[str]:
    """The workload, ended early (same schedule): one kill needs no more steps than this."""
    return [*workload(args), f"train.steps={args.steps}", f"train.stop_at_step={args.first_kill + args.kill_every}"]


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
    return [f"{key}={value}" for key, value in RINGTRAIN_SCENARIOS[scenario].items() if key != "cluster.num_cpus"]


def runtime_overrides(run_dir: Path, scenario: Optional[str] = None) -> list[str]:
    """ringtrain's own settings: where the run writes, no exporters, an embedded Ray cluster of 4
    logical CPUs (unless the scenario sets its own), a recovery budget for every kill."""
    cpus = RINGTRAIN_SCENARIOS.get(scenario or "", {}).get("cluster.num_cpus", 4)
    return [f"run_dir={run_dir}", "telemetry.metrics=false", "telemetry.tensorboard=false", f"cluster.num_cpus={cpus}",
            f"controllers.max_recoveries={MAX_RECOVERIES}"]


def straggler_fault(args: argparse.Namespace, rng: random.Random) -> Records:
    """A run's straggler event: a random rank sleeps ``--slow-s`` before each of ``--slow-count``
    consecutive steps, from step first-kill + 1."""
    return [{"kind": "slow", "rank": rng.randrange(WORLD), "step": args.first_kill + 1, "seconds": args.slow_s,
             "count": args.slow_count}]


def chaos_override(faults: Records) -> str:
    items = ", ".join("{" + ", ".join(f"{k}: {v}" for k, v in f.items()) + "}" for f in faults)
    return f"chaos.faults=[{items}]"


def incidents_of(run_dir: Path) -> Records:
    folder = run_dir / "incidents"
    records = []
    for f in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        try:
            records.append(json.loads(f.read_text()))
        except (json.JSONDecodeError, OSError):  # being rewritten
            continue
    return records


def incident_files(run_dir: Path) -> int:
    folder = run_dir / "incidents"
    return len(list(folder.glob("*.json"))) if folder.is_dir() else 0


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
        second = kill.get("second")
        if second and second.get("time"):
            # The second kill's incident: the one that says it failed a recovery, else the next one.
            later = [i for i in mine[1:] if i["detected_at"] >= second["time"]]
            own = next((i for i in later if (i.get("verdict") or {}).get("during_recovery")), later[0] if later else {})
            during = (own.get("verdict") or {}).get("during_recovery") or {}
            second.update(
                incident_id=own.get("id"), kind=own.get("kind"), action=own.get("action"),
                detect_s=own["detected_at"] - second["time"] if own else None, recover_s=own.get("recover_s"),
                lost_steps=own.get("lost_steps"), during_recovery_of=during.get("incident"), phase=during.get("phase"),
            )


def measure_second(kill: dict[str, Any], records: Records) -> None:
    """The second kill of a double failure: whether it landed inside the first one's recovery (no
    step completed between the two kills), and its kill -> next completed step."""
    second = kill.get("second")
    if not second or not second.get("time"):
        return
    t = second["time"]
    nxt = next_done(records, t)
    second.update(
        in_recovery=not done_between(records, kill["time"], t),
        after_first_s=t - kill["time"],
        next_step=nxt["step"] if nxt else None,
        next_step_s=nxt["time"] - t if nxt else None,
    )


def measure_restoring(kill: dict[str, Any], records: Records, incidents: Records, fault: dict[str, Any]) -> None:
    """The chaos second death of double_restore: its incident (the one that failed the first
    recovery) and the time from its detection to the next completed step. The process exits on
    its own, so its death is timed by its detection (the first kill's detect_s says how late)."""
    own = next((i for i in incidents if (i.get("verdict") or {}).get("during_recovery")
                and i["detected_at"] >= kill["time"]), None)
    second: dict[str, Any] = {"time": None, "rank": fault["rank"], "incident_id": None}
    if own is not None:
        nxt = next_done(records, own["detected_at"])
        during = own["verdict"]["during_recovery"]
        second.update(
            incident_id=own["id"], kind=own.get("kind"), action=own.get("action"), ranks=own.get("ranks"),
            named_correctly=own.get("ranks") == [fault["rank"]], during_recovery_of=during.get("incident"),
            phase=during.get("phase"), detected_after_first_kill_s=own["detected_at"] - kill["time"],
            in_recovery=not done_between(records, kill["time"], own["detected_at"]),
            detect_to_next_step_s=nxt["time"] - own["detected_at"] if nxt else None,
            lost_steps=own.get("lost_steps"), recover_s=own.get("recover_s"),
        )
    kill["second"] = second


def second_killer(run_dir: Path, workers: Path, tmp: Path, rng: random.Random,
                  max_delay_s: float) -> Callable[[int], Optional[dict[str, Any]]]:
    """For the double failure: once the first kill's incident file appears (the Controller saw it
    and starts its recovery), wait a random 0..max_delay_s and SIGKILL a surviving worker."""

    def kill_second(first_pid: int) -> Optional[dict[str, Any]]:
        before = incident_files(run_dir)
        survivors = [(w["rank"], w["pid"]) for w in json.loads(workers.read_text())["workers"] if w["pid"] != first_pid]
        deadline = time.time() + 30
        while incident_files(run_dir) <= before and time.time() < deadline:
            time.sleep(POLL_S / 5)
        seen = time.time()
        delay = rng.uniform(0.0, max_delay_s)
        time.sleep(delay)
        alive = ours(tmp)
        candidates = [(r, pid) for r, pid in survivors if pid in alive]
        if not candidates:
            return {"time": None, "error": "no survivor left to kill"}
        rank, pid = rng.choice(candidates)
        t = time.time()
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            return {"time": None, "error": f"rank {rank} (pid {pid}) already gone"}
        return {"time": t, "rank": rank, "pid": pid, "incident_seen": seen, "delay": delay,
                "loadavg_1m": os.getloadavg()[0]}

    return kill_second


def stop_after(proc: subprocess.Popen[bytes], steps: Callable[[], Records], step: int, deadline: float) -> None:
    """Once step ``step`` is recorded, SIGTERM ringtrain (as ``ray job stop`` does): it ends
    cleanly with summary.json ``stopped``. The schedule is done; further steps measure nothing."""
    if wait_for(lambda: any(r["step"] >= step for r in steps()), proc, deadline) and proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    wait_for(lambda: proc.poll() is not None, proc, deadline)


def step_gaps(records: Records, first: int, last: int) -> list[float]:
    """Seconds between consecutive step records, for the steps first..last that follow their
    predecessor directly (a recovery in between is not a step)."""
    by_step = {}
    for r in records:
        by_step[r["step"]] = r  # a redone step: its last record
    return [by_step[s]["time"] - by_step[s - 1]["time"] for s in range(first, last + 1)
            if s in by_step and s - 1 in by_step and by_step[s]["time"] > by_step[s - 1]["time"]]


def median_or_none(xs: list[float]) -> Optional[float]:
    return statistics.median(xs) if xs else None


def measure_stragglers(faults: Records, records: Records, incidents: Records, gap: int) -> Records:
    """Per straggler event: its first slow step starts when the step before it is done;
    detection is the straggler incident's ``detected_at``; eviction is done at the first step
    record after it (the spare in the seat). Step time before (the ``gap`` steps before the fault,
    less the first 3 after the previous event's eviction) and after the eviction (up to the next
    fault)."""
    out = []
    found = sorted((i for i in incidents if i.get("kind") == "straggler"), key=lambda i: i["detected_at"])
    times = {r["step"]: done_at(r) for r in records}
    for n, fault in enumerate(faults):
        start_step = fault["step"]
        started = times.get(start_step - 1)
        end_step = start_step + gap
        own = next((i for i in found if start_step <= i["detected_at_step"] < end_step), None)
        # The world the slow steps ran in: at dp 1 a rank >= 2 does not exist (the fault never
        # fires), and a resize in the streak starts the evidence again.
        dps = [(r["step"], r.get("dp"), r.get("generation")) for r in records
               if start_step - 1 <= r["step"] < start_step + fault["count"]]
        ev: dict[str, Any] = {"fault": fault, "first_slow_step_started": started, "incident_id": None,
                              "step_dp_generation": dps}
        if own is not None and started is not None:
            evicted = next_done(records, own["detected_at"])
            found_ = (own.get("verdict") or {}).get("straggler") or {}
            ev.update(
                incident_id=own["id"], action=own.get("action"), ranks=own.get("ranks"),
                named_correctly=own.get("ranks") == [fault["rank"]],
                detected_at_step=own["detected_at_step"], steps_to_detect=own["detected_at_step"] - start_step + 1,
                slowdown=found_.get("slowdown"), detect_s=own["detected_at"] - started,
                evicted_s=evicted["time"] - started if evicted else None,
                evicted_step=evicted["step"] if evicted else None, recover_s=own.get("recover_s"),
                lost_steps=own.get("lost_steps"),
            )
            after_from = (evicted["step"] + 1) if evicted else own["detected_at_step"] + 2
            ev["step_s_after"] = median_or_none(step_gaps(records, after_from, end_step - 1))
        ev["step_s_before"] = median_or_none(step_gaps(records, max(3, start_step - gap + 4), start_step - 1))
        if ev["step_s_before"] and ev.get("step_s_after"):
            ev["after_over_before"] = ev["step_s_after"] / ev["step_s_before"]
        out.append(ev)
    return out


def run_ended_well(status: Optional[str], returncode: Optional[int]) -> bool:
    """Trained to its end (exit 0), or stopped by the bench's SIGTERM (``ringtrain run`` exits 1
    then, with summary.json ``stopped``, as tests/ray/test_resume_e2e.py expects)."""
    return (status, returncode) in (("finished", 0), ("stopped", 1))


def watch_ringtrain(args: argparse.Namespace, scenario: str, proc: subprocess.Popen[bytes], tmp: Path,
                    rng: random.Random, faults: Records, victim: Optional[int] = None) -> dict[str, Any]:
    """Drive one run (``victim``: the only rank the kills pick) and measure it."""
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
        return [(w["rank"], w["pid"]) for w in json.loads(workers.read_text())["workers"]
                if w["pid"] in alive and (victim is None or w["rank"] == victim)]

    def ready() -> bool:
        """Back at full strength: every replica, and the warm spares the scenario keeps."""
        layout = json.loads(workers.read_text())
        return layout["dp"] >= 2 and len(layout.get("spares", [])) >= RINGTRAIN_SCENARIOS[scenario]["mesh.spares"]

    kills: Records = []
    if scenario in KILL_SCENARIOS:
        second = second_killer(run_dir, workers, tmp, rng, args.second_delay) if scenario == "double_failure" else None
        num_kills = 1 if scenario == "double_restore" else args.kills
        kills = drive_kills(proc, steps, victims, ready, num_kills, args, rng, deadline, second)
        after = [r["step"] for r in steps() if done_at(r) > kills[-1]["time"]] if kills else []
        if kills and not after:  # the last kill was never recovered from: nothing more to learn
            stop_after(proc, steps, 0, deadline)
        else:
            stop_after(proc, steps, max(after) + args.tail_steps if len(kills) == num_kills else args.steps, deadline)
    elif scenario == "straggler":
        stop_after(proc, steps, faults[-1]["step"] + args.straggler_every - 1, deadline)
    else:
        stop_after(proc, steps, args.clean_steps, deadline)
    records = steps()
    measured = [measure_kill(k, records) for k in kills]
    for k in measured:
        measure_second(k, records)
    incidents = incidents_of(run_dir)
    match_incidents(measured, incidents)
    if scenario == "double_restore":
        for k in measured:
            measure_restoring(k, records, incidents, faults[0])
    summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").exists() else {}
    status = summary.get("status")
    ledger = summary.get("ledger") or {}
    # A run the bench stopped because a kill was never recovered from did not finish.
    out = {"finished": run_ended_well(status, proc.poll()) and all(k["next_step_s"] is not None for k in measured),
           "status": status,
           "returncode": proc.poll(), "last_step": max((r["step"] for r in records), default=0),
           "step_s": median_step_s(records, 0.0), "kills": measured, "goodput": summary.get("goodput"),
           "ledger": ledger, "ledger_exact": ledger.get("duplicates") == 0 and ledger.get("missing") == 0,
           "num_recoveries": len(summary.get("recoveries", [])),
           "incident_kinds": [i.get("kind") for i in incidents]}
    if scenario == "straggler":
        out["events"] = measure_stragglers(faults, records, incidents, args.straggler_every)
        first = faults[0]["step"] if faults else args.first_kill
        out["clean_step_s"] = median_or_none(step_gaps(records, 4, first - 1))
    if scenario == "clean":
        out["clean_step_s"] = median_or_none(step_gaps(records, 4, out["last_step"]))
        out["false_straggler_reports"] = sum(i.get("kind") == "straggler" for i in incidents)
    simulated = simulated_run(args, scenario, {**out, "records": records, "num_records": len(records)}, summary)
    if simulated is not None:
        out["simulated"] = simulated
    return out


# --- the same run on the simulated cluster --------------------------------------------------------

# One failure at a time, at one data-parallel size: the simulated group's step takes the same time
# at any dp, so a shrink's slower steps at dp 1 are not predicted.
PREDICTED_SCENARIOS = ("warm_spare", "cold_replace")


def training_goodput(records: Records, train_time_s: float) -> Optional[float]:
    """Kept step time over the wall time from the first step's start to the last step's end: the
    run's goodput less its start-up and its stop, which a simulated run has not."""
    if not records:
        return None
    begin = done_at(records[0]) - records[0]["step_time_s"]
    return train_time_s / (max(done_at(r) for r in records) - begin)


def simulated_run(args: argparse.Namespace, scenario: str, out: dict[str, Any], summary: dict[str, Any]) -> Optional[dict[str, Any]]:
    """The run replayed on the simulated cluster (``actors.simulated``) by the Controller,
    unchanged: its kills at the steps and ranks they struck, its mean step time, and each kill's
    measured detection (from the failed step's start) and recovery (to the next step's start).
    Returns the goodput and lost steps it predicts beside the measured ones."""
    from ringtrain import config
    from ringtrain.actors.controller import Controller
    from ringtrain.actors.simulated import Clock, Durations, Fault, SimulatedGroup, SimulatedRecovery
    from ringtrain.telemetry.progress import Progress
    from ringtrain.telemetry.rundir import RunDir

    kills = out["kills"]
    if scenario not in PREDICTED_SCENARIOS or not out.get("finished") or not kills or "train_time_s" not in summary:
        return None
    if any(k.get("detect_s") is None or k.get("recover_s") is None for k in kills):
        return None
    kept = out["num_records"]
    step_s = summary["train_time_s"] / kept
    durations = Durations(
        step_s=step_s,
        detect_s=statistics.fmean(k["fraction"] * step_s + k["detect_s"] for k in kills),
        recover_s=statistics.fmean(max(0.0, k["recover_s"] - step_s) for k in kills),
    )
    job = config.load(None, [*workload(args), *scenario_overrides(scenario), f"train.steps={out['last_step']}",
                             f"controllers.max_recoveries={MAX_RECOVERIES}", "controllers.sdc_every_steps=0"])
    faults = {k["after_step"] + 1: [Fault("crash", k["rank"])] for k in kills}
    clock = Clock()
    group = SimulatedGroup(job, clock, faults, durations=durations)
    # The bench kills again only once the run is back at full strength, its spare warm again; a
    # cold replacement starts in the dead worker's own slot.
    recovery = SimulatedRecovery(group, spares=job.mesh.spares, free_slots=WORLD, replenish=True)
    with tempfile.TemporaryDirectory(prefix="rtb-sim-") as scratch:
        quiet = Progress(job.train.steps, enabled=False, out=io.StringIO())
        sim = Controller(job, group, RunDir(Path(scratch)), progress=quiet, elastic=recovery, clock=clock).run()
    measured = training_goodput(out["records"], summary["train_time_s"])
    return {
        "durations": {"step_s": durations.step_s, "detect_s": durations.detect_s, "recover_s": durations.recover_s},
        "goodput": sim["goodput"], "measured_goodput": measured,
        "goodput_ratio": sim["goodput"] / measured if measured else None,
        "lost_steps": [r["lost_steps"] for r in sim["recoveries"]],
        "measured_lost_steps": [k["redone_steps"] for k in kills],
        "actions": [r["action"] for r in sim["recoveries"]], "measured_actions": [k.get("action") for k in kills],
    }


def run_ringtrain(args: argparse.Namespace, scenario: str, rng: random.Random) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="rtb-", dir="/tmp"))  # short: Ray's socket paths live below it
    for sub in ("ray", "home"):
        (tmp / sub).mkdir()
    (tmp / "job.yaml").write_text(f"name: bench-recovery-{scenario}\n")
    env = {"HOME": str(tmp / "home"), "RAY_TMPDIR": str(tmp / "ray"), "RAY_AUTH_MODE": "disabled"}
    faults = straggler_fault(args, rng) if scenario == "straggler" else []
    victim = None
    if scenario == "double_restore":  # the bench kills one rank, chaos another as it restores
        victim, other = rng.sample(range(WORLD), 2)
        faults = [{"kind": "crash_restoring", "rank": other, "step": args.first_kill + 1}]
    steps = args.clean_steps if scenario == "clean" else args.steps
    cmd = [sys.executable, "-m", "ringtrain", "run", str(tmp / "job.yaml"), *workload(args), f"train.steps={steps}",
           *runtime_overrides(tmp / "run", scenario), *scenario_overrides(scenario),
           *([chaos_override(faults)] if faults else [])]
    proc = launch(cmd, tmp, env, tmp)
    try:
        result = watch_ringtrain(args, scenario, proc, tmp, rng, faults, victim)
    except RunFailed as exc:
        result = {"finished": False, "returncode": proc.poll(), "kills": [], "error": str(exc)}
    finally:
        stop(proc, tmp)
        tail = log_tail(tmp)
        if args.keep_failed and (not result["finished"] or any(k.get("redone_steps") for k in result["kills"])):
            keep(tmp, args.keep_failed / tmp.name)
        shutil.rmtree(tmp, ignore_errors=True)
    return dict(result, log_tail=None if result["finished"] else tail)


def keep(tmp: Path, dest: Path) -> None:
    """Copy what explains a failed run: its run directory, its output and its Ray logs."""
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copytree(tmp / "run", dest / "run", dirs_exist_ok=True)
    shutil.copy2(tmp / "out.log", dest / "out.log")
    for logs in (tmp / "ray").glob("**/session_latest/logs"):
        shutil.copytree(logs, dest / "ray-logs", dirs_exist_ok=True, ignore=shutil.ignore_patterns("*.sock", "*socket*"))
    print(f"kept the failed run in {dest}", file=sys.stderr)


# --- results ------------------------------------------------------------------------------------


def dist_stats(values: list[Any]) -> dict[str, Any]:
    """n, p50, p99 (numpy's linear interpolation between ranks) and max of the values given."""
    import numpy as np

    xs = [float(v) for v in values if v is not None]
    p50, p99 = (float(np.percentile(xs, q)) for q in (50, 99)) if xs else (None, None)
    return {"n": len(xs), "p50": p50, "p99": p99, "max": max(xs, default=None)}


def summarize(name: str, runs: list[dict[str, Any]], num_planned: int) -> dict[str, Any]:
    head = {"num_runs": len(runs), "num_finished": sum(r["finished"] for r in runs),
            "all_finished": bool(runs) and all(r["finished"] for r in runs),
            "all_ledgers_exact": all(r.get("ledger_exact", True) for r in runs)}
    if name == "straggler":
        events = [e for r in runs for e in r.get("events", [])]
        return {
            **head, "num_events": len(events), "num_events_planned": num_planned,
            "num_detected": sum(e["incident_id"] is not None for e in events),
            "num_named_correctly": sum(bool(e.get("named_correctly")) for e in events),
            "num_replaced": sum(e.get("action") == "replace" for e in events),
            "steps_to_detect": dist_stats([e.get("steps_to_detect") for e in events]),
            "first_slow_step_to_detection_s": dist_stats([e.get("detect_s") for e in events]),
            "first_slow_step_to_eviction_s": dist_stats([e.get("evicted_s") for e in events]),
            "lost_steps": dist_stats([e.get("lost_steps") for e in events]),
            "step_s_before": dist_stats([e.get("step_s_before") for e in events]),
            # The spare took the seat: the same dp 2 as the clean run. A shrink (no spare ready yet)
            # trains at dp 1, slower by design: kept apart.
            "step_s_after_eviction": dist_stats([e.get("step_s_after") for e in events if e.get("action") == "replace"]),
            "after_over_before": dist_stats([e.get("after_over_before") for e in events if e.get("action") == "replace"]),
            "step_s_after_shrink": dist_stats([e.get("step_s_after") for e in events if e.get("action") == "shrink"]),
            "clean_step_s": median_or_none([r["clean_step_s"] for r in runs if r.get("clean_step_s")]),
            "runs": runs,
        }
    if name == "clean":
        return {**head, "clean_step_s": median_or_none([r["clean_step_s"] for r in runs if r.get("clean_step_s")]),
                "false_straggler_reports": sum(r.get("false_straggler_reports", 0) for r in runs),
                "steps": sum(r.get("last_step", 0) for r in runs), "runs": runs}
    kills = [k for r in runs for k in r["kills"]]
    extra = (
        ["created_s", "imported_s", "restored_s"]
        if name == "torchrun"
        else ["detect_s", "recover_s", "lost_steps", "next_step_reported_s"]
    )
    out = {
        **head,
        "num_kills": len(kills), "num_kills_planned": num_planned,
        "num_unrecovered": sum(k["next_step_s"] is None for k in kills),  # no step completed after the kill
        **({} if name == "torchrun" else {"num_undetected": sum(k["detect_s"] is None for k in kills)}),
        "kill_to_next_step_s": dist_stats([k["next_step_s"] for k in kills]),
        "redone_steps": dist_stats([k["redone_steps"] for k in kills]),
        **{key: dist_stats([k.get(key) for k in kills]) for key in extra},
        **({"restarts": sum(r["restarts"] for r in runs)} if name == "torchrun" else {}),
    }
    if name == "double_failure":
        seconds = [k["second"] for k in kills if k.get("second") and k["second"].get("time")]
        inside = [s for s in seconds if s.get("in_recovery")]
        out["second"] = {
            "num_kills": len(seconds), "num_in_recovery": len(inside),
            "num_seen_as_during_recovery": sum(s.get("during_recovery_of") is not None for s in seconds),
            "phases": {p: sum(s.get("phase") == p for s in seconds) for p in sorted({str(s.get("phase")) for s in seconds})},
            "after_first_s": dist_stats([s.get("after_first_s") for s in seconds]),
            # Both of these over the second kills that landed inside the first one's recovery.
            "kill_to_next_step_s": dist_stats([s.get("next_step_s") for s in inside]),
            "detect_s": dist_stats([s.get("detect_s") for s in inside]),
            "lost_steps": dist_stats([s.get("lost_steps") for s in inside]),
        }
    if name == "double_restore":
        seconds = [k["second"] for k in kills if k.get("second")]
        out["second"] = {
            "num_deaths": len(seconds), "num_seen": sum(s.get("incident_id") is not None for s in seconds),
            "num_named_correctly": sum(bool(s.get("named_correctly")) for s in seconds),
            "num_in_recovery": sum(bool(s.get("in_recovery")) for s in seconds),
            "phases": {p: sum(s.get("phase") == p for s in seconds) for p in sorted({str(s.get("phase")) for s in seconds})},
            "detected_after_first_kill_s": dist_stats([s.get("detected_after_first_kill_s") for s in seconds]),
            "detect_to_next_step_s": dist_stats([s.get("detect_to_next_step_s") for s in seconds]),
            "lost_steps": dist_stats([s.get("lost_steps") for s in seconds]),
        }
    return {**out, "runs": runs}


def targets(results: dict[str, dict[str, Any]]) -> Records:
    def p50(name: str) -> Optional[float]:
        return results[name]["kill_to_next_step_s"]["p50"] if name in results else None

    detect_s = [k["detect_s"] for n, r in results.items() if n in KILL_SCENARIOS for run in r["runs"]
                for k in run["kills"]]
    detect = dist_stats(detect_s)
    undetected = None in detect_s  # a kill that no incident owns was never detected: fails detection
    rows: list[tuple[str, Optional[float], str, Optional[float], bool]] = [
        ("detection p50, all ringtrain kills", detect["p50"], "<=", 0.2, undetected),
        ("detection p99, all ringtrain kills", detect["p99"], "<=", 1.0, undetected),
        ("shrink kill->next step p50", p50("shrink"), "<=", 1.0, False),
        ("warm_spare kill->next step p50", p50("warm_spare"), "<=", 1.0, False),
        ("cold_replace kill->next step p50, vs torchrun p50", p50("cold_replace"), "<", p50("torchrun"), False),
    ]
    if "straggler" in results:
        st = results["straggler"]
        clean = results.get("clean", {}).get("clean_step_s") or st.get("clean_step_s")
        after = st["step_s_after_eviction"]["p50"]
        rows += [
            ("straggler events named correctly (of planned)", st["num_named_correctly"], ">=",
             st["num_events_planned"], False),
            ("straggler steps to detection max, vs straggler_steps + 1", st["steps_to_detect"]["max"], "<=", 4, False),
            ("straggler step time after eviction onto the spare p50 / clean run's", after / clean if after and clean else None,
             "<=", 1.1, False),
        ]
    if "clean" in results:
        rows.append(("false straggler reports, clean run", results["clean"]["false_straggler_reports"], "<=", 0, False))
    if "double_failure" in results:
        sec = results["double_failure"]["second"]
        rows += [
            ("double failure: second kills inside the first recovery (of kills)", sec["num_in_recovery"], ">=",
             results["double_failure"]["num_kills_planned"], False),
            ("double failure: lost steps max", results["double_failure"]["redone_steps"]["max"], "<=", 0, False),
        ]
    if "double_restore" in results:
        dr = results["double_restore"]
        rows += [
            ("double_restore: chaos deaths seen inside the first recovery (of runs)", dr["second"]["num_in_recovery"],
             ">=", dr["num_kills_planned"], False),
            ("double_restore: redone steps max", dr["redone_steps"]["max"], "<=", 0, False),
        ]
    for name in PREDICTED_SCENARIOS:
        sims = [run.get("simulated") for run in results.get(name, {}).get("runs", [])]
        if name not in results:
            continue
        if not all(sims):  # a run the simulation could not replay (unfinished, a kill unmatched) fails both
            rows += [(f"{name}: simulated goodput / measured, off by", None, "<=", 0.1, True),
                     (f"{name}: kills whose simulated lost steps differ from the measured", None, "<=", 0, True)]
            continue
        off = max(abs(sim["goodput_ratio"] - 1) if sim["goodput_ratio"] else math.inf for sim in sims)
        differ = sum(a != b for sim in sims for a, b in zip(sim["lost_steps"], sim["measured_lost_steps"]))
        differ += sum(len(sim["lost_steps"]) != len(sim["measured_lost_steps"]) for sim in sims)
        rows += [(f"{name}: simulated goodput / measured, off by", off, "<=", 0.1, False),
                 (f"{name}: kills whose simulated lost steps differ from the measured", differ, "<=", 0, False)]
    out = []
    for name, value, op, bound, missed in rows:
        ok = None if value is None or bound is None else {"<=": value <= bound, "<": value < bound, ">=": value >= bound}[op]
        out.append({"target": name, "value": value, "op": op, "bound": bound, "pass": False if missed else ok})
    return out


def fmt(*xs: Optional[float], spec: str = ".2f") -> str:
    return " / ".join("-" if x is None else format(x, spec) for x in xs)


def report(results: dict[str, dict[str, Any]], ratios: dict[str, Optional[float]], checks: Records) -> str:
    lines = [f"{'scenario':<15}{'kills':>6}{'finished':>10}{'detect p50/p99 s':>18}"
             f"{'kill->next step p50/p99/max s':>32}{'redone p50/max':>16}{'lost p50/max':>14}"]
    for name, r in results.items():
        if "kill_to_next_step_s" not in r:
            continue
        d, n, redone, lost = r.get("detect_s"), r["kill_to_next_step_s"], r["redone_steps"], r.get("lost_steps")
        lines.append(f"{name:<15}{r['num_kills']:>6}{str(r['num_finished']) + '/' + str(r['num_runs']):>10}"
                     f"{fmt(d['p50'], d['p99']) if d else '-':>18}{fmt(n['p50'], n['p99'], n['max']):>32}"
                     f"{fmt(redone['p50'], redone['max'], spec='.0f'):>16}"
                     f"{fmt(lost['p50'], lost['max'], spec='.0f') if lost else '-':>14}")
    if "double_failure" in results:
        sec = results["double_failure"]["second"]
        lines.append(f"double_failure second kills: {sec['num_kills']}, {sec['num_in_recovery']} inside the first "
                     f"recovery ({sec['num_seen_as_during_recovery']} seen as such; phases {sec['phases']}), "
                     f"{fmt(sec['after_first_s']['p50'])} s after the first (p50); second kill -> next step p50/p99/max "
                     f"{fmt(sec['kill_to_next_step_s']['p50'], sec['kill_to_next_step_s']['p99'], sec['kill_to_next_step_s']['max'])} s, "
                     f"lost steps max {fmt(sec['lost_steps']['max'], spec='.0f')}")
    if "double_restore" in results:
        sec = results["double_restore"]["second"]
        d2n = sec["detect_to_next_step_s"]
        lines.append(f"double_restore chaos deaths: {sec['num_deaths']}, {sec['num_seen']} seen, {sec['num_in_recovery']} "
                     f"inside the first recovery (phases {sec['phases']}), detected "
                     f"{fmt(sec['detected_after_first_kill_s']['p50'])} s after the first kill (p50); detection -> next "
                     f"step p50/p99/max {fmt(d2n['p50'], d2n['p99'], d2n['max'])} s, lost steps max "
                     f"{fmt(sec['lost_steps']['max'], spec='.0f')}")
    if "straggler" in results:
        st = results["straggler"]
        ev, det = st["first_slow_step_to_eviction_s"], st["first_slow_step_to_detection_s"]
        lines.append(f"straggler: {st['num_events']} events, {st['num_detected']} detected, {st['num_named_correctly']} "
                     f"named correctly, {st['num_replaced']} replaced by the spare (else shrunk); steps to detection p50/max "
                     f"{fmt(st['steps_to_detect']['p50'], st['steps_to_detect']['max'], spec='.0f')}; first slow step -> "
                     f"detection p50 {fmt(det['p50'])} s, -> eviction (next step) p50/max {fmt(ev['p50'], ev['max'])} s; "
                     f"step time before / after the spare took the seat / after a shrink p50 "
                     f"{fmt(st['step_s_before']['p50'], st['step_s_after_eviction']['p50'], st['step_s_after_shrink']['p50'], spec='.3f')} s "
                     f"(after/before p50 {fmt(st['after_over_before']['p50'], spec='.3f')})")
    if "clean" in results:
        c = results["clean"]
        lines.append(f"clean: {c['steps']} steps, step time p50 {fmt(c['clean_step_s'], spec='.3f')} s, "
                     f"{c['false_straggler_reports']} straggler reports")
    for name in PREDICTED_SCENARIOS:
        for i, run in enumerate(results.get(name, {}).get("runs", [])):
            sim = run.get("simulated")
            if sim:
                lines.append(f"{name} run {i} simulated: goodput {fmt(sim['goodput'], spec='.3f')} against "
                             f"{fmt(sim['measured_goodput'], spec='.3f')} measured (x{fmt(sim['goodput_ratio'], spec='.3f')}); "
                             f"lost steps {sim['lost_steps']} against {sim['measured_lost_steps']}; "
                             f"actions {sim['actions']}")
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
              if "num_kills" in r and r["num_kills"] < r["num_kills_planned"]]
    lines += [f"{name}: {r[key]} kill(s) {what}" for name, r in results.items()
              for key, what in (("num_unrecovered", "never followed by a step"), ("num_undetected", "with no incident"))
              if r.get(key)]
    lines += [f"{name}: a ledger with duplicates or missing samples" for name, r in results.items()
              if not r["all_ledgers_exact"]]
    return "\n".join(lines)


def loadavg() -> dict[str, float]:
    one, five, fifteen = os.getloadavg()
    return {"1m": one, "5m": five, "15m": fifteen}


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.worker is not None:
        return worker_main(args.worker)
    if args.rescore:
        return rescore(args.out)
    run = Run("recovery")
    rng = random.Random(args.seed)
    results: dict[str, dict[str, Any]] = {}
    load = {"start": loadavg()}
    for name in args.scenarios:
        if name == "torchrun":
            runs, planned = [run_torchrun(args, rng) for _ in range(args.runs)], args.runs
        elif name in ("double_restore", "straggler"):  # one event per run
            runs, planned = [run_ringtrain(args, name, rng) for _ in range(args.kills)], args.kills
        else:
            runs, planned = [run_ringtrain(args, name, rng)], (0 if name == "clean" else args.kills)
        results[name] = summarize(name, runs, planned)
        load[name] = loadavg()  # at the scenario's end
        done = results[name].get("num_kills", results[name].get("num_events", 0))
        print(f"{name}: {results[name]['num_finished']}/{len(runs)} runs finished, {done} kills/events, "
              f"load {load[name]['1m']:.1f}", flush=True)
        write(run, args, argv, results, load, final=False)  # what is done so far survives a stopped bench
    write(run, args, argv, results, load, final=True)
    return 0


def rescore(path: Path) -> int:
    """Summaries and targets again from the runs a JSON holds (after a fix to how they are scored);
    the provenance and the runs stay as measured."""
    record = json.loads(path.read_text())
    results = {}
    for name, old in record["results"].items():
        for r in old["runs"]:
            if name != "torchrun" and "status" in r:
                r["finished"] = run_ended_well(r["status"], r["returncode"]) and all(
                    k["next_step_s"] is not None for k in r["kills"])
        planned = old.get("num_kills_planned", old.get("num_events_planned", 0))
        results[name] = summarize(name, old["runs"], planned)
    base = results["torchrun"]["kill_to_next_step_s"]["p50"] if "torchrun" in results else None
    record.update(results=results, targets=targets(results), rescored_utc=utc_now(),
                  ratios_vs_torchrun_p50={n: r["kill_to_next_step_s"]["p50"] / base if base and r["kill_to_next_step_s"]["p50"]
                                          else None for n, r in results.items() if n in KILL_SCENARIOS})
    path.write_text(json.dumps(record, indent=2) + "\n")
    print(report(results, record["ratios_vs_torchrun_p50"], record["targets"]))
    return 0


def write(run: Run, args: argparse.Namespace, argv: list[str], results: dict[str, dict[str, Any]],
          load: dict[str, Any], *, final: bool) -> None:
    base = results["torchrun"]["kill_to_next_step_s"]["p50"] if "torchrun" in results else None
    ratios = {n: r["kill_to_next_step_s"]["p50"] / base if base and r["kill_to_next_step_s"]["p50"] else None
              for n, r in results.items() if n in KILL_SCENARIOS}
    checks = targets(results)
    if final:
        print(report(results, ratios, checks))
    record = {
        "complete": final and list(results) == args.scenarios,
        "command": "PYTHONPATH=platform .venv/bin/python bench/recovery.py " + " ".join(argv),
        "loadavg": load,
        "config": {
            "workload": workload(args),
            "ringtrain_scenarios": {n: scenario_overrides(n) for n in args.scenarios if n in RINGTRAIN_SCENARIOS},
            "ringtrain_runtime": {n: runtime_overrides(Path("<tmp>/run"), n) for n in args.scenarios
                                  if n in RINGTRAIN_SCENARIOS},
            "torchrun": {"argv": ["torchrun", *torchrun_cmd(Path("<workdir>"), args.rdzv)[3:]],
                         "env": RDZV[args.rdzv][1], "overrides": torchrun_overrides(args)},
            **{k: v for k, v in vars(args).items() if k not in ("scenarios", "out", "worker", "rdzv", "keep_failed")},
            "scenarios": args.scenarios, "rdzv": args.rdzv,
        },
        "results": results,
        "ratios_vs_torchrun_p50": ratios,
        "targets": checks,
    }
    run.write(record, device_type="cpu", out=args.out)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
