"""The Controller's state machine against a scripted worker group: no Ray, no torch."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Optional

import pytest

from ringtrain import config
from ringtrain.actors.controller import Controller
from ringtrain.errors import WorkerError
from ringtrain.status import StepReport, WorkerInfo
from ringtrain.telemetry.rundir import RunDir


class ScriptedGroup:
    """Two ranks whose step ``fail_at`` goes wrong in the scripted way."""

    def __init__(self, *, fail_at: Optional[int] = None, failure: str = "nan") -> None:
        self.num_params = 123
        self.infos = [WorkerInfo(rank=r, host="h", pid=r, device="cpu") for r in range(2)]
        self.fail_at = fail_at
        self.failure = failure
        self.step = 0
        self.shut_down = False
        self.snapshot_requests: list[int] = []

    def start(self) -> None:
        pass

    def train_step(self) -> list[StepReport]:
        self.step += 1
        if self.step == self.fail_at and self.failure == "died":
            raise WorkerError(1, "h", "worker process died", kind="died")
        bad = self.step == self.fail_at and self.failure == "nan"
        loss = math.nan if bad else 5.0 / self.step
        return [
            StepReport(step=self.step, rank=r, loss=loss, local_loss=math.nan if bad and r == 1 else 5.0,
                       lr=1e-3, grad_norm=1.0, num_tokens=64, step_time_s=0.01, samples=(self.step,) if r == 0 else ())
            for r in range(2)
        ]

    def snapshot_refs(self, step: int) -> list[Any]:
        self.snapshot_requests.append(step)
        return [f"ref-{step}-{r}" for r in range(2)]

    def restore(self, blobs: list[bytes]) -> int:
        raise AssertionError("not resumed in these tests")

    def shutdown(self) -> None:
        self.shut_down = True


class RecordingPersister:
    last_durable_step = 0

    def __init__(self) -> None:
        self.errors: list[str] = []
        self.submitted: list[int] = []
        self.closed = False

    def submit(self, step: int, snapshot_refs: list[Any]) -> None:
        self.submitted.append(step)

    def poll(self) -> list[Any]:
        return []

    def flush(self) -> list[Any]:
        return []

    def close(self) -> None:
        self.closed = True


def job(*overrides: str) -> config.JobConfig:
    return config.load(None, ["mesh.dp=2", "train.steps=6", "checkpoint.persist_every=2", *overrides])


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
