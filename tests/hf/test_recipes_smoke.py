"""Each long-context recipe in jobs/, run for a few steps on a tiny random model of the same
architecture and rope scaling (Gemma 3's windowed layers and both its RoPEs too), with the
recipe's own settings (cp 2 ring, ZeRO-3, activation checkpointing) on gloo ranks: step 1's loss equals transformers' loss on the same samples,
and training goes on. (`tests/ray/test_eval_e2e.py` runs a model.hf job through `ringtrain run`.)"""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from ringtrain_dev.ranks import gloo_rank, run_ranks

pytestmark = [pytest.mark.dist, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
SEQ, BATCH, STEPS, CP = 64, 2, 3, 2
RECIPES = {"llama3-8b-128k.yaml": "llama", "qwen2.5-7b-128k.yaml": "qwen2", "gemma3-1b-128k.yaml": "gemma3"}


def _rank_main(rank: int, world: int, store: str, jobs: dict[str, list[str]], results: mp.Queue) -> None:
    import torch

    from ringtrain import config
    from ringtrain.hf import resolve_job
    from ringtrain.train.trainer import Trainer

    with gloo_rank(rank, world, store, results):
        out = {}
        for recipe, overrides in jobs.items():
            job = resolve_job(config.load(REPO / "jobs" / recipe, overrides))
            trainer = Trainer(job, rank=rank, device=torch.device("cpu"))
            reports = [trainer.train_step() for _ in range(STEPS)]
            out[recipe] = {
                "losses": [r.loss for r in reports], "grad_norms": [r.grad_norm for r in reports],
                "model": (job.model.dim, job.zero.stage, job.mesh.cp, job.model.activation_checkpointing),
            }
        if rank == 0:
            results.put(out)


def _rope(recipe: dict[str, Any]) -> dict[str, Any]:
    return {**recipe["model"]["rope_scaling"], "rope_theta": recipe["model"]["rope_theta"]}


def _tiny_model(folder: Path, arch: str, recipe: dict[str, Any]) -> Path:
    """A tiny random model of the recipe's architecture and rotary settings (Gemma 3's per layer type)."""
    from tests.hf.windowed_models import save_windowed
    from tests.hf_models import save_model

    if arch != "gemma3":
        return save_model(folder, arch, rope=_rope(recipe), max_position_embeddings=SEQ * 2)
    local = {"rope_type": "default", "rope_theta": recipe["model"]["rope_local_theta"]}
    return save_windowed(folder, "gemma3", rope_parameters={"full_attention": _rope(recipe), "sliding_attention": local})


def test_each_recipe_trains_a_tiny_model_of_its_architecture(tmp_path: Path) -> None:
    import torch

    from ringtrain.hf.hfconfig import SHAPE_KEYS
    from ringtrain.train.data import SampleOrder
    from tests.hf_models import hf_logits, tokens

    rows = tokens(16, SEQ).numpy().astype(np.int32)
    np.save(tmp_path / "rows.npy", rows)
    folders, jobs, modes = {}, {}, {}
    for recipe, arch in RECIPES.items():
        spec = yaml.safe_load((REPO / "jobs" / recipe).read_text())
        folders[recipe] = _tiny_model(tmp_path / arch, arch, spec)
        modes[recipe] = spec["model"]["activation_checkpointing"]
        jobs[recipe] = [
            f"model.hf={folders[recipe]}",
            *[f"model.{key}=null" for key in SHAPE_KEYS],  # the tiny model's shape, not 8B's
            "model.layer_types=null", "model.sliding_window=null",  # and its layers' windows
            f"data.path={tmp_path / 'rows.npy'}", f"data.seq_len={SEQ}", f"mesh.cp={CP}", "train.dtype=auto",
            f"train.steps={STEPS}", f"train.global_batch={BATCH}", "train.warmup_steps=1", "checkpoint.snapshot_every=0",
        ]

    out = run_ranks(_rank_main, CP, tmp_path, jobs)

    # Step 1 trains on global samples 0..BATCH-1, in the order the seed gives the rows.
    order = SampleOrder(rows.size, SEQ, seed=0, num_rows=len(rows))
    first = torch.from_numpy(rows[[order.window(s) for s in range(BATCH)]]).long()
    for recipe, run in out.items():
        assert run["model"] == (64, 3, CP, modes[recipe]), recipe  # the recipe's ZeRO-3 and checkpointing, tiny shape
        _, ref_loss = hf_logits(folders[recipe], first)
        assert abs(run["losses"][0] - ref_loss) / ref_loss < 1e-5, (recipe, run["losses"][0], ref_loss)
        assert all(np.isfinite(run["losses"])) and all(np.isfinite(run["grad_norms"])), recipe
        assert run["losses"][-1] != run["losses"][0], recipe
