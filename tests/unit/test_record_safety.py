"""A step's record is written once its snapshots are safe, against the scripted world of
controller_fakes with ``transit`` on (a step's snapshots reach the holders while the next step
runs): a kill before they land costs no recorded step, whatever the recovery restores.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.unit.controller_fakes import Corruption, Fault, elastic_job, elastic_run, incident_files, whole


def recorded_steps(run_dir: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_every_step_is_recorded_once_in_order_when_its_snapshots_land(tmp_path: Path) -> None:
    summary, group, _ = elastic_run(tmp_path, elastic_job(), transit=True)

    assert recorded_steps(tmp_path) == list(range(1, 9))
    # The last step's snapshots are waited for at the end, so its record is written too.
    assert (summary["status"], summary["final_step"], summary["ledger"]) == ("finished", 8, whole(8))


def test_a_kill_before_the_last_steps_snapshots_left_the_rank_costs_no_recorded_step(tmp_path: Path) -> None:
    # Rank 1 dies in step 5 before step 4's snapshot reached a holder: at ZeRO 1-3 its shard
    # of step 4 exists nowhere else, so the recovery restores step 3 and trains step 4 again.
    summary, group, fake = elastic_run(tmp_path, elastic_job(), faults={5: [Fault("crash_in_transit", 1)]}, transit=True)

    assert fake.named("reform")[0]["last_step"] == 4
    assert group.attempts == [1, 2, 3, 4, 5, 4, 5, 6, 7, 8]
    (recovery,) = summary["recoveries"]
    # Step 4's record was held until its snapshots landed, which they never did: it is written
    # once, after the step is trained again, and no recorded step was lost.
    assert recovery["lost_steps"] == 0
    assert recorded_steps(tmp_path) == list(range(1, 9))
    assert summary["ledger"] == whole(8)


def test_a_held_record_of_a_step_the_recovery_restores_is_written(tmp_path: Path) -> None:
    # As above, but the dead rank's shard of step 4 is written again from a replica (ZeRO-0):
    # step 4 is restored, so its held record is written and the step is not trained again.
    summary, group, _ = elastic_run(
        tmp_path, elastic_job(), faults={5: [Fault("crash_in_transit_rebuilt", 1)]}, transit=True
    )

    assert group.attempts == [1, 2, 3, 4, 5, 5, 6, 7, 8]
    assert summary["recoveries"][0]["lost_steps"] == 0
    assert recorded_steps(tmp_path) == list(range(1, 9))
    assert summary["ledger"] == whole(8)


@pytest.mark.parametrize("transit", [False, True])
def test_a_probed_step_is_recorded_before_its_verdict(tmp_path: Path, transit: bool) -> None:
    # The scan after step 6 rejects rank 2 and rolls back to step 3: steps 4-6 are redone,
    # step 6 included, whether or not its snapshots had landed when it was judged.
    job = elastic_job(sdc_every_steps=3, mesh={"spares": 1})
    summary, _, _ = elastic_run(tmp_path, job, corrupt=Corruption(4, (2,)), keep=2, spares=1, transit=transit)

    (incident,) = incident_files(tmp_path).values()
    assert (incident["kind"], incident["lost_steps"]) == ("sdc", 3)
    assert recorded_steps(tmp_path) == [1, 2, 3, 4, 5, 6, 4, 5, 6, 7, 8]
    assert summary["ledger"] == whole(8)
