"""Fixtures shared by the Ray-tier tests."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest

from .test_elastic import JOB, job_file
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
