"""The Controller's state machine on a run's steps, against a scripted worker group: a clean run,
stop_at_step, a failed step without recovery, a bug in the group. No Ray, no torch.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Callable, Optional

import pytest

from ringtrain.actors.controller import Controller
from ringtrain.actors.steps import StepResult
from ringtrain.telemetry.rundir import RunDir

from tests.unit.controller_fakes import Clock, ElasticGroup, FakeElastic, Fault, RecordingPersister, ScriptedGroup, elastic_job, job


def test_a_clean_run_finishes_and_persists_on_cadence(tmp_path: Path) -> None:
    group, persister = ScriptedGroup(), RecordingPersister()
    summary = Controller(job(), group, RunDir(tmp_path), persister=persister).run()

    assert summary["status"] == "finished" and summary["final_step"] == 6
    assert persister.submitted == [2, 4, 6] == group.snapshot_requests
    assert persister.closed and group.shut_down
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3, 4, 5, 6]
    assert json.loads((tmp_path / "summary.json").read_text())["num_samples"] == 6
    assert not (tmp_path / "incidents").exists()


def test_stop_at_step_ends_early_and_persists_that_step(tmp_path: Path) -> None:
    group, persister = ScriptedGroup(), RecordingPersister()
    summary = Controller(job("train.stop_at_step=3"), group, RunDir(tmp_path), persister=persister).run()
    assert (summary["status"], summary["final_step"]) == ("finished", 3)
    assert persister.submitted == [2, 3]


@pytest.mark.parametrize(
    ("failure", "kind", "ranks"),
    [("nan", "nan", [1]), ("died", "crash", [1])],
)
def test_a_failed_step_records_an_incident_and_fails_the_run(tmp_path: Path, failure: str, kind: str, ranks: list[int]) -> None:
    group = ScriptedGroup(fail_at=3, failure=failure)
    summary = Controller(job(), group, RunDir(tmp_path)).run()

    assert summary["status"] == "failed" and summary["final_step"] == 2
    (path,) = sorted((tmp_path / "incidents").glob("*.json"))
    assert path.name == f"0001-{kind}.json"
    incident = json.loads(path.read_text())
    assert (incident["kind"], incident["ranks"], incident["detected_at_step"], incident["action"]) == (kind, ranks, 3, "abort")
    assert summary["incidents"] == [{"id": 1, "kind": kind, "ranks": ranks, "step": 3}]
    assert group.shut_down
    # The poisoned step is not in the metrics: nothing after step 2 was kept.
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 2



class BrokenGroup(ElasticGroup):
    def train_step(self, probe: bool = False, on_safe: Optional[Callable[[int], None]] = None) -> StepResult:
        if self.step == 2:
            raise RuntimeError("a bug in the group")
        return super().train_step()


def test_an_unexpected_exception_still_leaves_a_summary(tmp_path: Path) -> None:
    job = elastic_job()
    clock = Clock()
    group = BrokenGroup(job, clock)
    try:
        Controller(job, group, RunDir(tmp_path), elastic=FakeElastic(group, tmp_path), clock=clock).run()
    except RuntimeError:
        pass

    assert group.shut_down
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert (summary["status"], summary["final_step"]) == ("failed", 2)


def test_a_step_result_is_frozen_and_a_failed_one_without_recovery_ends_the_run_naming_the_rank(tmp_path: Path) -> None:
    job = elastic_job()
    clock = Clock()
    group = ElasticGroup(job, clock, faults={3: [Fault("crash", 1)]})
    with pytest.raises(dataclasses.FrozenInstanceError):
        StepResult().reports = ()  # type: ignore[misc]

    summary = Controller(job, group, RunDir(tmp_path), clock=clock).run()

    assert (summary["status"], summary["final_step"]) == ("failed", 2)
    assert summary["error"] == "rank 1 on h: worker process of ranks [1] died"
    assert summary["incidents"] == [{"id": 1, "kind": "crash", "ranks": [1], "step": 3}]


class ResumingGroup(ScriptedGroup):
    """Its ranks load a checkpoint of step 3, as WorkerGroup's do: the run begins after it."""

    def restore(self, blobs: list[bytes]) -> int:
        self.restored = blobs
        self.step = self.start_step = 3
        return 3


def test_a_resumed_run_begins_after_the_step_its_group_restored(tmp_path: Path) -> None:
    from ringtrain.checkpoint import open_store

    store = open_store((tmp_path / "ckpt").as_uri())
    store.save(3, {"rank-0": b"zero", "rank-1": b"one"}, {"step": 3})
    group = ResumingGroup()

    summary = Controller(job(), group, RunDir(tmp_path / "run"), resume_from=store.load(3)).run()

    assert group.restored == [b"zero", b"one"]
    assert (summary["status"], summary["start_step"], summary["final_step"]) == ("finished", 3, 6)
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [4, 5, 6]
