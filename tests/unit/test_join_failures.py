"""A join that fails leaves nothing behind.

A join whose process group formed but whose Trainer failed (DeepSpeed's broadcast meets
"Connection closed by peer" when a peer died) leaves that group, so the retry's join can form
another instead of failing with "trying to initialize the default process group twice". A
TrainWorker runs as a plain object in a one-rank gloo world (rank 0's TCPStore on port 0, this
process), with Trainer replaced by a stand-in.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.distributed as dist

from ringtrain import config
from ringtrain.actors import worker as worker_module
from ringtrain.actors.worker import TrainWorker
from ringtrain.train import collectives
from ringtrain.train import trainer as trainer_module
from ringtrain.train.mesh import create_store

# --- the worker leaves the group of a failed join ----------------------------------------------


class BrokenTrainer:
    """Fails as DeepSpeed's first broadcast does when a peer of the world died."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:10128")


class TinyTrainer:
    """Stands in for a Trainer built in the world joined; ``close`` leaves it, as the real one does."""

    def __init__(self, job: config.JobConfig, *, rank: int, device: torch.device, deliver: Any = None) -> None:
        assert dist.is_initialized() and dist.get_world_size() == 1
        self.model = torch.nn.Linear(2, 2)
        self.bad_device = None

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.fixture
def worker(monkeypatch: pytest.MonkeyPatch) -> Any:
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "DS_ACCELERATOR", "TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"):
        monkeypatch.setenv(name, "unset")  # join sets them: put back as they were after the test
        monkeypatch.delenv(name)
    monkeypatch.setattr(worker_module, "_quiet_deepspeed", lambda level=None: None)
    job = config.load(None, ["mesh.dp=1", "mesh.cp=1", "controllers.step_timeout_s=20"])
    w = TrainWorker(job, -1, "cpu")
    monkeypatch.setattr(w, "_bind_device", lambda job: torch.device("cpu"))  # keeps this process's threads
    assert not dist.is_initialized()
    yield w
    w.leave()
    if dist.is_initialized():
        dist.destroy_process_group()
    collectives.uninstall()


def join(w: TrainWorker) -> int:
    store, port = create_store("127.0.0.1", 1, 20.0)
    try:
        return w.join(w.job, 0, "127.0.0.1", port)
    finally:
        del store


def test_a_join_whose_trainer_fails_leaves_its_process_group(worker: TrainWorker, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(trainer_module, "Trainer", BrokenTrainer)
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        join(worker)
    assert not dist.is_initialized()  # the group it formed went with the failure
    # The retry's join forms a new world in the same process.
    monkeypatch.setattr(trainer_module, "Trainer", TinyTrainer)
    assert join(worker) == 6
    assert dist.is_initialized() and worker._trainer is not None


def test_a_join_leaves_a_default_group_left_behind(worker: TrainWorker, monkeypatch: pytest.MonkeyPatch) -> None:
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)  # as a join that died half-way left it
    monkeypatch.setattr(trainer_module, "Trainer", TinyTrainer)
    assert join(worker) == 6
    assert dist.get_world_size() == 1 and os.environ["RANK"] == "0"
