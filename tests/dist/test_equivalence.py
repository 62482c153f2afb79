"""Training on a dp x cp grid equals single-rank training on the same global batches.

Each configuration runs as real gloo ranks (spawned processes, FileStore rendezvous) through the
same Trainer the Ray workers use; the reference is dp=1, cp=1. Per-step losses must agree
within 1e-4 relative and the final parameters within a small absolute tolerance.
"""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

import numpy as np
import pytest

from .ranks import run_ranks

pytestmark = [pytest.mark.dist, pytest.mark.slow]

STEPS = 5
TINY = [
    "model.dim=64",
    "model.n_layers=2",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "data.seq_len=64",
    "train.global_batch=4",
    f"train.steps={STEPS}",
    "train.warmup_steps=2",
    "train.lr=3e-3",
]


def _rank_main(rank: int, world: int, store_path: str, overrides: list[str], results: mp.Queue) -> None:
    import torch
    import torch.distributed as dist

    from ringtrain import config
    from ringtrain.train.trainer import Trainer, set_rank_env

    torch.set_num_threads(1)
    device = torch.device("cpu")
    set_rank_env(rank=rank, world_size=world, device=device)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    try:
        trainer = Trainer(config.load(None, overrides), rank=rank, device=device)
        losses = [trainer.train_step().loss for _ in range(STEPS)]
        params = {k: v.numpy() for k, v in trainer.parameters_fp32().items()}
        if rank == 0:
            results.put((losses, params))
    except BaseException as exc:  # surface the rank's failure instead of a queue timeout
        results.put(exc)
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def train(overrides: list[str], tmp_path: Path) -> tuple[list[float], dict[str, np.ndarray]]:
    from ringtrain import config

    return run_ranks(_rank_main, config.load(None, overrides).world_size, tmp_path, overrides)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[float], dict[str, np.ndarray]]:
    return train(TINY + ["mesh.dp=1", "mesh.cp=1", "zero.stage=0"], tmp_path_factory.mktemp("ref"))


MESHES = {
    "ring-zero1": ["mesh.dp=2", "mesh.cp=2", "attention.impl=ring", "zero.stage=1"],
    "ring-zero2": ["mesh.dp=2", "mesh.cp=2", "attention.impl=ring", "zero.stage=2"],
    "ring-zero3": ["mesh.dp=2", "mesh.cp=2", "attention.impl=ring", "zero.stage=3"],
    "ulysses-zero2": ["mesh.dp=2", "mesh.cp=2", "attention.impl=ulysses", "zero.stage=2"],
    "hybrid-zero3": ["mesh.dp=1", "mesh.cp=4", "mesh.ulysses=2", "attention.impl=hybrid", "zero.stage=3"],
}


@pytest.mark.parametrize("mesh", MESHES.values(), ids=MESHES.keys())
def test_grid_matches_single_rank(mesh: list[str], reference, tmp_path: Path) -> None:
    ref_losses, ref_params = reference
    losses, params = train(TINY + mesh, tmp_path)

    assert len(losses) == STEPS
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-4, atol=0)
    assert ref_losses[-1] < ref_losses[0], "the reference must actually train for the comparison to mean much"
    assert params.keys() == ref_params.keys()
    for name, ref in ref_params.items():
        np.testing.assert_allclose(params[name], ref, rtol=0, atol=5e-5, err_msg=name)
