"""The experiment trackers against a real MLflow server and W&B's offline files: every step once
through a resume, a redone step never dropped, a tracker unreachable or slow never holding
training (a server lost in the middle of a real run: tests/ray/test_trackers_e2e.py)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

import pytest

from ringtrain import config
from ringtrain.errors import ConfigError
from ringtrain.telemetry import trackers as tracker_module
from ringtrain.telemetry.rundir import RunDir
from ringtrain.telemetry.trackers import Event, Point, Status, Trackers, TrackerSink, open_trackers, tracker_meta
from ringtrain_dev.fake_run import NAN_INCIDENT, step_record
from ringtrain_dev.mlflow_server import MlflowServer
from ringtrain_dev.ray_head import free_ports
from tests.trackers.wandb_records import offline_run

REPO = Path(__file__).resolve().parents[2]
TRAINING_TAGS = {"loss": "train/loss", "lr": "train/lr", "grad_norm": "train/grad_norm", "tokens": "throughput/tokens"}
WANDB_PROJECT = "ringtrain-tests"


@pytest.fixture(autouse=True)
def _offline_wandb(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # W&B keeps settings and a cache under HOME; nothing may reach a server.
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb-cache"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))


def job_with(uri: str = "", project: str = "", **more: str) -> config.JobConfig:
    overrides = [f"telemetry.mlflow.tracking_uri={uri}"] if uri else []
    overrides += [f"telemetry.wandb.project={project}", "telemetry.wandb.mode=offline"] if project else []
    overrides += [f"{k}={v}" for k, v in more.items()]
    return config.load("jobs/quickstart.yaml", overrides)


class Attempt:
    """One attempt of a run as the driver feeds it: the run directory's file first, then the trackers."""

    def __init__(self, job: config.JobConfig, path: Path, resume_meta: Optional[dict[str, Any]] = None) -> None:
        self.said: list[str] = []
        self.meta = tracker_meta(job, path, resume_meta)
        self.run_dir = RunDir(path)
        trackers = open_trackers(job, self.run_dir, self.said.append, resume_meta)
        assert trackers is not None
        self.trackers: Trackers = trackers

    def steps(self, records: Sequence[dict[str, Any]]) -> None:
        for record in records:
            self.run_dir.append_metrics(record)
            self.trackers.step(record)

    def incident(self, incident: dict[str, Any]) -> None:
        self.run_dir.write_incident(incident)
        self.trackers.incident(incident)

    def end(self, status: Status) -> None:
        self.trackers.close()
        self.run_dir.write_summary({"status": status})
        (self.run_dir.path / "report.html").write_text("<html>report</html>")
        self.run_dir.close()
        self.trackers.finish(status, timeout_s=60)


def latest_records(path: Path) -> dict[int, dict[str, Any]]:
    return tracker_module.read_history(path)


def mlflow_points(uri: str, run_id: str, tag: str) -> list[tuple[int, float]]:
    from mlflow.tracking import MlflowClient

    return sorted((m.step, m.value) for m in MlflowClient(uri).get_metric_history(run_id, tag))


def test_one_tracker_run_holds_every_step_once_through_a_resume(mlflow_server: MlflowServer, tmp_path: Path) -> None:
    from mlflow.tracking import MlflowClient

    job = job_with(mlflow_server.uri, WANDB_PROJECT, **{"telemetry.mlflow.experiment": "resume"})
    path = tmp_path / "run"
    first = Attempt(job, path)
    first.steps([step_record(s) for s in range(1, 7)])
    first.incident({**NAN_INCIDENT, "id": 1, "kind": "crash", "detected_at_step": 3, "action": "replace"})
    first.end("stopped")
    ids = json.loads((path / "trackers.json").read_text())

    # Resumed from a checkpoint of step 4: steps 5 and 6 are redone with the same training
    # values (an exact resume) but other timings; 7 to 10 are new.
    second = Attempt(job, path, resume_meta=first.meta)
    second.steps([step_record(s, tokens_per_s=1.0, step_time_s=9.0) for s in range(5, 11)])
    second.end("finished")
    assert first.said == second.said == []
    assert json.loads((path / "trackers.json").read_text())["mlflow"]["run_id"] == ids["mlflow"]["run_id"]

    history = latest_records(path)
    client = MlflowClient(mlflow_server.uri)
    experiment = client.get_experiment_by_name("resume")
    runs = client.search_runs([experiment.experiment_id])
    assert [r.info.run_id for r in runs] == [ids["mlflow"]["run_id"]]
    run = runs[0]
    for key, tag in TRAINING_TAGS.items():
        assert mlflow_points(mlflow_server.uri, run.info.run_id, tag) == [(s, pytest.approx(history[s][key])) for s in range(1, 11)], tag
    assert run.data.params["train.steps"] == str(job.train.steps)
    assert json.loads(run.data.params["mesh.dp"]) == job.mesh.dp
    assert run.data.tags["incident.0001"].startswith("crash at step 3")
    assert run.info.status == "FINISHED"
    assert {a.path for a in client.list_artifacts(run.info.run_id)} == {"report.html", "summary.json", "metrics.jsonl"}

    wandb_run = offline_run(path, ids["wandb"]["run_id"])
    assert ids["wandb"]["run_id"] == ids["run"]["key"]
    assert [step for step, _ in wandb_run.points if "train/loss" in _] == list(range(1, 11))
    for key, tag in TRAINING_TAGS.items():
        assert [wandb_run.history[s][tag] for s in range(1, 11)] == [pytest.approx(history[s][key]) for s in range(1, 11)], tag
    assert wandb_run.config["train.steps"] == str(job.train.steps)
    assert wandb_run.alerts == ["ringtrain incident 1: crash"]
    assert {"report.html", "summary.json", "metrics.jsonl"} <= wandb_run.files
    assert wandb_run.exit_codes == [1, 0]


