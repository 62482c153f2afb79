"""`ringtrain eval --tasks` end to end on an embedded local Ray cluster, on a ring of two: local
YAML tasks of each request kind (tests/hf/lm_eval_tasks.py) give, in ``--json``'s lm-eval results
object, the metrics ``lm_eval --model hf`` gives on the same model folder."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from ringtrain_dev.cli_runs import ringtrain_cli
from ringtrain_dev.ray_head import processes_using
from ringtrain_dev.tiny_tokenizer import save_tokenizer
from tests.hf.lm_eval_tasks import MAX_LENGTH, OFFLINE, TASKS, assert_same_results, hf_reference, require_lm_eval, write_tasks
from tests.hf_models import save_model

from .test_run_e2e import ray_tmp  # noqa: F401  (fixture)

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def test_tasks_on_a_ring_give_lm_eval_hf_metrics(tmp_path: Path, ray_tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    require_lm_eval()
    for name, value in {**OFFLINE, "HF_DATASETS_CACHE": str(tmp_path / "cache")}.items():
        monkeypatch.setenv(name, value)
    model = save_tokenizer(save_model(tmp_path / "model", "llama"))
    tasks = write_tasks(tmp_path / "tasks")
    want = hf_reference(model, tasks)

    args = ["eval", str(model), "--tasks", ",".join(TASKS), "--include-path", str(tasks), "--json",
            "mesh.cp=2", "attention.impl=ring", f"data.seq_len={MAX_LENGTH}", "cluster.num_cpus=2"]
    assert os.environ["HF_DATASETS_OFFLINE"] == "1"
    result = ringtrain_cli(args, home=tmp_path, ray_tmp=ray_tmp)
    assert result.returncode == 0, result.stderr[-3000:]
    got = json.loads(result.stdout.strip().splitlines()[-1])
    assert_same_results(got, want)
    assert processes_using(ray_tmp) == []
