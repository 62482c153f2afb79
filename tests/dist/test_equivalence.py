"""Training on a dp x cp grid equals single-rank training on the same global batches.

Each configuration runs as real gloo ranks (spawned processes, FileStore rendezvous) through the
same Trainer the Ray workers use; the reference is dp=1, cp=1. Per-step losses and pre-clip
gradient norms must agree within 1e-4 relative and the final parameters within a small absolute
tolerance.

The gradient norms are what see a gradient-scale error (a CP loss summed instead of averaged,
say): AdamW divides out any constant factor on the gradient, and at this size clipping fires on
every step, so losses and parameters alone would not show it. The SGD case, a ZeRO-0 grid
without clipping, makes such an error show in the trajectory too.
"""

from __future__ import annotations

import multiprocessing as mp
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import pytest

from ringtrain_dev.ranks import gloo_rank, run_ranks
from ringtrain_dev.tiny import TINY_MODEL

pytestmark = [pytest.mark.dist, pytest.mark.slow]

STEPS = 5
TINY = [
    *TINY_MODEL,
    "data.seq_len=64",
    "train.global_batch=4",
    f"train.steps={STEPS}",
    "train.warmup_steps=2",
    "train.lr=3e-3",
]
SINGLE = ["mesh.dp=1", "mesh.cp=1", "zero.stage=0"]

# AdamW's update lr * m / (sqrt(v) + eps) ignores the gradient's scale unless eps dominates
# sqrt(v): with an eps far above every gradient element, beta1=0, no weight decay and no clipping
# it is plain SGD at rate lr / eps, whose parameters move with the gradient itself. The config
# has no key for eps (production never wants this), so the ranks set it on the optimizer.
SGD_EPS, SGD_RATE = 1e3, 0.1  # a rate at which this model still trains in STEPS steps
SGD = ["train.grad_clip=0", "train.beta1=0", "train.weight_decay=0", f"train.lr={SGD_RATE * SGD_EPS:g}"]

Run = tuple[list[str], Optional[float]]  # config overrides, AdamW eps (None: the engine's)


@dataclass
class Trace:
    losses: list[float]
    grad_norms: list[float]  # pre-clip, as StepReport carries them
    params: dict[str, np.ndarray]


def _rank_main(rank: int, world: int, store_path: str, runs: list[Run], results: mp.Queue) -> None:
    import torch

    from ringtrain import config
    from ringtrain.train.trainer import Trainer

    with gloo_rank(rank, world, store_path, results):
        traces = []
        for overrides, eps in runs:  # one process for several runs: spawning one costs seconds
            trainer = Trainer(config.load(None, overrides), rank=rank, device=torch.device("cpu"))
            if eps is not None:
                optimizer = trainer.engine.optimizer
                for group in getattr(optimizer, "optimizer", optimizer).param_groups:
                    group["eps"] = eps
            reports = [trainer.train_step() for _ in range(STEPS)]
            params = {k: v.numpy() for k, v in trainer.parameters_fp32().items()}
            traces.append(Trace([r.loss for r in reports], [r.grad_norm for r in reports], params))
        if rank == 0:
            results.put(traces)


def train(runs: list[Run], tmp_path: Path) -> list[Trace]:
    from ringtrain import config

    return run_ranks(_rank_main, config.load(None, runs[0][0]).world_size, tmp_path, runs)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Trace]:
    adamw, sgd = train([(TINY + SINGLE, None), (TINY + SGD + SINGLE, SGD_EPS)], tmp_path_factory.mktemp("ref"))
    return {"adamw": adamw, "sgd": sgd}


def assert_matches(trace: Trace, ref: Trace) -> None:
    assert len(trace.losses) == STEPS
    assert ref.losses[-1] < ref.losses[0], "the reference must actually train for the comparison to mean much"
    np.testing.assert_allclose(trace.losses, ref.losses, rtol=1e-4, atol=0, err_msg="losses")
    assert np.isfinite(ref.grad_norms).all(), f"reference gradient norms {ref.grad_norms}"
    assert np.isfinite(trace.grad_norms).all(), f"gradient norms {trace.grad_norms}"
    np.testing.assert_allclose(trace.grad_norms, ref.grad_norms, rtol=1e-4, atol=0, err_msg="pre-clip gradient norms")
    assert trace.params.keys() == ref.params.keys()
    for name, value in ref.params.items():
        np.testing.assert_allclose(trace.params[name], value, rtol=0, atol=5e-5, err_msg=name)


MESHES = {
    "ring-zero1": ["mesh.dp=2", "mesh.cp=2", "attention.impl=ring", "zero.stage=1"],
    "ring-zero2": ["mesh.dp=2", "mesh.cp=2", "attention.impl=ring", "zero.stage=2"],
    "ring-zero3": ["mesh.dp=2", "mesh.cp=2", "attention.impl=ring", "zero.stage=3"],
    "ulysses-zero2": ["mesh.dp=2", "mesh.cp=2", "attention.impl=ulysses", "zero.stage=2"],
    "hybrid-zero3": ["mesh.dp=1", "mesh.cp=4", "mesh.ulysses=2", "attention.impl=hybrid", "zero.stage=3"],
}


@pytest.mark.parametrize("mesh", MESHES.values(), ids=MESHES.keys())
def test_grid_matches_single_rank(mesh: list[str], reference: dict[str, Trace], tmp_path: Path) -> None:
    (trace,) = train([(TINY + mesh, None)], tmp_path)
    assert_matches(trace, reference["adamw"])


def test_sgd_grid_matches_single_rank_at_zero0(reference: dict[str, Trace], tmp_path: Path) -> None:
    """ZeRO-0 on a grid, with an update that follows the gradient's scale."""
    grid = ["mesh.dp=2", "mesh.cp=2", "attention.impl=ring", "zero.stage=0"]
    (trace,) = train([(TINY + SGD + grid, SGD_EPS)], tmp_path)
    assert_matches(trace, reference["sgd"])
