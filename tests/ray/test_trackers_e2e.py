"""A run followed by MLflow (a real server) and W&B (offline files) through a crashed worker, a
shrink, a stop and a resume: one tracker run each, every step in it once, with metrics.jsonl's
values, the config, the incidents and the run's files."""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Iterator

import pytest

from ringtrain.telemetry.trackers import read_history
from ringtrain_dev.cli_runs import QUICKSTART, run_cli
from ringtrain_dev.mlflow_server import MlflowServer, start_mlflow
from ringtrain_dev.ray_head import processes_using
from ringtrain_dev.tiny import TINY
from tests.trackers.conftest import mlflow_server  # noqa: F401 (a fixture)
from tests.trackers.wandb_records import offline_run

pytestmark = [pytest.mark.ray, pytest.mark.slow]

STEPS = 8
STOP_AT = 5
LOST_RUN_STEPS = 16  # of the run whose tracking server goes after its second step
TRAINING = {"loss": "train/loss", "lr": "train/lr", "grad_norm": "train/grad_norm"}


@pytest.fixture
def ray_tmp() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="rtt-", dir="/tmp"))
    try:
        yield path
        assert processes_using(path) == []
    finally:
        shutil.rmtree(path, ignore_errors=True)


def test_a_crashed_shrunk_stopped_and_resumed_run_is_one_tracker_run(mlflow_server: MlflowServer, tmp_path: Path, ray_tmp: Path) -> None:
    from mlflow.tracking import MlflowClient

    run_dir = tmp_path / "run"
    common = [
        # Two replicas of one rank: the crash takes one and shrinks the job, as with rings of two.
        str(QUICKSTART), *TINY, f"run_dir={run_dir}", f"train.steps={STEPS}", "checkpoint.persist_every=2",
        "mesh.dp=2", "mesh.cp=1", "mesh.min_dp=1", "controllers.grow_after_s=1000",
        f"telemetry.mlflow.tracking_uri={mlflow_server.uri}", "telemetry.mlflow.experiment=e2e",
        "telemetry.wandb.project=ringtrain-e2e", "telemetry.wandb.mode=offline",
    ]  # fmt: skip
    crashed = run_cli([*common, f"train.stop_at_step={STOP_AT}", "chaos.faults=[{kind: crash, rank: 1, step: 2}]"], home=tmp_path, ray_tmp=ray_tmp)
    assert crashed.returncode == 0, crashed.stderr[-3000:]
    resumed = run_cli([*common, "checkpoint.resume=auto"], home=tmp_path, ray_tmp=ray_tmp)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "warning" not in (crashed.stdout + resumed.stdout).lower()
    # W&B's service ends with its run: nothing of it for the cluster's cleanup to kill, no traceback.
    for ended in (crashed, resumed):
        assert "outlived" not in ended.stderr and "Traceback" not in ended.stdout + ended.stderr, ended.stderr[-3000:]

    history = read_history(run_dir)
    assert sorted(history) == list(range(1, STEPS + 1))
    assert history[3]["dp"] == 1, "the crash did not shrink the job"
    ids = json.loads((run_dir / "trackers.json").read_text())
    incidents = [json.loads(p.read_text()) for p in sorted((run_dir / "incidents").glob("*.json"))]
    assert [i["kind"] for i in incidents] == ["crash"]

    client = MlflowClient(mlflow_server.uri)
    runs = client.search_runs([client.get_experiment_by_name("e2e").experiment_id])
    assert [r.info.run_id for r in runs] == [ids["mlflow"]["run_id"]]
    run = runs[0]
    for key, tag in TRAINING.items():
        points = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, tag))
        assert points == [(s, pytest.approx(history[s][key], rel=1e-12)) for s in range(1, STEPS + 1)], tag
    assert run.data.params["train.steps"] == str(STEPS) and run.data.params["mesh.min_dp"] == "1"
    assert run.data.tags["incident.0001"].startswith("crash at step 2 on ranks [1]")
    assert run.info.status == "FINISHED"
    assert {a.path for a in client.list_artifacts(run.info.run_id)} == {"report.html", "summary.json", "metrics.jsonl"}

    wandb_run = offline_run(run_dir, ids["wandb"]["run_id"])
    assert [s for s, p in wandb_run.points if "train/loss" in p] == list(range(1, STEPS + 1))
    for key, tag in TRAINING.items():
        assert [wandb_run.history[s][tag] for s in range(1, STEPS + 1)] == [pytest.approx(history[s][key], rel=1e-12) for s in range(1, STEPS + 1)]
    assert wandb_run.alerts == ["ringtrain incident 1: crash"]
    assert wandb_run.config["mesh.min_dp"] == "1"
    assert {"report.html", "summary.json", "metrics.jsonl"} <= wandb_run.files


def test_a_tracker_server_lost_mid_run_costs_the_run_nothing(tmp_path: Path, ray_tmp: Path) -> None:
    server = start_mlflow(tmp_path / "mlflow")
    run_dir = tmp_path / "run"
    # Steps enough after the server goes that the run cannot have ended first, however late this
    # thread, on a loaded machine, sees the second one.
    args = [str(QUICKSTART), *TINY, f"run_dir={run_dir}", f"train.steps={LOST_RUN_STEPS}", "mesh.dp=1", "mesh.cp=2",
            f"telemetry.mlflow.tracking_uri={server.uri}"]
    result: dict[str, subprocess.CompletedProcess[str]] = {}
    thread = threading.Thread(target=lambda: result.update(run=run_cli(args, home=tmp_path, ray_tmp=ray_tmp)))
    thread.start()
    try:
        deadline = time.monotonic() + 240
        while len(read_history(run_dir)) < 2 and thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        server.stop()  # the tracking server goes away while the run trains
    thread.join(300)
    run = result["run"]
    assert run.returncode == 0, run.stderr[-3000:]
    assert sorted(read_history(run_dir)) == list(range(1, LOST_RUN_STEPS + 1))
    incidents = [json.loads(p.read_text()) for p in sorted((run_dir / "incidents").glob("*.json"))]
    assert [(i["kind"], i["action"]) for i in incidents] == [("tracker", "continue")]
    assert "warning: mlflow at " in run.stdout + run.stderr
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "finished"
    assert (run_dir / "report.html").is_file()
