"""Fixtures shared by the Ray-tier tests."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest
from filelock import FileLock

from ringtrain_dev.cli_runs import run_cli

from .test_elastic import JOB, STEPS, job_file

# The batch the node-loss test's NaN poisons and controllers.on_nan=skip drops (0-based: step
# STEPS - 1 trains batch STEPS - 2 when nothing was skipped before).
SKIPPED_BATCH = STEPS - 2


def uninterrupted_run(tmp_path_factory: pytest.TempPathFactory, worker_id: str, name: str, *overrides: str) -> Path:
    """The elastic tests' job, run without incidents on an embedded cluster, once per session:
    the pytest-xdist workers share the run (the first to ask makes it, under a file lock)."""
    if worker_id == "master":  # one process: its own temp folders are the session's
        return _run(tmp_path_factory.mktemp(name), overrides)
    shared = tmp_path_factory.getbasetemp().parent  # the session's, above every worker's own
    home, made = shared / name, shared / f"{name}.made"
    with FileLock(str(shared / f"{name}.lock")):
        if not made.exists():
            shutil.rmtree(home, ignore_errors=True)  # a failed attempt's: run it again
            home.mkdir()
            _run(home, overrides)
            made.touch()
    return home / "run"


def _run(home: Path, overrides: tuple[str, ...]) -> Path:
    ray_tmp = Path(tempfile.mkdtemp(prefix="rte-", dir="/tmp"))
    try:
        args = [str(job_file(home)), f"run_dir={home / 'run'}", *JOB, "cluster.num_cpus=2", *overrides]
        result = run_cli(args, home=home, ray_tmp=ray_tmp)
        assert result.returncode == 0, result.stderr[-3000:]
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    return home / "run"


@pytest.fixture(scope="session")
def reference(tmp_path_factory: pytest.TempPathFactory, worker_id: str) -> Path:
    """What every recovered run must end up equal to."""
    return uninterrupted_run(tmp_path_factory, worker_id, "reference")


@pytest.fixture(scope="session")
def skip_reference(tmp_path_factory: pytest.TempPathFactory, worker_id: str) -> Path:
    """The same job told to pass over SKIPPED_BATCH (train.skip_batches): what a run that
    skipped that batch must equal after the skip too."""
    return uninterrupted_run(tmp_path_factory, worker_id, "skip-reference", f"train.skip_batches=[{SKIPPED_BATCH}]")