def test_a_run_resumed_into_another_folder_continues_the_same_tracker_run(mlflow_server: MlflowServer, tmp_path: Path) -> None:
    job = job_with(mlflow_server.uri, **{"telemetry.mlflow.experiment": "moved"})
    first = Attempt(job, tmp_path / "a")
    first.steps([step_record(s) for s in range(1, 4)])
    first.end("stopped")
    # The checkpoint's meta carries the key; the new folder has no trackers.json.
    second = Attempt(job, tmp_path / "b", resume_meta={"format": 1, **first.meta})
    second.steps([step_record(s) for s in range(4, 6)])
    second.end("finished")
    a = json.loads((tmp_path / "a" / "trackers.json").read_text())["mlflow"]["run_id"]
    b = json.loads((tmp_path / "b" / "trackers.json").read_text())["mlflow"]["run_id"]
    assert a == b
    assert [s for s, _ in mlflow_points(mlflow_server.uri, a, "train/loss")] == [1, 2, 3, 4, 5]


def test_a_step_redone_with_other_values_is_kept_not_dropped(mlflow_server: MlflowServer, tmp_path: Path) -> None:
    job = job_with(mlflow_server.uri, WANDB_PROJECT, **{"telemetry.mlflow.experiment": "rollback"})
    attempt = Attempt(job, tmp_path / "run")
    # Steps 3 and 4 were corrupt; the run rolled back to 2 and redid them.
    attempt.steps([step_record(s) for s in range(1, 5)] + [step_record(s, loss=9.0 + s) for s in (3, 4)] + [step_record(5)])
    attempt.end("finished")
    ids = json.loads((tmp_path / "run" / "trackers.json").read_text())
    points = mlflow_points(mlflow_server.uri, ids["mlflow"]["run_id"], "train/loss")
    # MLflow keeps both points of a redone step; the later one is the run's.
    assert [s for s, _ in points] == [1, 2, 3, 3, 4, 4, 5]
    assert {v for s, v in points if s == 3} == {step_record(3)["loss"], 12.0}
    # W&B cannot take a step twice: the redone values are a table, not dropped.
    wandb_run = offline_run(tmp_path / "run", ids["wandb"]["run_id"])
    assert [s for s, p in wandb_run.points if "train/loss" in p] == [1, 2, 3, 4, 5]
    assert "redone_steps" in wandb_run.history[5]


def test_a_tracker_unreachable_at_the_start_is_one_warning(tmp_path: Path) -> None:
    job = job_with(f"http://127.0.0.1:{free_ports(1)[0]}")
    attempt = Attempt(job, tmp_path / "run")
    _wait_for(lambda: attempt.trackers.sinks[0].lost)
    attempt.steps([step_record(s) for s in range(1, 4)])
    attempt.end("finished")
    assert len(attempt.said) == 1 and "could not start its run" in attempt.said[0]
    assert sorted(latest_records(tmp_path / "run")) == [1, 2, 3]


class SlowTracker:
    name = "slow"
    where = "nowhere"

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.release = threading.Event()
        self.logged: list[int] = []

    def open(self, run_id: Optional[str], key: str, params: dict[str, str]) -> str:
        return "run"

    def log(self, points: Sequence[Point]) -> None:
        self.release.wait(self.seconds)
        self.logged += [p.step for p in points]

    def event(self, event: Event) -> None:
        pass

    def finish(self, status: Status, files: Sequence[Path]) -> None:
        pass


