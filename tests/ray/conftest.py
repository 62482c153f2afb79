"""Fixtures shared by the Ray-tier tests."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest

from .test_elastic import JOB, STEPS, job_file
from .test_run_e2e import run_cli


@pytest.fixture(scope="session")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The elastic tests' job run without incidents on an embedded cluster: the run every
    recovered run must end up equal to."""
    home = tmp_path_factory.mktemp("reference")
    ray_tmp = Path(tempfile.mkdtemp(prefix="rte-", dir="/tmp"))
    try:
        result = run_cli([str(job_file(home)), f"run_dir={home / 'run'}", *JOB, "cluster.num_cpus=2"], home=home, ray_tmp=ray_tmp)
        assert result.returncode == 0, result.stderr[-3000:]
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    return home / "run"


# The batch the node-loss test's NaN poisons and controllers.on_nan=skip drops (0-based: step
# STEPS - 1 trains batch STEPS - 2 when nothing was skipped before).
SKIPPED_BATCH = STEPS - 2


@pytest.fixture(scope="session")
def skip_reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same job run without incidents but told to pass over SKIPPED_BATCH
    (train.skip_batches): what a run that skipped that batch must equal after the skip too."""
    home = tmp_path_factory.mktemp("skip-reference")
    ray_tmp = Path(tempfile.mkdtemp(prefix="rte-", dir="/tmp"))
    args = [str(job_file(home)), f"run_dir={home / 'run'}", *JOB, "cluster.num_cpus=2", f"train.skip_batches=[{SKIPPED_BATCH}]"]
    try:
        result = run_cli(args, home=home, ray_tmp=ray_tmp)
        assert result.returncode == 0, result.stderr[-3000:]
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    return home / "run"
