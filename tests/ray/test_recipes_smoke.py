"""Each long-context recipe in jobs/, run for a few steps by `ringtrain run` on a tiny random
model of the same architecture and rope scaling (cp 2 ring, ZeRO-3, activation checkpointing):
step 1's loss equals transformers' loss on the same samples, and training goes on."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml

from ringtrain.hf.hfconfig import SHAPE_KEYS
from ringtrain.train.data import SampleOrder
from tests.hf_models import hf_logits, save_model, tokens

from .test_run_e2e import REPO, ray_tmp, run_cli  # noqa: F401  (ray_tmp: a fixture)

pytestmark = [pytest.mark.ray, pytest.mark.slow]

SEQ, BATCH, STEPS = 64, 2, 3
RECIPES = {"llama3-8b-128k.yaml": "llama", "qwen2.5-7b-128k.yaml": "qwen2"}


def _rope(recipe: dict[str, Any]) -> dict[str, Any]:
    return {**recipe["model"]["rope_scaling"], "rope_theta": recipe["model"]["rope_theta"]}


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_trains_a_tiny_model_of_its_architecture(recipe: str, tmp_path: Path, ray_tmp: Path) -> None:
    job_file = REPO / "jobs" / recipe
    spec = yaml.safe_load(job_file.read_text())
    folder = save_model(tmp_path / "model", RECIPES[recipe], rope=_rope(spec), max_position_embeddings=SEQ * 2)
    rows = tokens(16, SEQ).numpy().astype(np.int32)
    np.save(tmp_path / "rows.npy", rows)
    run_dir = tmp_path / "run"

    result = run_cli(
        [
            str(job_file),
            f"model.hf={folder}",
            *[f"model.{key}=null" for key in SHAPE_KEYS],  # the tiny model's shape, not 8B's
            f"data.path={tmp_path / 'rows.npy'}",
            f"data.seq_len={SEQ}",
            "mesh.cp=2",
            "train.dtype=auto",
            f"train.steps={STEPS}",
            f"train.global_batch={BATCH}",
            "train.warmup_steps=1",
            "cluster.num_cpus=2",
            f"run_dir={run_dir}",
        ],
        home=tmp_path,
        ray_tmp=ray_tmp,
    )
    assert result.returncode == 0, result.stderr[-3000:]

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    # Step 1 trains on global samples 0..BATCH-1, in the order the seed gives the rows.
    order = SampleOrder(rows.size, SEQ, seed=0, num_rows=len(rows))
    first = torch.from_numpy(rows[[order.window(s) for s in range(BATCH)]]).long()
    _, ref_loss = hf_logits(folder, first)
    assert abs(records[0]["loss"] - ref_loss) / ref_loss < 1e-5
    assert all(np.isfinite(r["loss"]) and np.isfinite(r["grad_norm"]) for r in records)

    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert config["model"]["dim"] == 64 and config["model"]["rope_scaling"]["rope_type"] == spec["model"]["rope_scaling"]["rope_type"]
