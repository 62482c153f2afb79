"""Resume from the durable store through the CLI, as a user would after an interruption.

An uninterrupted 12-step run is the reference; a run stopped after step 6 and resumed with
``checkpoint.resume=auto`` must match it bitwise, step losses and final parameters alike; a
resume of that step-6 checkpoint at dp=1 must match within float tolerance; a copy whose
checkpoints are all damaged must refuse to resume, naming each. A run SIGTERMed between durable
checkpoints (what ``ray job stop`` and Kubernetes send) holds its store's writer lease while it
trains, ends cleanly with a summary that says ``stopped``, saves its newest snapshot at the stop,
and its resume matches the reference bitwise too: the stop lost no step.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import tempfile
import time
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest

from ringtrain.checkpoint import open_store
from ringtrain.checkpoint.wire import FragmentIndex, decode
from ringtrain_dev.cli_runs import Background, records, stop_line
from ringtrain_dev.cli_runs import QUICKSTART, run_cli
from ringtrain_dev.ray_head import processes_using
from ringtrain_dev.tiny import TINY

pytestmark = [pytest.mark.ray, pytest.mark.slow]

STEPS = ["train.steps=12", "checkpoint.persist_every=3"]
STOP_AT = 6


def losses(run_dir: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def final_params(run_dir: Path, step: int) -> dict[str, np.ndarray]:
    loaded = open_store((run_dir / "checkpoints").as_uri()).load(step)
    index = FragmentIndex([decode(loaded.shards[name]) for name in sorted(loaded.shards)])
    return {name: index.full(name) for name in index.names}


class Runs:
    """`ringtrain run` of the tiny quickstart job in one home and Ray temp dir."""

    def __init__(self, home: Path, ray_tmp: Path) -> None:
        self.home, self.ray_tmp = home, ray_tmp

    def __call__(self, *args: str, returncode: int = 0) -> tuple[str, str]:
        result = run_cli([str(QUICKSTART), *TINY, *STEPS, *args], home=self.home, ray_tmp=self.ray_tmp)
        assert result.returncode == returncode, result.stderr[-3000:]
        return result.stdout, result.stderr


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Runs]:
    # Short on purpose: Ray's unix socket paths live below it and must stay under 107 bytes.
    ray_tmp = Path(tempfile.mkdtemp(prefix="rtt-", dir="/tmp"))
    try:
        yield Runs(tmp_path_factory.mktemp("home"), ray_tmp)
        assert processes_using(ray_tmp) == []
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)


@pytest.fixture(scope="module")
def stopped(runs: Runs) -> Path:
    """A run stopped after step STOP_AT, its checkpoints in its run directory: each test resumes a copy."""
    run_dir = runs.home / "stopped"
    runs(f"run_dir={run_dir}", f"train.stop_at_step={STOP_AT}")
    assert len(losses(run_dir)) == STOP_AT
    return run_dir


@pytest.fixture(scope="module")
def reference(runs: Runs) -> Path:
    """The uninterrupted run every resume is compared with."""
    run_dir = runs.home / "reference"
    runs(f"run_dir={run_dir}")
    return run_dir


def test_resume_from_the_durable_store_is_exact(runs: Runs, stopped: Path, reference: Path, tmp_path: Path) -> None:
    resumed, other_dp = tmp_path / "resumed", tmp_path / "other-dp"
    shutil.copytree(stopped, resumed)
    shutil.copytree(stopped, other_dp)  # the same checkpoint, resumed at another dp

    out, _ = runs(f"run_dir={resumed}", "checkpoint.resume=auto")
    assert "resumed from" in out and f"step-{STOP_AT:09d}" in out
    assert losses(resumed) == losses(reference)  # STOP_AT before the stop, the rest after: bitwise
    ref_params = final_params(reference, 12)
    for name, value in final_params(resumed, 12).items():
        np.testing.assert_array_equal(value, ref_params[name], err_msg=name)

    runs(f"run_dir={other_dp}", "checkpoint.resume=auto", "mesh.dp=1", "mesh.cp=2")
    summary = json.loads((other_dp / "summary.json").read_text())
    assert (summary["start_step"], summary["final_step"], summary["dp"]) == (STOP_AT, 12, 1)
    np.testing.assert_allclose(losses(other_dp), losses(reference), rtol=1e-5)
    for name, value in final_params(other_dp, 12).items():
        np.testing.assert_allclose(value, ref_params[name], rtol=0, atol=1e-5, err_msg=name)


def test_resume_with_no_valid_checkpoint_stops_with_the_reason(runs: Runs, stopped: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "damaged"
    shutil.copytree(stopped, run_dir)
    for shard in (run_dir / "checkpoints").glob("step-*/rank-*"):
        shard.write_bytes(shard.read_bytes()[:-7])  # truncated objects

    out, err = runs("checkpoint.resume=auto", f"run_dir={run_dir}", returncode=2)
    assert "checkpoint.resume" in err and "no valid checkpoint" in err
    for step in range(3, STOP_AT + 1, 3):
        assert f"step-{step:09d}" in out  # each skipped checkpoint is named, with its reason
    assert "Traceback" not in err
    assert len(losses(run_dir)) == STOP_AT  # nothing was trained from garbage


# Every rank sleeps this long in each of steps 3-11 (the same on all: no straggler): the run is
# still training while the test watches its lease and starts a second run on its store.
SLOW_STEPS = ",".join(f"{{kind: slow, rank: {rank}, step: 3, seconds: 1.0, count: 9}}" for rank in range(4))
LEASE_S = 3  # renewed every second: seen renewed well within the slowed steps


def test_a_sigterm_between_durable_checkpoints_loses_no_step(runs: Runs, reference: Path, tmp_path: Path) -> None:
    """Durable checkpoints only at the end (persist_every 12): SIGTERM after step 3 or later finds
    nothing durable but every step's snapshot in memory. The stop saves the newest, says so in one
    line, and `checkpoint.resume=auto` goes on from it to the reference's losses and parameters.

    While it trains, the run holds its store's writer lease, renewed as it goes: a second run on
    the same store is refused with exit 2 naming it, and the lease is gone once it has stopped."""
    run_dir = tmp_path / "sigterm"
    only_at_the_end = "checkpoint.persist_every=12"
    args = [str(QUICKSTART), *TINY, *STEPS, only_at_the_end, f"run_dir={run_dir}", f"checkpoint.lease_s={LEASE_S}",
            f"chaos.faults=[{SLOW_STEPS}]"]  # fmt: skip
    run = Background(args, home=runs.home, ray_tmp=runs.ray_tmp, logs=tmp_path / "logs")
    try:
        run.wait_for_steps(run_dir, 3)
        lease_path = run_dir / "checkpoints" / "writer.lease"
        first = json.loads(lease_path.read_text())
        assert first["holder"]["pid"] == run.proc.pid and first["holder"]["run_dir"] == str(run_dir)
        renewed = time.monotonic() + 30
        while json.loads(lease_path.read_text())["expires_at"] <= first["expires_at"]:
            assert time.monotonic() < renewed, "the lease was not renewed while the run trained"
            time.sleep(0.2)
        # A second run on the same store: refused before it starts anything.
        store_uri = (run_dir / "checkpoints").as_uri()
        second = run_cli([str(QUICKSTART), *TINY, f"checkpoint.uri={store_uri}", "checkpoint.resume=auto",
                          f"run_dir={tmp_path / 'second'}"], home=runs.home, ray_tmp=runs.ray_tmp, timeout=120)  # fmt: skip
        assert second.returncode == 2, second.stderr[-3000:]
        assert f"is being written by run 'quickstart' (pid {run.proc.pid} on " in second.stderr
        assert len(second.stderr.strip().splitlines()) == 1 and "Traceback" not in second.stderr
        assert not (tmp_path / "second").exists()
        assert len(records(run_dir)) < 12, "the run ended before the signal: slow its steps more"
        # To the run's whole process group: only the driver may hear it. Its embedded cluster's
        # processes, in a group of their own, keep serving the snapshot the stop saves (were they
        # signalled too, the save would race their end, and the driver wait 60 s for its GCS).
        code, seconds = run.stop(signal.SIGTERM, group=True)
    finally:
        run.kill()
    assert code == 1, run.stderr[-3000:]  # stopped, not finished; handled, not killed (-15)
    assert "Traceback" not in run.stderr and "Failed to connect to GCS" not in run.stderr, run.stderr[-3000:]
    assert seconds < 30, f"the stop took {seconds:.1f} s"
    summary = json.loads((run_dir / "summary.json").read_text())
    step = summary["final_step"]
    assert (summary["status"], summary["error"]) == ("stopped", "interrupted") and 3 <= step < 12, summary
    steps = [r["step"] for r in records(run_dir)]
    assert steps == list(range(1, step + 1))
    assert summary["final_loss"] == records(run_dir)[-1]["loss"] and summary["ledger"]["steps"] == step
    store = open_store((run_dir / "checkpoints").as_uri())
    line = stop_line(run.stdout)
    assert line is not None and re.fullmatch(rf"stop: saved step {step} to {re.escape(store.checkpoint_uri(step))} in [0-9.]+ s", line), line
    assert [ref.step for ref in store.list()] == [step]
    assert not (run_dir / "checkpoints" / "writer.lease").exists()  # released: no save was left writing

    out, _ = runs(f"run_dir={run_dir}", "checkpoint.resume=auto", only_at_the_end)
    assert f"step-{step:09d}" in out
    assert losses(run_dir) == losses(reference)  # the steps before the stop and after the resume: bitwise
    ref_params = final_params(reference, 12)
    for name, value in final_params(run_dir, 12).items():
        np.testing.assert_array_equal(value, ref_params[name], err_msg=name)
