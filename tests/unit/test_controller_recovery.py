"""Recovery from a lost rank or an exception in a rank's own code, against the scripted world of
controller_fakes: a warm spare or a new worker takes the seat, the job shrinks, or it rolls back
in place; each incident is written when seen and again when training is back.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.unit.controller_fakes import (
    DETECT_S, ERROR_FRAME, RECOVER_S, STEP_S, UNIX0, Fault, elastic_job, elastic_run, incident_files, reform_call, whole,
)


@pytest.mark.parametrize(
    "snapshot_every, resumed",
    # The crash is in step 6, so the last completed step is 5; its newest snapshot is step 5
    # (every step) or step 3 (every third), which loses steps 4 and 5. Every seventh step: no
    # snapshot yet, so the new world starts from the initial state and redoes steps 1-5.
    [(1, 5), (3, 3), (7, 0)],
    ids=["restore-last-step", "restore-older-step", "restore-initial-state"],
)
def test_a_crash_with_a_warm_spare_replaces_the_rank_and_the_run_finishes(
    tmp_path: Path, snapshot_every: int, resumed: int
) -> None:
    job = elastic_job(mesh={"spares": 1})
    summary, group, fake = elastic_run(
        tmp_path, job, faults={6: [Fault("crash", 3)]}, snapshot_every=snapshot_every, spares=1
    )

    assert (summary["status"], summary["final_step"], summary["dp"]) == ("finished", 8, 2)
    assert fake.named("reform") == [reform_call({3}, new_dp=2, spares=1, last_step=5)]
    assert fake.named("replenish_spares") == [{"target": 1}]
    # Steps 1-6 were attempted, then training went on after the restore point.
    assert group.attempts == [1, 2, 3, 4, 5, 6, *range(resumed + 1, 9)]
    # The struck steps were trained again on the same samples: each sample exactly once.
    assert summary["ledger"] == whole(8)
    (recovery,) = summary["recoveries"]
    assert (recovery["kind"], recovery["action"], recovery["ranks"], recovery["detected_at_step"]) == ("crash", "replace", [3], 6)
    assert (recovery["dp_before"], recovery["dp_after"], recovery["lost_steps"]) == (2, 2, 5 - resumed)
    (incident,) = incident_files(tmp_path).values()
    assert incident["plan"]["restore_step"] == resumed
    # Every step took STEP_S on the fake clock; the crashed attempt DETECT_S, the reform RECOVER_S.
    steps_run = 5 + (8 - resumed)
    wall = steps_run * STEP_S + DETECT_S + RECOVER_S
    assert summary["wall_time_s"] == pytest.approx(wall)
    assert summary["train_time_s"] == pytest.approx(8 * STEP_S)
    assert summary["goodput"] == pytest.approx(8 * STEP_S / wall)


@pytest.mark.parametrize("kind", ["crash", "hang", "node_lost"])
def test_a_lost_rank_without_a_spare_shrinks_the_job(tmp_path: Path, kind: str) -> None:
    job = elastic_job(mesh={"min_dp": 1})
    summary, group, fake = elastic_run(tmp_path, job, faults={3: [Fault(kind, 2)]})

    # Rank 2 is ring_pos 0 of replica 1 (cp=2): that replica goes, dp 2 -> 1.
    assert fake.named("capacity") == [{"lost": (2,), "reuse_slots": True}]
    assert fake.named("reform") == [reform_call({2}, new_dp=1, spares=0, last_step=2)]
    assert (summary["status"], summary["final_step"], summary["dp"]) == ("finished", 8, 1)
    (recovery,) = summary["recoveries"]
    assert (recovery["kind"], recovery["action"], recovery["dp_before"], recovery["dp_after"]) == (kind, "shrink", 2, 1)
    # The global batch is unchanged: replica 0 now trains all 4 samples of each step.
    assert summary["ledger"] == whole(8)
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["dp"]) for r in lines] == [(1, 2), (2, 2), *((s, 1) for s in range(3, 9))]
    assert summary["resizes"] == []  # no capacity came back
    assert json.loads((tmp_path / "workers.json").read_text()) == {"dp": 1, "ranks": [0, 1]}


@pytest.mark.parametrize(
    "spares, free_slots, action, status",
    [(0, 2, "replace", "finished"), (1, 0, "replace", "finished"), (0, 0, "abort", "failed")],
    ids=["new-worker", "spare", "nothing"],
)
def test_at_min_dp_a_lost_rank_is_replaced_or_the_run_fails(
    tmp_path: Path, spares: int, free_slots: int, action: str, status: str
) -> None:
    job = elastic_job(mesh={"min_dp": 2})
    summary, _, fake = elastic_run(tmp_path, job, faults={4: [Fault("crash", 1)]}, spares=spares, free_slots=free_slots)

    assert summary["status"] == status
    (incident,) = incident_files(tmp_path).values()
    assert (incident["kind"], incident["action"], incident["dp_before"]) == ("crash", action, 2)
    if status == "finished":
        assert fake.named("reform") == [reform_call({1}, new_dp=2, spares=spares, last_step=3)]
        assert summary["ledger"] == whole(8)
    else:
        assert fake.named("reform") == [] and summary["recoveries"] == []
        assert summary["final_step"] == 3 and "mesh.min_dp=2" in summary["error"]
        assert summary["ledger"] == whole(3)


def test_an_exception_in_a_rank_s_own_code_rolls_back_in_place_and_rejoins(tmp_path: Path) -> None:
    summary, group, fake = elastic_run(tmp_path, elastic_job(), faults={3: [Fault("error", 1)]})

    assert summary["status"] == "finished" and summary["dp"] == 2
    assert fake.named("capacity") == [] and fake.named("reform") == []  # no seat to fill
    assert fake.named("rollback") == [{"last_step": 2, "rejoin": True, "fired_through": 3}]
    (recovery,) = summary["recoveries"]
    assert (recovery["kind"], recovery["ranks"], recovery["action"]) == ("error", [1], "rollback")
    assert group.attempts == [1, 2, 3, 3, 4, 5, 6, 7, 8]
    assert summary["ledger"] == whole(8)



def test_an_incident_is_written_when_seen_and_again_with_recover_s_after_the_next_step(tmp_path: Path) -> None:
    summary, _, fake = elastic_run(tmp_path, elastic_job(mesh={"spares": 1}), faults={4: [Fault("crash", 3)]}, spares=1)

    # While the reform ran, the incident was already on disk, recovery still open.
    (at_detection,) = fake.incidents_at_reform
    assert (at_detection["kind"], at_detection["action"], at_detection["recover_s"], at_detection["dp_after"]) == (
        "crash", "replace", None, None,
    )
    ((name, done),) = incident_files(tmp_path).items()
    assert name == "0001-crash.json"
    # Step 4 started at 3.0 and failed at 3.25 (DETECT_S): the reform took RECOVER_S, then the
    # retried step 4 STEP_S, so training was back 2.0 + 1.0 after the failure was seen.
    assert done["detect_s"] == pytest.approx(DETECT_S)
    assert done["detected_at"] == pytest.approx(UNIX0 + 3 * STEP_S + DETECT_S)
    assert done["recover_s"] == pytest.approx(RECOVER_S + STEP_S)
    assert (done["dp_after"], done["lost_steps"], done["phases"]) == (2, 0, {"plan_s": 0.5})
    assert [o["outcome"] for o in done["verdict"]["outcomes"]] == ["error", "error", "error", "died"]
    assert summary["recoveries"][0]["recover_s"] == pytest.approx(RECOVER_S + STEP_S)



def test_back_to_back_failures_both_get_recover_s(tmp_path: Path) -> None:
    summary, _, _ = elastic_run(
        tmp_path, elastic_job(mesh={"spares": 2}), faults={3: [Fault("crash", 3), Fault("crash", 1)]}, spares=2
    )

    assert summary["status"] == "finished"
    first, second = incident_files(tmp_path).values()
    # Step 3 starts at 2.0 and fails at 2.25; reform to 4.25; the retry fails at 4.5; reform to
    # 6.5; the second retry completes at 7.5: training is back 5.25 after the first failure.
    assert second["recover_s"] == pytest.approx(7.5 - 4.5)
    assert first["recover_s"] == pytest.approx(7.5 - 2.25)



def test_the_same_error_on_the_same_step_twice_stops_the_run_naming_the_frame(tmp_path: Path) -> None:
    # A deterministic error comes back on the step's retry: one rollback, then the run stops,
    # well before controllers.max_recoveries (20) runs out.
    summary, group, fake = elastic_run(tmp_path, elastic_job(), faults={3: [Fault("error", 1)] * 3})

    assert summary["status"] == "failed" and summary["final_step"] == 2
    assert group.attempts == [1, 2, 3, 3]
    assert len(fake.named("rollback")) == 1
    location = summary["error_location"]
    assert (location["type"], location["message"], location["step"], location["ranks"]) == ("ValueError", "bad batch", 3, [1])
    assert location["frame"] == ERROR_FRAME and ERROR_FRAME in summary["error"]
    first, second = incident_files(tmp_path).values()
    assert (first["action"], second["action"]) == ("rollback", "abort")
    assert second["verdict"]["error"]["frame"] == ERROR_FRAME and "came back on step 3" in second["reason"]
