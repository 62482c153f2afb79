"""The Ray tier's chaos runs, kept as files and replayed on the simulated cluster.

A Ray-tier chaos test hands its finished run folder to ``keep``: with RINGTRAIN_KEEP_CHAOS_RUNS
set to a folder, the run's job, summary, incidents and metrics are copied there under the
scenario's name (``make chaos-records`` refreshes ``tests/chaos_records/`` so).
``tests/unit/test_chaos_replay.py`` replays each kept run with the Controller on
``actors.simulated`` (``replay``) and compares the ``decisions`` of both, and the recovery
``plans`` each carried out.

A replay takes its faults from the kept run: the job's chaos faults as they were configured
(``FAULTS_AS_STRUCK``, slow ranks, bit flips, deaths inside a recovery), and from the incidents,
the events the Ray test caused from outside (a worker killed, a node removed) at the step they
struck, a kill before the rank's newest snapshot left it as such (``_in_transit``). Capacity the test gave back to the cluster returns before the step the job grew at.
"""

from __future__ import annotations

import io
import json
import os
import shutil
from pathlib import Path
from typing import Any, Optional

from ringtrain import config
from ringtrain.actors.controller import Controller
from ringtrain.actors.simulated import Clock, Corruption, Fault, SimulatedGroup, SimulatedRecovery, Straggle
from ringtrain.telemetry.progress import Progress
from ringtrain.telemetry.rundir import RunDir

RECORDS = Path(__file__).resolve().parent / "chaos_records"
KEEP_VARIABLE = "RINGTRAIN_KEEP_CHAOS_RUNS"
KEPT_FILES = ("config.yaml", "summary.json", "metrics.jsonl")
# Chaos faults that strike a step, as the simulated cluster strikes it: every stall is a hang.
FAULTS_AS_STRUCK = {"crash": "crash", "nan": "nan", "hang": "hang", "skip_collective": "hang", "wrong_shape": "hang"}
# Incidents the test caused from outside the job (its chaos config names none of them).
OUTSIDE_KINDS = {"crash": "crash", "node_lost": "node_lost"}
INCIDENT_KEYS = ("kind", "ranks", "detected_at_step", "action", "dp_before", "dp_after", "lost_steps")


def keep(run_dir: Path, scenario: str) -> None:
    """Copy the run's files for ``scenario`` where RINGTRAIN_KEEP_CHAOS_RUNS says; else nothing."""
    into = os.environ.get(KEEP_VARIABLE)
    if not into:
        return
    kept = Path(into) / scenario
    shutil.rmtree(kept, ignore_errors=True)
    (kept / "incidents").mkdir(parents=True)
    for name in KEPT_FILES:
        shutil.copy(run_dir / name, kept / name)
    for path in sorted((run_dir / "incidents").glob("*.json")):
        shutil.copy(path, kept / "incidents" / path.name)


def decisions(run_dir: Path) -> dict[str, Any]:
    """What a run decided and kept, without the times: each incident's kind, ranks, step,
    action, dp before and after and lost steps (and the recovery a death inside one
    interrupted); the resizes; every kept step with the dp it ran at; how the run ended and
    its sample ledger."""
    summary = json.loads((run_dir / "summary.json").read_text())
    incidents = []
    for path in sorted((run_dir / "incidents").glob("*.json")):
        found = json.loads(path.read_text())
        entry = {key: found[key] for key in INCIDENT_KEYS}
        during = (found.get("verdict") or {}).get("during_recovery")
        if during:
            entry["during_recovery"] = {"incident": during["incident"], "restore_to": during["restore_to"]}
        incidents.append(entry)
    kept = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {
        "incidents": incidents,
        "resizes": [(r["step"], r["dp_before"], r["dp_after"]) for r in summary["resizes"]],
        "steps": [(r["step"], r["dp"]) for r in kept if "loss" in r],
        "status": summary["status"],
        "final_step": summary["final_step"],
        "dp": summary["dp"],
        "ledger": summary["ledger"],
    }


