"""Resume from the durable store through the CLI, as a user would after an interruption.

An uninterrupted 20-step run is the reference; a run stopped after step 10 and resumed with
``checkpoint.resume=auto`` must match it bitwise, step losses and final parameters alike; a
resume of that step-10 checkpoint at dp=1 must match within float tolerance.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from ringtrain.checkpoint import open_store
from ringtrain.checkpoint.wire import FragmentIndex, decode

from .test_run_e2e import QUICKSTART, TINY, processes_using, ray_tmp, run_cli  # noqa: F401  (fixture)

pytestmark = [pytest.mark.ray, pytest.mark.slow]

STEPS = ["train.steps=20", "checkpoint.persist_every=5"]


def losses(run_dir: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def final_params(run_dir: Path, step: int) -> dict[str, np.ndarray]:
    loaded = open_store((run_dir / "checkpoints").as_uri()).load(step)
    index = FragmentIndex([decode(loaded.shards[name]) for name in sorted(loaded.shards)])
    return {name: index.full(name) for name in index.names}


def test_resume_from_the_durable_store_is_exact(tmp_path: Path, ray_tmp: Path) -> None:
    def cli(*args: str) -> str:
        result = run_cli([str(QUICKSTART), *TINY, *STEPS, *args], home=tmp_path, ray_tmp=ray_tmp)
        assert result.returncode == 0, result.stderr[-3000:]
        return result.stdout

    reference, stopped, other_dp = tmp_path / "reference", tmp_path / "stopped", tmp_path / "other-dp"
    cli(f"run_dir={reference}")
    cli(f"run_dir={stopped}", "train.stop_at_step=10")
    assert len(losses(stopped)) == 10
    shutil.copytree(stopped, other_dp)  # the same step-10 checkpoint, resumed at another dp

    out = cli(f"run_dir={stopped}", "checkpoint.resume=auto")
    assert "resumed from" in out and "step-000000010" in out
    assert losses(stopped) == losses(reference)  # 10 before the stop + 10 after, bitwise
    ref_params = final_params(reference, 20)
    for name, value in final_params(stopped, 20).items():
        np.testing.assert_array_equal(value, ref_params[name], err_msg=name)

    cli(f"run_dir={other_dp}", "checkpoint.resume=auto", "mesh.dp=1", "mesh.cp=2")
    summary = json.loads((other_dp / "summary.json").read_text())
    assert (summary["start_step"], summary["final_step"], summary["dp"]) == (10, 20, 1)
    np.testing.assert_allclose(losses(other_dp), losses(reference), rtol=1e-5)
    for name, value in final_params(other_dp, 20).items():
        np.testing.assert_allclose(value, ref_params[name], rtol=0, atol=1e-5, err_msg=name)
    assert processes_using(ray_tmp) == []


def test_resume_with_no_valid_checkpoint_stops_with_the_reason(tmp_path: Path, ray_tmp: Path) -> None:
    run_dir = tmp_path / "run"
    first = run_cli([str(QUICKSTART), *TINY, *STEPS, "train.stop_at_step=5", f"run_dir={run_dir}"], home=tmp_path, ray_tmp=ray_tmp)
    assert first.returncode == 0, first.stderr[-3000:]
    for shard in (run_dir / "checkpoints").glob("step-*/rank-*"):
        shard.write_bytes(shard.read_bytes()[:-7])  # truncated objects

    result = run_cli(
        [str(QUICKSTART), *TINY, *STEPS, "checkpoint.resume=auto", f"run_dir={run_dir}"], home=tmp_path, ray_tmp=ray_tmp
    )
    assert result.returncode == 2
    assert "checkpoint.resume" in result.stderr and "no valid checkpoint" in result.stderr
    assert "step-000000005" in result.stdout  # the skipped checkpoint is named, with its reason
    assert "Traceback" not in result.stderr
    assert len(losses(run_dir)) == 5  # nothing was trained from garbage
