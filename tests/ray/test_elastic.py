"""Failures and resizes on a Ray cluster of several nodes on this machine, through `ringtrain run`.

The job runs as a user would start it, against a ``ray.cluster_utils.Cluster``; the test acts
on it from outside (SIGKILL to a worker's pid from workers.json, removing and adding nodes)
while it watches metrics.jsonl, and compares the outcome with an uninterrupted run of the same
job: same losses and final parameters, every sample exactly once, the global batch unchanged.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import pytest

from ringtrain_dev.cli_runs import run_cli
from ringtrain_dev.ray_head import REPO, TORCH_EXTENSIONS_DIR, processes_using
from tests.chaos_replay import keep

from .test_resume_e2e import final_params, losses

pytestmark = [pytest.mark.ray, pytest.mark.slow]

STEPS = 16
GLOBAL_BATCH = 4
JOB = [
    "model.dim=64",
    "model.n_layers=2",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "data.seq_len=256",
    f"train.global_batch={GLOBAL_BATCH}",
    f"train.steps={STEPS}",
    "train.warmup_steps=2",
    "mesh.dp=2",
    "mesh.cp=2",
    "checkpoint.persist_every=0",  # the final step only: the parameters to compare
    "telemetry.metrics=false",
    "telemetry.tensorboard=false",
    "controllers.start_timeout_s=120",
    "controllers.grow_after_s=1",
]
RUN_TIMEOUT_S = 240.0


def job_file(folder: Path) -> Path:
    path = folder / "elastic.yaml"
    path.write_text("name: elastic\n")
    return path


@pytest.fixture
def cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """A head node with no CPU for workers (the job's driver runs there) plus the nodes each
    test adds; the job reaches it through its address."""
    from ray.cluster_utils import Cluster

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    temp_dir = tempfile.mkdtemp(prefix="rte-", dir="/tmp")
    monkeypatch.setenv("RAY_TMPDIR", temp_dir)
    (Path(temp_dir) / "ray").mkdir()
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "temp_dir": temp_dir, "include_dashboard": False})
    try:
        yield c
    finally:
        c.shutdown()
        assert processes_using(Path(temp_dir)) == []
        shutil.rmtree(temp_dir, ignore_errors=True)


def start_job(cluster: Any, run_dir: Path, home: Path, *overrides: str) -> subprocess.Popen[str]:
    env = dict(os.environ)
    env.update(
        HOME=str(home),
        RAY_AUTH_MODE="disabled",
        TORCH_EXTENSIONS_DIR=str(TORCH_EXTENSIONS_DIR),
        PYTHONPATH=os.pathsep.join([str(REPO / "platform"), env.get("PYTHONPATH", "")]),
    )
    args = [str(job_file(home)), f"run_dir={run_dir}", f"cluster.address={cluster.address}", *JOB, *overrides]
    return subprocess.Popen(
        [sys.executable, "-m", "ringtrain", "run", *args],
        env=env, cwd=home, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip


def records(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


Records = list[dict[str, Any]]


def wait_for(job: subprocess.Popen[str], run_dir: Path, what: str, done: Callable[[Records], bool]) -> Records:
    """Poll metrics.jsonl (every 20 ms, bounded) until ``done`` holds; fail if the job ends first."""
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while time.monotonic() < deadline:
        seen = records(run_dir)
        if done(seen):
            return seen
        if job.poll() is not None:
            pytest.fail(f"the job ended before {what}:\n{job.stdout.read()[-3000:] if job.stdout else ''}")
        time.sleep(0.02)
    pytest.fail(f"no {what} within {RUN_TIMEOUT_S:g} s")


def finish(job: subprocess.Popen[str]) -> str:
    try:
        out, _ = job.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGKILL)
        out, _ = job.communicate()
        pytest.fail(f"the job did not finish:\n{out[-3000:]}")
    assert job.returncode == 0, out[-3000:]
    return out


def run_to_its_end(home: Path, *overrides: str) -> Path:
    """The job (``JOB`` and ``overrides``) run through the CLI on an embedded cluster of its own:
    it must finish and leave no process. Its run directory."""
    ray_tmp = Path(tempfile.mkdtemp(prefix="rtc-", dir="/tmp"))  # short: Ray's socket paths live below it
    try:
        result = run_cli([str(job_file(home)), f"run_dir={home / 'run'}", *JOB, *overrides], home=home, ray_tmp=ray_tmp)
        assert result.returncode == 0, result.stderr[-3000:]
        assert processes_using(ray_tmp) == []
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    return home / "run"


def incidents(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted((run_dir / "incidents").glob("*.json"))]


def kept_losses(run_dir: Path) -> dict[int, float]:
    """Loss of each step as finally kept (a step redone after a rollback appears twice)."""
    return {r["step"]: r["loss"] for r in records(run_dir)}


def check_matches_reference(run_dir: Path, reference: Path) -> None:
    """Every kept step's loss and the final parameters are the uninterrupted run's."""
    assert kept_losses(run_dir) == dict(enumerate(losses(reference), start=1))
    ref_params = final_params(reference, STEPS)
    for name, value in final_params(run_dir, STEPS).items():
        np.testing.assert_allclose(value, ref_params[name], rtol=0, atol=1e-6, err_msg=name)


def check_ledger(summary: dict[str, Any], *, skipped: int = 0) -> None:
    assert summary["ledger"] == {
        "steps": STEPS,
        "samples": STEPS * GLOBAL_BATCH,
        "duplicates": 0,
        "missing": 0,
        "skipped": skipped,
    }


def test_a_killed_worker_is_replaced_by_a_warm_spare_and_training_matches_an_uninterrupted_run(
    cluster: Any, tmp_path: Path, reference: Path
) -> None:
    for _ in range(3):
        cluster.add_node(num_cpus=1)  # two replicas of 2 x 0.5 CPU, and the spare
    run_dir = tmp_path / "run"
    nan_step = 11
    job = start_job(
        cluster, run_dir, tmp_path, "mesh.spares=1", "controllers.on_nan=retry", f"chaos.faults=[{{kind: nan, rank: 0, step: {nan_step}}}]"
    )
    seen = wait_for(job, run_dir, "step 4", lambda rs: any(r["step"] >= 4 for r in rs))
    layout = json.loads((run_dir / "workers.json").read_text())
    victim = layout["workers"][1]["pid"]
    spare = layout["spares"][0]["pid"]
    time.sleep(seen[-1]["step_time_s"] / 2)  # mid-step: the kill lands while collectives are under way
    os.kill(victim, signal.SIGKILL)
    out = finish(job)

    crash, nan = incidents(run_dir)
    assert (crash["kind"], crash["action"], crash["ranks"], crash["dp_before"], crash["dp_after"]) == ("crash", "replace", [1], 2, 2), out
    assert crash["lost_steps"] <= 1 and crash["recover_s"] is not None
    assert (nan["kind"], nan["action"], nan["ranks"], nan["detected_at_step"], nan["lost_steps"]) == ("nan", "rollback", [0], nan_step, 0)
    assert json.loads((run_dir / "workers.json").read_text())["workers"][1]["pid"] == spare

    # The same dp throughout, the state restored exactly: the run is the uninterrupted one.
    check_matches_reference(run_dir, reference)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["dp"] == 2
    assert [r["id"] for r in summary["recoveries"]] == [1, 2]
    check_ledger(summary)
    keep(run_dir, "crash_replaced_by_a_spare_then_nan")


def test_a_lost_node_shrinks_the_job_and_returning_capacity_grows_it_back(
    cluster: Any, tmp_path: Path, reference: Path, skip_reference: Path
) -> None:
    nodes = [cluster.add_node(num_cpus=1) for _ in range(2)]  # one replica per node, nothing spare
    run_dir = tmp_path / "run"
    nan_step = STEPS - 1
    # Slow steps leave the newest snapshot time to reach the buddy node before the node goes
    # (it is removed once step 3 is recorded, in slow step 4: a loaded machine can otherwise
    # lag the buddy copy two steps behind), and after the shrink they leave the new replica time
    # to start and warm up in the background while training goes on (it joins at a step
    # boundary): about 9 s alone, 20-26 s beside another Ray test on two cores, and 11 slow
    # steps of 3 s leave it about 35 s; they change no number.
    slow = ", ".join(f"{{kind: slow, rank: 0, step: {s}, seconds: 3.0}}" for s in range(4, nan_step))
    faults = f"[{{kind: nan, rank: 1, step: {nan_step}}}, {slow}]"
    job = start_job(
        cluster, run_dir, tmp_path, "mesh.min_dp=1", "controllers.on_nan=skip", "controllers.grow_after_s=0", f"chaos.faults={faults}"
    )
    wait_for(job, run_dir, "step 3", lambda rs: any(r["step"] >= 3 for r in rs))
    layout = json.loads((run_dir / "workers.json").read_text())
    lost_node = next(n for n in nodes if n.node_id == layout["workers"][2]["node_id"])
    cluster.remove_node(lost_node, allow_graceful=False)
    wait_for(job, run_dir, "a step at dp 1", lambda rs: any(r["dp"] == 1 for r in rs))
    cluster.add_node(num_cpus=1)  # capacity returns
    wait_for(job, run_dir, "a step at dp 2 after the shrink", lambda rs: rs[-1]["dp"] == 2 and any(r["dp"] == 1 for r in rs))
    out = finish(job)

    lost, nan = incidents(run_dir)
    assert (lost["kind"], lost["action"], lost["dp_before"], lost["dp_after"]) == ("node_lost", "shrink", 2, 1), out
    assert sorted(lost["ranks"]) == [2, 3] and lost["lost_steps"] <= 1
    assert (nan["kind"], nan["action"], nan["detected_at_step"]) == ("nan", "rollback", nan_step)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert [(r["dp_before"], r["dp_after"]) for r in summary["resizes"]] == [(1, 2)]
    assert summary["status"] == "finished" and summary["dp"] == 2

    # The global batch never changed: every step trained the same tokens, at dp 2 and at dp 1,
    # and up to the skipped batch the losses are the uninterrupted run's (up to the order of
    # the gradient reductions, which the dp changes).
    tokens = {r["tokens"] for r in records(run_dir)}
    assert tokens == {GLOBAL_BATCH * 256}
    ref = losses(reference)
    mine = kept_losses(run_dir)
    np.testing.assert_allclose([mine[s] for s in range(1, nan_step)], ref[: nan_step - 1], rtol=1e-4)
    # After the skip too: every kept loss is that of a run told to pass over the same batch.
    skipped = losses(skip_reference)
    assert len(skipped) == STEPS and len(mine) == STEPS
    np.testing.assert_allclose([mine[s] for s in range(1, STEPS + 1)], skipped, rtol=1e-4)
    check_ledger(summary, skipped=GLOBAL_BATCH)
    keep(run_dir, "node_lost_shrink_nan_skip_grow")
