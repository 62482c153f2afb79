"""Non-finite losses, against the scripted world of controller_fakes: a NaN step rolls back and
skips or retries its batch (controllers.on_nan), a poisoned batch is not met again, abort fails the
run, and recoveries past controllers.max_recoveries fail it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.unit.controller_fakes import Fault, elastic_job, elastic_run, incident_files, whole


@pytest.mark.parametrize("on_nan", ["skip", "retry"])
def test_a_nan_rolls_back_then_skips_or_retries_the_batch(tmp_path: Path, on_nan: str) -> None:
    summary, group, fake = elastic_run(tmp_path, elastic_job(on_nan=on_nan), faults={3: [Fault("nan", 1)]})

    assert summary["status"] == "finished" and summary["final_step"] == 8
    assert fake.named("rollback") == [{"last_step": 2, "rejoin": False, "fired_through": 3}]
    (recovery,) = summary["recoveries"]
    assert (recovery["kind"], recovery["ranks"], recovery["action"], recovery["lost_steps"]) == ("nan", [1], "rollback", 0)
    assert group.attempts == [1, 2, 3, 3, 4, 5, 6, 7, 8]
    if on_nan == "skip":
        # Step 3's batch (cursor 2, samples 8-11) is dropped; steps 3-8 train cursors 3-8.
        assert len(fake.named("skip_batch")) == 1
        assert summary["ledger"] == whole(8, skipped=4)
        lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in lines] == [1, 2, 3, 4, 5, 6, 7, 8]  # the NaN step is not kept
    else:
        assert fake.named("skip_batch") == []
        assert summary["ledger"] == whole(8)


def test_a_skipped_poisoned_batch_is_not_met_again(tmp_path: Path) -> None:
    # Batch 4 (step 5's) gives NaN every time it is trained: skipping it is the way through.
    summary, _, fake = elastic_run(tmp_path, elastic_job(on_nan="skip"), poisoned=frozenset({4}))

    assert summary["status"] == "finished"
    assert len(summary["recoveries"]) == 1
    assert summary["ledger"] == whole(8, skipped=4)
    # Step 5 NaN'd, rolled back to step 4, then went on with batch 5.
    assert fake.group.attempts == [1, 2, 3, 4, 5, 5, 6, 7, 8]


def test_on_nan_abort_fails_the_run_without_a_rollback(tmp_path: Path) -> None:
    summary, _, fake = elastic_run(tmp_path, elastic_job(on_nan="abort"), faults={3: [Fault("nan", 0)]})

    assert (summary["status"], summary["final_step"]) == ("failed", 2)
    assert "controllers.on_nan=abort" in summary["error"]
    assert fake.named("rollback") == [] and fake.named("skip_batch") == []
    assert summary["recoveries"] == []
    ((name, incident),) = incident_files(tmp_path).items()
    assert name == "0001-nan.json" and (incident["action"], incident["ranks"]) == ("abort", [0])


@pytest.mark.parametrize("max_recoveries", [0, 1, 2])
def test_more_failures_than_max_recoveries_fail_the_run(tmp_path: Path, max_recoveries: int) -> None:
    # A poisoned batch retried comes back every time: recovery after recovery, until the cap.
    job = elastic_job(on_nan="retry", max_recoveries=max_recoveries)
    summary, group, fake = elastic_run(tmp_path, job, poisoned=frozenset({2}))

    assert summary["status"] == "failed"
    assert f"controllers.max_recoveries={max_recoveries}" in summary["error"]
    assert len(fake.named("rollback")) == len(summary["recoveries"]) == max_recoveries
    actions = [i["action"] for i in incident_files(tmp_path).values()]
    assert actions == ["rollback"] * max_recoveries + ["abort"]
    assert group.attempts == [1, 2] + [3] * (max_recoveries + 1)
    assert summary["ledger"] == whole(2)



def test_on_nan_skip_drops_the_poisoned_batch_even_when_the_restore_point_is_older(tmp_path: Path) -> None:
    # Snapshots every 3 steps; batch 4 (step 5's) is poisoned. The rollback after step 5 goes back
    # to step 3 (cursor 3); steps 4.. must then train batches 3, 5, 6, ... with 4 dropped.
    job = elastic_job(on_nan="skip", max_recoveries=3)
    summary, _, _ = elastic_run(tmp_path, job, poisoned=frozenset({4}), snapshot_every=3)

    assert summary["status"] == "finished"
    assert len(summary["recoveries"]) == 1
    assert summary["ledger"] == whole(8, skipped=4)
