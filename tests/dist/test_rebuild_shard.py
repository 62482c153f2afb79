"""Under ZeRO-0 a survivor writes a dead rank's snapshot shard from its own state, bit for bit
the shard that rank wrote; once an optimizer step ran since, it refuses."""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

import pytest

from ringtrain_dev.ranks import run_ranks

pytestmark = [pytest.mark.dist, pytest.mark.slow]

JOB = [
    "model.dim=32",
    "model.n_layers=1",
    "model.n_heads=2",
    "model.n_kv_heads=1",
    "data.seq_len=32",
    "train.global_batch=2",
    "train.steps=4",
    "mesh.dp=2",
    "mesh.cp=1",
    "zero.stage=0",
]


def _rank_main(rank: int, world: int, store_path: str, results: mp.Queue) -> None:
    import torch
    import torch.distributed as dist

    from ringtrain import config
    from ringtrain.actors.worker import TrainWorker
    from ringtrain.train.trainer import Trainer, set_rank_env

    torch.set_num_threads(1)
    device = torch.device("cpu")
    set_rank_env(rank=rank, world_size=world, device=device)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    try:
        job = config.load(None, JOB)
        worker = TrainWorker(job, rank, "cpu")
        worker._trainer = Trainer(job, rank=rank, device=device)
        for _ in range(2):
            worker._trainer.train_step()
        own = worker.snapshot_blob(2)
        shards: list[bytes] = [b""] * world
        dist.all_gather_object(shards, own)
        found = (worker.rebuildable(), worker.rebuild_shard(1 - rank, 2) == shards[1 - rank])
        worker._trainer.snapshotter.wait()
        worker._trainer.train_step()  # an optimizer step: the live state is step 3's now
        worker._trainer.snapshotter.forget_after(2)  # as if step 3's snapshot never finished
        moved_on = worker.rebuildable()
        if rank == 0:
            results.put((found, moved_on))
        worker._trainer.close()
    except BaseException as exc:
        results.put(exc)
        raise


def test_a_survivor_rebuilds_a_dead_ranks_shard_exactly_under_zero0(tmp_path: Path) -> None:
    (rebuildable, equal), moved_on = run_ranks(_rank_main, 2, tmp_path)
    assert rebuildable == (2, 2) and equal
    assert moved_on is None
