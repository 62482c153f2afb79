"""`ringtrain run` end to end on an embedded local Ray cluster, as a user would start it.

Each run gets its own HOME and RAY_TMPDIR, so its Ray processes are recognisable by their
command lines; after the CLI exits none of them may be left.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

import pytest
import yaml

from ringtrain_dev.cli_runs import QUICKSTART, run_cli
from ringtrain_dev.ray_head import processes_using
from ringtrain_dev.tiny import TINY

pytestmark = [pytest.mark.ray, pytest.mark.slow]


@pytest.fixture
def ray_tmp() -> Iterator[Path]:
    # Short on purpose: Ray's unix socket paths live below it and must stay under 107 bytes.
    path = Path(tempfile.mkdtemp(prefix="rtt-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_run_writes_run_dir_and_leaves_no_process(tmp_path: Path, ray_tmp: Path) -> None:
    run_dir = tmp_path / "run"
    result = run_cli(
        [str(QUICKSTART), *TINY, "train.steps=3", f"run_dir={run_dir}"], home=tmp_path, ray_tmp=ray_tmp
    )
    assert result.returncode == 0, result.stderr[-3000:]

    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert config["mesh"] == {"dp": 2, "cp": 2, "ulysses": None, "min_dp": 1, "max_dp": None, "spares": 0}
    assert config["zero"]["stage"] == 2 and config["train"]["steps"] == 3 and config["run_dir"] == str(run_dir)

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    for r in records:
        assert {"step", "loss", "lr", "tokens", "step_time_s", "dp", "cp", "grad_norm"} <= r.keys()
        assert (r["dp"], r["cp"]) == (2, 2)
        assert r["tokens"] == 4 * 64  # global_batch x seq_len: every token of the step, counted once
        assert r["step_time_s"] > 0 and r["loss"] > 0

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "finished"
    assert summary["final_step"] == 3
    assert summary["final_loss"] == records[-1]["loss"]
    assert summary["tokens_per_s"] > 0 and summary["wall_time_s"] > 0
    assert summary["num_samples"] == 3 * 4

    assert "step 3/3" in result.stdout
    assert processes_using(ray_tmp) == []


def test_mesh_larger_than_cluster_is_refused(tmp_path: Path, ray_tmp: Path) -> None:
    result = run_cli(
        [str(QUICKSTART), *TINY, "mesh.dp=4", "mesh.cp=4", f"run_dir={tmp_path / 'run'}"],
        home=tmp_path,
        ray_tmp=ray_tmp,
    )
    assert result.returncode == 2, result.stderr[-3000:]
    assert "mesh.dp" in result.stderr and "16 workers" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "run").exists()
    assert processes_using(ray_tmp) == []
