"""A survivor's side of the NCCL abort, on one GPU.

After evicting a stalled rank the controller has every survivor abort its process groups
(``TrainWorker.abort`` -> ``mesh.abort_all``), and a join that finds a world never left aborts it
too (``_leave_default_group``). Either way the process must come out whole: its trainer and
in-memory snapshots still readable, no default group left behind, and a new NCCL world joined in
the same process, trained on from its own snapshot exactly as an uninterrupted run.

A collective blocked on a dead peer needs two GPUs (NCCL refuses two ranks on one device); the
time such a survivor takes to leave it is measured where a machine has them. One GPU shows what
the abort leaves behind.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ringtrain_dev.ranks import run_ranks

from .support import MARKS
from .test_trainer_gpu import CUT, STEPS, TINY

pytestmark = [*MARKS, pytest.mark.slow]

ABORT_WITHIN_S = 1.0


def _rank_main(rank: int, world: int, store_path: str, abort: bool, results: mp.Queue) -> None:
    from ringtrain.actors.worker import _leave_default_group, process_env

    os.environ.update(process_env("cuda"))  # as a worker process runs: NCCL's error handling too

    import torch
    import torch.distributed as dist

    from ringtrain import config
    from ringtrain.train import mesh
    from ringtrain.train.trainer import Trainer, set_rank_env

    def join(store: str) -> Trainer:
        set_rank_env(rank=rank, world_size=world, device=device)
        dist.init_process_group("nccl", store=dist.FileStore(store, world), rank=rank, world_size=world, device_id=device)
        return Trainer(config.load(None, TINY), rank=rank, device=device)

    try:
        device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
        trainer = join(store_path)
        out: dict[str, Any] = {"losses": []}
        while trainer.step < (CUT + 1 if abort else STEPS):
            out["losses"].append(trainer.train_step().loss)
        if abort:
            kept = trainer.snapshot(CUT).blob
            started = time.perf_counter()
            out["how"] = mesh.abort_all()  # what a survivor does when the controller asks
            out["abort_s"] = time.perf_counter() - started
            out["left_world"] = not dist.is_initialized()
            out["snapshot_kept"] = trainer.snapshot(CUT).blob == kept
            trainer.close()  # the next join's leave(): nothing left to destroy
            trainer = join(store_path + ".second")
            assert trainer.restore([kept]) == CUT
            out["before_abort"] = out["losses"]
            out["losses"] = out["losses"][:CUT]  # the step after the cut is trained again
            while trainer.step < STEPS:
                out["losses"].append(trainer.train_step().loss)
            # A join that finds this world never left aborts it, and joins the next one.
            started = time.perf_counter()
            _leave_default_group("cuda", {})
            out["cleanup_s"] = time.perf_counter() - started
            out["cleanup_left_world"] = not dist.is_initialized()
            set_rank_env(rank=rank, world_size=world, device=device)
            dist.init_process_group("nccl", store=dist.FileStore(store_path + ".third", world), rank=rank, world_size=world, device_id=device)
            x = torch.ones(8, device=device)
            dist.all_reduce(x)
            out["third_world"] = x.tolist()
        trainer.close()
        if dist.is_initialized():
            dist.destroy_process_group()
        results.put(out)
    except BaseException as exc:  # noqa: BLE001 - any failure must reach the test
        results.put(exc)
        raise


def test_a_survivor_aborts_keeps_its_snapshot_and_trains_on_in_a_new_world(tmp_path: Path) -> None:
    reference = run_ranks(_rank_main, 1, tmp_path, False)
    survivor = run_ranks(_rank_main, 1, tmp_path, True)

    assert survivor["how"] == "_abort_process_group" and survivor["left_world"], survivor
    assert survivor["abort_s"] < ABORT_WITHIN_S, survivor["abort_s"]
    assert survivor["snapshot_kept"], "the abort changed the survivor's in-memory snapshot"
    # From its own snapshot the survivor trains on: the step after the cut, trained again, is
    # the same arithmetic on the same bits as before the abort; the run as a whole follows the
    # uninterrupted one within the run-to-run variation of bf16 backward passes.
    assert survivor["losses"][CUT] == survivor["before_abort"][CUT], (survivor["losses"], survivor["before_abort"])
    assert len(survivor["losses"]) == len(reference["losses"]) == STEPS
    np.testing.assert_allclose(survivor["losses"], reference["losses"], rtol=2e-3)

    assert survivor["cleanup_left_world"] and survivor["cleanup_s"] < ABORT_WITHIN_S, survivor
    assert survivor["third_world"] == [1.0] * 8
