"""Hang tracing end to end: each kind of stall is diagnosed from every rank's collective
records and stacks, the culprit named and evicted, and the job recovers and finishes.

One run of ``ringtrain run`` on an embedded cluster, three injected stalls (chaos faults) with
``controllers.hang_timeout_s=3``: a rank stuck in compute mid-step, a rank that leaves out the
step's closing loss all-reduce, a rank that enters it with another shape.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from .test_elastic import JOB, STEPS, check_ledger, incidents, job_file
from .test_run_e2e import processes_using, ray_tmp, run_cli  # noqa: F401  (fixture)

pytestmark = [pytest.mark.ray, pytest.mark.slow]

HANG_TIMEOUT_S = 3.0
# (kind, rank, step) -> the verdict expected: its kind and the op the culprit is named with.
STALLS = {
    ("hang", 1, 4): ("compute", "batch_isend_irecv"),  # its ring peer waits in the K/V exchange
    ("skip_collective", 2, 8): ("missing", "all_reduce"),
    ("wrong_shape", 3, 12): ("mismatch_shape", "all_reduce"),
}


def test_each_stall_is_diagnosed_naming_the_rank_and_op_and_the_job_recovers(tmp_path: Path, ray_tmp: Path) -> None:
    run_dir = tmp_path / "run"
    faults = ", ".join(f"{{kind: {kind}, rank: {rank}, step: {step}}}" for kind, rank, step in STALLS)
    result = run_cli(
        [
            str(job_file(tmp_path)),
            f"run_dir={run_dir}",
            *JOB,
            "cluster.num_cpus=2",
            "mesh.min_dp=2",  # each culprit is replaced by a new worker: the job stays at dp 2
            f"controllers.hang_timeout_s={HANG_TIMEOUT_S}",
            f"chaos.faults=[{faults}]",
        ],
        home=tmp_path,
        ray_tmp=ray_tmp,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert processes_using(ray_tmp) == []

    found = incidents(run_dir)
    assert len(found) == len(STALLS)
    for incident, ((_, rank, step), (kind, op)) in zip(found, STALLS.items()):
        verdict = incident["verdict"]["hang"]
        assert (incident["kind"], incident["ranks"], incident["detected_at_step"]) == ("hang", [rank], step)
        assert (verdict["kind"], verdict["ranks"]) == (kind, [rank]), verdict["explanation"]
        (culprit,) = verdict["culprits"]
        assert culprit["op"] == op and culprit["stack"], verdict["explanation"]
        # Reported within hang_timeout_s + 5 s of the stalled step's start, then recovered.
        assert HANG_TIMEOUT_S <= incident["detect_s"] <= HANG_TIMEOUT_S + 5
        assert (incident["action"], incident["dp_after"], incident["lost_steps"]) == ("replace", 2, 0)
        assert incident["recover_s"] is not None

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["final_step"] == STEPS
    check_ledger(summary)