def test_a_slow_tracker_never_holds_a_step(tmp_path: Path) -> None:
    tracker = SlowTracker(seconds=30.0)
    sink = TrackerSink(tracker, tmp_path, {}, queue_points=4)
    started = time.monotonic()
    for s in range(1, 21):
        sink.step(step_record(s))
    assert time.monotonic() - started < 0.5
    assert sink.num_dropped > 0
    assert any("not keeping up" in t for t in sink.take_trouble())
    tracker.release.set()
    sink.finish("finished", tmp_path, timeout_s=10)
    assert tracker.logged[0] == 1 and len(tracker.logged) == 20 - sink.num_dropped


def test_a_tracker_without_its_package_is_bad_input(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError, match=r"telemetry\.wandb\.project.*pip install 'ringtrain\[wandb\]'"):
        tracker_module.check_installed(job_with(project="p"))
    with pytest.raises(ConfigError, match="telemetry.wandb.mode"):
        config.load("jobs/quickstart.yaml", ["telemetry.wandb.mode=sometimes"])
    with pytest.raises(ConfigError, match="telemetry.mlflow.tracking_uri"):
        config.load("jobs/quickstart.yaml", ["telemetry.mlflow.tracking_uri=mlflow.internal:5000"])


def _wait_for(condition: Any, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if condition():
                return
        except Exception:  # noqa: BLE001 - not there yet
            pass
        time.sleep(0.1)
    raise AssertionError("condition not met in time")


def test_submit_passes_named_variables_in_the_submission_only(tmp_path: Path) -> None:
    """Settings, not secrets: those go with --secret (tests/unit/test_submission_secrets.py)."""
    from ringtrain.submission import passed_env, runtime_env

    shell = {"WANDB_PROJECT": "p", "OTHER": "x"}
    env = runtime_env(tmp_path, env_vars=passed_env(["WANDB_PROJECT"], shell))
    assert env["env_vars"] == {"WANDB_PROJECT": "p"}
    assert "env_vars" not in runtime_env(tmp_path)
    with pytest.raises(ConfigError, match="--env: WANDB_ENTITY is not set in this shell"):
        passed_env(["WANDB_ENTITY"], shell)
    with pytest.raises(ConfigError, match="give the name only"):
        passed_env(["WANDB_PROJECT=p"], shell)


def test_a_wandb_run_ends_with_its_service_stopped(tmp_path: Path) -> None:
    """W&B's service (wandb-core, started by this process) ends with the run, not at the
    process's exit: an embedded cluster's cleanup then finds nothing of it to kill, and W&B's exit
    hook no service to lose the connection to (a 31-line traceback)."""
    import psutil

    def services() -> list[int]:
        return [p.pid for p in psutil.Process().children(recursive=True) if "wandb" in " ".join(p.cmdline())]

    attempt = Attempt(job_with(project=WANDB_PROJECT), tmp_path / "run")
    attempt.steps([step_record(s) for s in range(1, 4)])
    _wait_for(lambda: attempt.trackers.sinks[0].run_id is not None)  # its run started: the service is up
    assert services(), "W&B started no service process: nothing to check"
    attempt.end("finished")
    assert services() == [] and attempt.said == []
    ids = json.loads((tmp_path / "run" / "trackers.json").read_text())
    assert offline_run(tmp_path / "run", ids["wandb"]["run_id"]).exit_codes == [0]  # finished before it stopped


def test_a_local_mlflow_store_keeps_the_runs_files_beside_it_and_its_info_lines_quiet(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    cwd, store = tmp_path / "cwd", tmp_path / "store"
    cwd.mkdir()
    store.mkdir()
    job = config.load(str(REPO / "jobs" / "quickstart.yaml"), [f"telemetry.mlflow.tracking_uri=sqlite:///{store}/mlflow.db"])
    monkeypatch.chdir(cwd)  # where a user starts a run: MLflow's own default would put ./mlruns here
    attempt = Attempt(job, tmp_path / "run")
    attempt.steps([step_record(s) for s in range(1, 4)])
    attempt.end("finished")
    assert list(cwd.iterdir()) == [] and attempt.said == []
    assert {p.name for p in (store / "mlflow-artifacts").rglob("*") if p.is_file()} == {"report.html", "summary.json", "metrics.jsonl"}
    printed = capfd.readouterr()
    assert "INFO" not in printed.out + printed.err, printed.err
