"""A run directory written by hand, for the tests of what reads one (the HTML report, its
browser rendering, the TensorBoard sink): metrics.jsonl records, incidents/, summary.json and
config.yaml, laid out as a real run leaves them.

The files go through ``telemetry.rundir.RunDir``, the run's own writer, so their names and
encoding are the real ones; the records and incidents carry the keys the Controller writes
(``actors.records.step_record`` and the runbook's additions, ``dataclasses.asdict(Incident)``).
The job is dp 2 x cp 2 (four ranks) and rank 1 is its straggler. Values change from step to
step where they can, so a reader that shows one step's value at another is caught.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Sequence

from ringtrain.telemetry.rundir import RunDir

NUM_RANKS = 4
# A stand-in for the resolved config: the report shows it as text, and finds the job's name.
CONFIG_YAML = "name: quickstart\ntrain:\n  steps: 6\nmesh:\n  dp: 2\n  cp: 2\n"


def step_record(step: int, **changes: Any) -> dict[str, Any]:
    """One metrics.jsonl line of ``step``; ``changes`` replace or add keys."""
    base: dict[str, Any] = {
        "step": step,
        "loss": 5.0 - 0.5 * step,
        "lr": 1e-3 * step,
        "grad_norm": 2.0 / step,
        "tokens": 256,
        "step_time_s": 0.25,
        "rank_step_time_s": [0.2, 0.21 + 0.1 * step, 0.2, 0.19],  # rank 1 is the straggler
        # All zero, as ranks that do not measure their compute time report it: the report then
        # leaves out its compute-time chart, which the tests' lists of charts do not name.
        "rank_compute_s": [0.0] * NUM_RANKS,
        "tokens_per_s": 1024.0 + step,
        "dp": 2,
        "cp": 2,
        "snapshot_step": step,
        "snapshot_s": 0.01 * step,
        "snapshot_bytes": 393043,
        "rank_memory_bytes": [1000, 2000, 3000, 4000],
        "data_wait_s": 0.0,
        "time": 1_700_000_000.0 + step,
        "generation": 1,
        "persist_s": 0.5,
        "last_durable_step": step - 1,
        "goodput": 0.9,
        "mfu": 0.02,
    }
    return {**base, **changes}


def step_records(steps: int) -> list[dict[str, Any]]:
    """Steps 1 to ``steps``, one record each."""
    return [step_record(step) for step in range(1, steps + 1)]


# What the nan fault leaves: rank 1's loss went non-finite while step 3 ran, and the job aborted.
NAN_INCIDENT: dict[str, Any] = {
    "id": 1,
    "kind": "nan",
    "ranks": [1],
    "detected_at_step": 3,
    "detected_at": 1_700_000_000.0,
    "detect_s": 0.02,
    "action": "abort",
    "recover_s": None,
    "lost_steps": 0,
    "dp_before": 2,
    "dp_after": None,
    "reason": "non-finite loss nan at step 3, first on ranks [1]",
    # The stack's innermost frame is last, as in a real verdict.
    "verdict": {"culprit_rank": 1, "op": "all_reduce", "seq": 12, "stack": "File 'x.py'\n  loss.backward()\nin all_reduce"},
    "phases": None,
}

# The summary the nan fault's run ends with: only the keys the readers' tests look at.
FAILED_SUMMARY: dict[str, Any] = {
    "status": "failed",
    "final_step": 2,
    "steps": 6,
    "error": "non-finite loss nan at step 3",
    "wall_time_s": 4.0,
}


def write_run_dir(
    folder: Path,
    *,
    steps: int = 2,
    records: Optional[Sequence[dict[str, Any]]] = None,
    incidents: Sequence[dict[str, Any]] = (NAN_INCIDENT,),
    summary: Optional[dict[str, Any]] = None,
    config_yaml: str = CONFIG_YAML,
) -> Path:
    """``folder`` as a run leaves it, by default the nan fault's run while it is still being
    written: steps 1-2 recorded, incident 1 at step 3, no summary.json yet.

    ``records`` (when given) replace the ``steps`` default records; ``summary`` None leaves
    summary.json out, as a run that is still going or ended abruptly does. An empty
    ``incidents`` leaves no incidents/ folder, as the writer does."""
    run_dir = RunDir(folder)
    try:
        (folder / "config.yaml").write_text(config_yaml, encoding="utf-8")
        for record in step_records(steps) if records is None else records:
            run_dir.append_metrics(record)
        for incident in incidents:
            run_dir.write_incident(incident)
        if summary is not None:
            run_dir.write_summary(summary)
    finally:
        run_dir.close()
    return folder
