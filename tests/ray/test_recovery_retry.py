"""A second failure inside a recovery, on a Ray cluster of several nodes on this machine.

Rank 1 crashes mid-step and a warm spare takes its seat; while that new world restores the
snapshot, rank 2 dies too (chaos ``crash_restoring``). The recovery is tried again from the same
restore point with the second warm spare in rank 2's seat (two spares: no worker starts cold
inside the test, which keeps it quick), and the run ends as the uninterrupted one.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.chaos_replay import keep

from .test_elastic import check_ledger, check_matches_reference, cluster, finish, incidents, start_job  # noqa: F401 (cluster: fixture)

import pytest

pytestmark = [pytest.mark.ray, pytest.mark.slow]

CRASH_STEP = 5


def test_a_worker_dying_while_the_recovery_restores_is_retried_and_training_matches_an_uninterrupted_run(
    cluster: Any, tmp_path: Path, reference: Path
) -> None:
    for _ in range(3):
        cluster.add_node(num_cpus=1)  # two replicas of 2 x 0.5 CPU, and the two spares
    run_dir = tmp_path / "run"
    faults = f"[{{kind: crash, rank: 1, step: {CRASH_STEP}}}, {{kind: crash_restoring, rank: 2, step: {CRASH_STEP}}}]"
    # min_dp=2: each lost seat is filled (by a spare), so the dp (and every loss) stays.
    job = start_job(cluster, run_dir, tmp_path, "mesh.spares=2", "mesh.min_dp=2", f"chaos.faults={faults}")
    out = finish(job)

    crash, during = incidents(run_dir)
    assert (crash["kind"], crash["action"], crash["ranks"], crash["detected_at_step"]) == ("crash", "replace", [1], CRASH_STEP), out
    assert (during["kind"], during["action"], during["ranks"]) == ("crash", "replace", [2]), out
    assert during["verdict"]["during_recovery"] == {"incident": 1, "phase": "restore", "restore_to": CRASH_STEP - 1}
    # No completed step lost by either, and both closed by the first step after the retry.
    assert crash["lost_steps"] == during["lost_steps"] == 0
    assert crash["recover_s"] is not None and during["recover_s"] is not None

    check_matches_reference(run_dir, reference)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["dp"] == 2
    assert [r["id"] for r in summary["recoveries"]] == [1, 2]
    check_ledger(summary)
    keep(run_dir, "death_inside_the_recovery")
