"""Silent data corruption, against the scripted world of controller_fakes: probe rounds on the
cadence, a corrupting rank (or its node) evicted and training rolled back to the last clean scan,
durable checkpoints written after it deleted.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from ringtrain.actors.controller import Controller
from ringtrain.telemetry.rundir import RunDir

from tests.unit.controller_fakes import (
    Clock, Corruption, ElasticGroup, FakeElastic, RecordingPersister, elastic_job, elastic_run, incident_files, reform_call, whole,
)


def test_a_clean_run_scans_on_the_cadence_and_pins_each_clean_scan(tmp_path: Path) -> None:
    job = elastic_job(sdc_every_steps=3)
    summary, group, _ = elastic_run(tmp_path, job, keep=2)

    # The first step's round sets the golden values; the last step is always scanned.
    assert group.scanned == [1, 3, 6, 8] and group.pins == [1, 3, 6, 8]
    assert summary["sdc"] == {"scans": 4, "last_clean_scan": 8}
    assert summary["incidents"] == [] and summary["ledger"] == whole(8)


@pytest.mark.parametrize("spares, action, dp_after", [(1, "replace", 2), (0, "shrink", 1)])
def test_a_corrupting_rank_is_evicted_and_training_rolls_back_to_the_last_clean_scan(
    tmp_path: Path, spares: int, action: str, dp_after: int
) -> None:
    job = elastic_job(sdc_every_steps=3, mesh={"spares": spares})
    # Rank 2's device goes bad in step 4; workers keep 2 snapshots plus the pinned one, so
    # step 3's snapshot is still there when the scan after step 6 finds the damage.
    summary, group, fake = elastic_run(tmp_path, job, corrupt=Corruption(4, (2,)), keep=2, spares=spares)

    assert fake.named("capacity") == [{"lost": (2,), "reuse_slots": False}]  # its slot is not used again
    assert fake.named("reform") == [
        reform_call({2}, new_dp=dp_after, spares=spares, last_step=3, fired_through=6, quarantine=True)
    ]
    (incident,) = incident_files(tmp_path).values()
    assert (incident["kind"], incident["ranks"], incident["detected_at_step"], incident["action"]) == ("sdc", [2], 6, action)
    assert incident["lost_steps"] == 3 and incident["recover_s"] is not None
    sdc = incident["verdict"]["sdc"]
    assert (sdc["kind"], sdc["ranks"], sdc["probes"]) == ("outlier", [2], ["gemm"])
    assert incident["verdict"]["last_clean_scan"] == 3
    # Steps 4-6 trained on the bad device are redone from step 3's state.
    assert group.attempts == [1, 2, 3, 4, 5, 6, 4, 5, 6, 7, 8]
    assert (summary["status"], summary["final_step"], summary["dp"]) == ("finished", 8, dp_after)
    assert summary["ledger"] == whole(8)
    assert summary["sdc"]["last_clean_scan"] == 8 and not group.bad_ranks


def test_evicting_the_node_takes_every_rank_on_it(tmp_path: Path) -> None:
    job = elastic_job(sdc_every_steps=3, sdc_evict_node=True)
    summary, _, fake = elastic_run(tmp_path, job, corrupt=Corruption(4, (3,)))

    # Ranks 2 and 3 share replica 1's node: both go, and the node is cordoned before the
    # capacity to replace them is counted.
    assert [name for name, _ in fake.calls if name in ("cordon", "capacity", "reform")] == ["cordon", "capacity", "reform"]
    assert fake.named("cordon") == [{"ranks": (2, 3)}]
    assert fake.named("reform") == [reform_call({2, 3}, new_dp=1, spares=0, last_step=3, fired_through=6, quarantine=True)]
    (incident,) = summary["incidents"]
    assert (incident["kind"], incident["ranks"]) == ("sdc", [2, 3])
    assert summary["status"] == "finished"


def test_a_rank_bad_from_the_start_is_evicted_at_the_first_round(tmp_path: Path) -> None:
    job = elastic_job(sdc_every_steps=3, mesh={"spares": 1})
    summary, group, fake = elastic_run(tmp_path, job, corrupt=Corruption(0, (1,)), spares=1)

    # The first step's round finds it; the run starts over from the initial state.
    assert fake.named("reform") == [reform_call({1}, new_dp=2, spares=1, last_step=0, fired_through=1, quarantine=True)]
    assert summary["incidents"] == [{"id": 1, "kind": "sdc", "ranks": [1], "step": 1}]
    assert group.attempts == [1, *range(1, 9)] and summary["ledger"] == whole(8)


def test_a_scan_that_names_no_rank_rolls_back_in_place_to_the_last_clean_scan(tmp_path: Path) -> None:
    job = elastic_job(sdc_every_steps=3)
    # Every rank's digest changes alike, in one round only (a transient in what they share).
    summary, group, fake = elastic_run(tmp_path, job, corrupt=Corruption(6, (0, 1, 2, 3), once=True), keep=1)

    assert fake.named("reform") == []
    assert fake.named("rollback") == [{"last_step": 3, "rejoin": False, "fired_through": 6}]
    (incident,) = incident_files(tmp_path).values()
    assert (incident["kind"], incident["ranks"], incident["action"]) == ("sdc", [], "rollback")
    assert incident["verdict"]["sdc"]["kind"] == "shared"
    assert group.attempts == [1, 2, 3, 4, 5, 6, 4, 5, 6, 7, 8]
    assert (summary["status"], summary["dp"], summary["ledger"]) == ("finished", 2, whole(8))


def test_without_recovery_a_failed_scan_fails_the_run_naming_the_rank(tmp_path: Path) -> None:
    job = elastic_job(sdc_every_steps=3)
    clock = Clock()
    group = ElasticGroup(job, clock, corrupt=Corruption(4, (2,)))
    summary = Controller(job, group, RunDir(tmp_path), clock=clock).run()

    assert summary["status"] == "failed" and summary["final_step"] == 6
    assert "silent data corruption" in summary["error"] and "rank 2" in summary["error"]
    assert summary["incidents"] == [{"id": 1, "kind": "sdc", "ranks": [2], "step": 6}]


def test_scans_off_run_no_probe_round(tmp_path: Path) -> None:
    summary, group, _ = elastic_run(tmp_path, elastic_job(sdc_every_steps=0))
    assert group.scanned == [] and summary["sdc"] is None


def test_durable_checkpoints_written_after_the_last_clean_scan_are_deleted(tmp_path: Path) -> None:
    job = elastic_job(sdc_every_steps=3, mesh={"spares": 1})
    job = dataclasses.replace(job, checkpoint=dataclasses.replace(job.checkpoint, persist_every=2))
    clock = Clock()
    group = ElasticGroup(job, clock, corrupt=Corruption(4, (2,)))
    persister = RecordingPersister()
    summary = Controller(job, group, RunDir(tmp_path), persister=persister, elastic=FakeElastic(group, tmp_path, spares=1),
                         clock=clock).run()

    # Step 4's checkpoint held the corrupt state: gone. Step 6's round failed before it was
    # written. The redone steps 4, 6 and 8 were written afresh.
    assert summary["status"] == "finished" and persister.discarded == [3]
    assert persister.submitted == [2, 4, 6, 8]
