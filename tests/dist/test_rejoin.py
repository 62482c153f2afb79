"""Survivors keep their processes: leaving a world and joining a smaller one, in the same
processes, resharding ZeRO-3 state online from snapshots, continues the uninterrupted run.

Four gloo ranks (dp 2 x cp 2) train STEPS steps and keep the snapshot of step CUT. Then ranks 2
and 3 leave for good; ranks 0 and 1 leave the world too (its process groups destroyed, as after
a failure), form a new one of dp 1 x cp 2 in the same processes, restore step CUT from the four
shards, and train the remaining steps: the losses must be the uninterrupted run's, up to the
order of the gradient reductions, which the dp change alters.
"""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

import numpy as np
import pytest

from ringtrain_dev.ranks import run_ranks
from tests.dist.test_snapshot_restore import CUT, STEPS, TINY

pytestmark = [pytest.mark.dist, pytest.mark.slow]

JOB = [*TINY, "mesh.cp=2", "zero.stage=3"]


def _rank_main(rank: int, world: int, store_path: str, results: mp.Queue) -> None:
    import torch
    import torch.distributed as dist

    from ringtrain import config
    from ringtrain.train.trainer import Trainer, set_rank_env

    torch.set_num_threads(1)
    device = torch.device("cpu")
    try:
        set_rank_env(rank=rank, world_size=world, device=device)
        dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
        trainer = Trainer(config.load(None, [*JOB, "mesh.dp=2"]), rank=rank, device=device)
        reference, shard = [], b""
        while trainer.step < STEPS:
            reference.append(trainer.train_step().loss)
            if trainer.step == CUT:
                shard = bytes(trainer.snapshot(CUT).blob)
        shards: list[bytes] = [b""] * world
        dist.all_gather_object(shards, shard)
        trainer.close()  # leaves the world: snapshots and process groups go
        if rank >= 2:
            return

        set_rank_env(rank=rank, world_size=2, device=device)
        dist.init_process_group("gloo", store=dist.FileStore(store_path + "-2", 2), rank=rank, world_size=2)
        smaller = Trainer(config.load(None, [*JOB, "mesh.dp=1"]), rank=rank, device=device)
        assert smaller.restore(shards) == CUT
        resumed = [smaller.train_step().loss for _ in range(CUT, STEPS)]
        smaller.close()
        if rank == 0:
            results.put((reference, resumed))
    except BaseException as exc:  # noqa: BLE001 - any failure must reach the test
        results.put(exc)


def test_survivors_rejoin_a_smaller_world_in_the_same_processes_at_zero3(tmp_path: Path) -> None:
    reference, resumed = run_ranks(_rank_main, 4, tmp_path)
    np.testing.assert_allclose(resumed, reference[CUT:], rtol=1e-5)
