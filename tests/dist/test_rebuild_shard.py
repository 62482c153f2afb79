"""Under ZeRO-0 a survivor writes a dead rank's snapshot shard from its own state, bit for bit
the shard that rank wrote; once an optimizer step ran since, it refuses."""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

import pytest

from ringtrain_dev.ranks import gloo_rank, run_ranks
from ringtrain_dev.tiny import TINIEST_MODEL

pytestmark = [pytest.mark.dist, pytest.mark.slow]

JOB = [*TINIEST_MODEL, "data.seq_len=32", "train.global_batch=2", "train.steps=4", "mesh.dp=2", "mesh.cp=1", "zero.stage=0"]


def _rank_main(rank: int, world: int, store_path: str, results: mp.Queue) -> None:
    import torch
    import torch.distributed as dist

    from ringtrain import config
    from ringtrain.actors.worker import TrainWorker
    from ringtrain.train.trainer import Trainer

    with gloo_rank(rank, world, store_path, results):
        job = config.load(None, JOB)
        worker = TrainWorker(job, rank, "cpu")
        worker._trainer = Trainer(job, rank=rank, device=torch.device("cpu"))
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


def test_a_survivor_rebuilds_a_dead_ranks_shard_exactly_under_zero0(tmp_path: Path) -> None:
    (rebuildable, equal), moved_on = run_ranks(_rank_main, 2, tmp_path)
    assert rebuildable == (2, 2) and equal
    assert moved_on is None
