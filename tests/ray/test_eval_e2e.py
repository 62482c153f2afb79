"""`ringtrain eval` and `eval.every` end to end on an embedded local Ray cluster.

- A tiny Hugging Face model's loss over a 2-D .npy equals transformers' (``labels=input_ids``)
  within 1e-5 relative, on one rank and on a ring of two; passkey retrieval through the model
  folder's tokenizer gives a grid of the asked shape.
- A training run with ``eval.every`` records evaluations in metrics.jsonl, TensorBoard and the
  report; evaluating its run directory afterwards, on another mesh, from its durable
  checkpoint, gives the loss the run recorded after its last step.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ringtrain_dev.cli_runs import QUICKSTART, ringtrain_cli
from ringtrain_dev.ray_head import processes_using
from ringtrain_dev.tiny import TINY
from ringtrain_dev.tiny_tokenizer import save_tokenizer
from tests.hf_models import hf_logits, save_model, tokens

from .test_run_e2e import ray_tmp  # noqa: F401

pytestmark = [pytest.mark.ray, pytest.mark.slow]

ROWS, LENGTH = 3, 30


ringtrain = ringtrain_cli  # any subcommand: run, eval


def assert_buckets_add_up(result: dict[str, Any]) -> None:
    buckets = result["by_position"]
    assert sum(b["tokens"] for b in buckets) == result["tokens"]
    total = sum(b["loss"] * b["tokens"] for b in buckets if b["tokens"])
    assert math.isclose(total / result["tokens"], result["loss"], rel_tol=1e-9)


# Context parallelism is covered without Ray by tests/dist/test_evaluator.py (dp 2 x cp 2 ring,
# ZeRO-3) and by the training run below; here the CLI end to end, with passkey retrieval.
MESHES = {
    "one-rank": (["mesh.dp=1", "mesh.cp=1"], ["--passkey", "160,200", "--passkey-depths", "0,0.5,1"]),
}


@pytest.mark.parametrize(("mesh", "extra"), MESHES.values(), ids=MESHES.keys())
def test_eval_of_a_hf_model_equals_transformers(tmp_path: Path, ray_tmp: Path, mesh: list[str], extra: list[str]) -> None:
    folder = save_tokenizer(save_model(tmp_path / "hf", "qwen2"))
    ids = tokens(ROWS, LENGTH)
    np.save(tmp_path / "rows.npy", ids.numpy())
    _, expected = hf_logits(folder, ids)

    args = ["eval", str(folder), "--data", str(tmp_path / "rows.npy"), "--json", "--bucket-tokens", "4", *extra]
    result = ringtrain([*args, *mesh, "cluster.num_cpus=2"], home=tmp_path, ray_tmp=ray_tmp)
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])

    assert out["tokens"] == ROWS * (LENGTH - 1) and out["rows"] == ROWS and out["seq_len"] == LENGTH
    assert math.isclose(out["loss"], expected, rel_tol=1e-5), (out["loss"], expected)
    assert math.isclose(out["perplexity"], math.exp(out["loss"]), rel_tol=1e-9)
    assert [(b["start"], b["end"]) for b in out["by_position"]] == [(0, 4), (4, 8), (8, 16), (16, 32)]
    assert_buckets_add_up(out)
    if "--passkey" in extra:
        grid = out["passkey"]
        assert grid["lengths"] == [160, 200] and grid["depths"] == [0.0, 0.5, 1.0] and grid["trials"] == 1
        assert len(grid["accuracy"]) == 2 and all(len(row) == 3 for row in grid["accuracy"])
        assert all(0.0 <= a <= 1.0 for row in grid["accuracy"] for a in row)  # a random model scores what it scores
    assert processes_using(ray_tmp) == []


EVAL = ["eval.data=stdlib", "eval.seq_len=64", "eval.max_rows=4", "eval.bucket_tokens=16"]


def test_eval_every_records_evaluations_and_the_run_evaluates_alike(tmp_path: Path, ray_tmp: Path) -> None:
    run_dir = tmp_path / "run"
    train = [
        "run", str(QUICKSTART), *TINY, "train.steps=4", "checkpoint.persist_every=4", f"run_dir={run_dir}",
        "eval.every=2", *EVAL, "eval.passkey=[300]", "eval.passkey_depths=[0,1]",
    ]  # fmt: skip
    result = ringtrain(train, home=tmp_path, ray_tmp=ray_tmp)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "eval after step 2: loss" in result.stdout

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert [r["step"] for r in records if "eval" in r] == [2, 4]
    last = records[-1]["eval"]
    assert last["tokens"] == 4 * 64 and last["rows"] == 4
    assert [(b["start"], b["end"]) for b in last["by_position"]] == [(0, 16), (16, 32), (32, 64)]
    assert_buckets_add_up(last)
    assert last["passkey"]["lengths"] == [300] and len(last["passkey"]["accuracy"][0]) == 2
    assert records[1]["eval"]["loss"] != last["loss"]  # the model trained in between
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["eval"]["step"] == 4 and summary["eval"]["loss"] == last["loss"]
    page = (run_dir / "report.html").read_text()
    assert 'id="chart-eval-position"' in page and 'id="passkey-grid"' in page
    assert any(p.name.startswith("events.out.tfevents") for p in (run_dir / "tensorboard").iterdir())

    # The run's durable step-4 checkpoint, on one rank instead of the run's dp 2 x cp 2.
    flags = ["--data", "stdlib", "--seq-len", "64", "--max-rows", "4", "--bucket-tokens", "16", "--json"]
    again = ringtrain(["eval", str(run_dir), *flags, "mesh.dp=1", "mesh.cp=1"], home=tmp_path, ray_tmp=ray_tmp)
    assert again.returncode == 0, again.stderr[-3000:]
    out = json.loads(again.stdout.strip().splitlines()[-1])
    assert out["tokens"] == last["tokens"]
    assert math.isclose(out["loss"], last["loss"], rel_tol=1e-5), (out["loss"], last["loss"])
    assert "step 4" in again.stderr
    assert processes_using(ray_tmp) == []