def plans(run_dir: Path) -> list[Optional[dict[str, Any]]]:
    """The recovery plan each incident of the run records (``policies.recovery``: the step
    restored and the kind of place each rank's shard came from, the seats, spares and new
    workers, a retry's reuse, the chaos faults the new world kept); None for an incident with no
    recovery of its own (a report, one a second failure interrupted)."""
    return [json.loads(p.read_text()).get("plan") for p in sorted((run_dir / "incidents").glob("*.json"))]


def replay(record: Path, scratch: Path, free_slots: int) -> Path:
    """Run the job of the kept run ``record`` on the simulated cluster, with its faults and room
    for ``free_slots`` workers beside the job's own and its warm spares; the simulated run's
    folder."""
    job = config.load_saved(record / "config.yaml")
    incidents = [json.loads(p.read_text()) for p in sorted((record / "incidents").glob("*.json"))]
    summary = json.loads((record / "summary.json").read_text())
    faults: dict[int, list[Fault]] = {}
    straggles, corruption = [], None
    for f in job.chaos.faults:
        if f.kind in FAULTS_AS_STRUCK:
            faults.setdefault(f.step, []).append(Fault(FAULTS_AS_STRUCK[f.kind], f.rank))
        elif f.kind == "slow":  # a straggler where controllers.on_straggler watches; else a slower run
            straggles.append(Straggle(f.rank, range(f.step, f.step + max(1, f.count))))
        elif f.kind == "bitflip":
            corruption = Corruption(step=f.step, ranks=(f.rank,))
    configured = {(f.kind, f.rank, f.step) for f in job.chaos.faults}
    ranks_per_node = job.mesh.cp
    for incident in incidents:
        kind, rank, step = incident["kind"], incident["ranks"][0], incident["detected_at_step"]
        if kind not in OUTSIDE_KINDS or (kind, rank, step) in configured or "during_recovery" in (incident.get("verdict") or {}):
            continue
        struck = OUTSIDE_KINDS[kind]
        if struck == "crash" and _in_transit(incident, job.checkpoint.snapshot_every):
            struck = "crash_in_transit"  # killed before its newest snapshot left it
        if struck == "node_lost":
            ranks_per_node = len(incident["ranks"])
        faults.setdefault(step, []).append(Fault(struck, rank))
    grows = [r["step"] for r in summary["resizes"]]
    clock = Clock()
    group = SimulatedGroup(
        job, clock, faults, snapshot_every=job.checkpoint.snapshot_every, corrupt=corruption, transit=True,
        keep=job.checkpoint.keep_in_memory,
        ranks_per_node=ranks_per_node, straggles=tuple(straggles),
    )  # fmt: skip
    recovery = SimulatedRecovery(
        group, spares=job.mesh.spares, free_slots=free_slots, replenish=False, job=job,
        # Ready at the step boundary the Ray run grew at: seen a step before, prepared, then taken.
        capacity_after_step=grows[0] - 1 if grows else None,
    )  # fmt: skip
    quiet = Progress(job.train.steps, enabled=False, out=io.StringIO())
    Controller(job, group, RunDir(scratch), progress=quiet, elastic=recovery, clock=clock).run()
    return scratch


def _in_transit(incident: dict[str, Any], snapshot_every: int) -> bool:
    """Whether the rank an incident names died before its newest snapshot reached a holder:
    the recovery went back past that snapshot (its plan's ``restore_step``), or redid the
    recorded step that took it (a record held for its snapshots is not counted as lost)."""
    newest = incident["detected_at_step"] - 1
    newest -= newest % snapshot_every
    restored = (incident.get("plan") or {}).get("restore_step")
    return incident["lost_steps"] == 1 or (restored is not None and restored < newest)


def scenarios() -> list[str]:
    return sorted(p.name for p in RECORDS.iterdir() if (p / "summary.json").exists()) if RECORDS.exists() else []

