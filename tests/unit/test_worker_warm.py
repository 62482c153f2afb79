"""A warming worker arms torch's flight recorder before its rehearsal creates a process group.

torch reads the recorder's buffer size (``TORCH_FR_BUFFER_SIZE``, or the older NCCL-only name)
when a process group is created. ``warm`` rehearses one step in a world of one, the process's
first process group: armed after it, a spare that later takes a seat has no trace of its
collectives to show after a stall. The worker runs as a plain object with the rehearsal
replaced by a stand-in that records what it saw.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from ringtrain import config
from ringtrain.actors import worker as worker_module
from ringtrain.actors.worker import TrainWorker
from ringtrain.train import trainer as trainer_module

RECORDER_ENV = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")


@pytest.fixture
def worker(monkeypatch: pytest.MonkeyPatch) -> TrainWorker:
    for name in RECORDER_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(worker_module, "_quiet_deepspeed", lambda level=None: None)
    monkeypatch.setattr(worker_module, "_node_ip", lambda: "127.0.0.1")
    monkeypatch.setattr(worker_module, "_node_id", lambda: "node")
    spare = TrainWorker(config.load(None, []), -1, "cpu")
    # Not the real binding: it would set this test process's torch thread count.
    monkeypatch.setattr(spare, "_bind_device", lambda job: torch.device("cpu"))
    return spare


def test_recorder_armed_before_the_rehearsal(worker: TrainWorker, monkeypatch: pytest.MonkeyPatch) -> None:
    armed_at_warm_up: list[bool] = []

    def warm_up(job: Any, device: torch.device) -> None:
        armed_at_warm_up.append(any(name in os.environ for name in RECORDER_ENV))

    monkeypatch.setattr(trainer_module, "warm_up", warm_up)
    worker.warm(rehearse=True)
    assert armed_at_warm_up == [True]


def test_recorder_armed_without_a_rehearsal_too(worker: TrainWorker) -> None:
    worker.warm(rehearse=False)
    assert any(name in os.environ for name in RECORDER_ENV)
