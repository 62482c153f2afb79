"""The NCCL path, checked on CPU: which survivors get an abort after a stall's culprit is
evicted, what a worker's ``abort`` calls (mocks stand in for NCCL), and the workers' env."""

from __future__ import annotations

import os
import time
import warnings
from typing import Any

import pytest

from ringtrain.actors.worker import TrainWorker, process_env
from ringtrain.policies.faults import abort_survivors
from ringtrain.train import mesh


def test_on_cuda_every_survivor_still_in_the_step_is_aborted() -> None:
    assert abort_survivors(device="cuda", pending=[3, 0, 2], evicted=(2,)) == (0, 3)
    # gloo: the killed culprit's sockets close with it, its peers fail at once.
    assert abort_survivors(device="cpu", pending=[0, 3], evicted=(2,)) == ()


class _Group:
    """A process group whose abort takes ``seconds`` (NCCL's waits for its proxy thread)."""

    def __init__(self, name: str, log: list[str], seconds: float = 0.0) -> None:
        self.name, self.log, self.seconds = name, log, seconds

    def abort(self) -> None:
        time.sleep(self.seconds)
        self.log.append(self.name)


def _world(monkeypatch: pytest.MonkeyPatch, groups: list[_Group]) -> None:
    monkeypatch.setattr(mesh.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(mesh.c10d, "_world", type("World", (), {"pg_map": {g: None for g in groups}})())


def test_a_cuda_worker_aborts_its_process_groups_and_keeps_its_trainer(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    _world(monkeypatch, [_Group("world", calls)])
    monkeypatch.setattr(mesh.c10d, "_abort_process_group", lambda: calls.append("helper"), raising=False)
    worker = TrainWorker.__new__(TrainWorker)
    trainer = object()
    worker.device_type, worker._trainer, worker._connections = "cuda", trainer, {}
    # Every group's own abort first, then torch's helper for its bookkeeping.
    assert worker.abort() == "_abort_process_group" and calls == ["world", "helper"]
    assert worker._trainer is trainer  # its snapshots stay readable for the recovery


def test_without_the_helper_each_group_is_aborted(monkeypatch: pytest.MonkeyPatch) -> None:
    aborted: list[str] = []
    _world(monkeypatch, [_Group("world", aborted), _Group("ring", aborted)])
    monkeypatch.delattr(mesh.c10d, "_abort_process_group", raising=False)
    assert mesh.abort_all() == "abort" and sorted(aborted) == ["ring", "world"]


def test_groups_are_aborted_at_once_not_one_after_another(monkeypatch: pytest.MonkeyPatch) -> None:
    """Seven groups whose aborts take 0.2 s each (NCCL's take up to 1 s) are done in about one."""
    aborted: list[str] = []
    _world(monkeypatch, [_Group(f"g{i}", aborted, seconds=0.2) for i in range(7)])
    monkeypatch.delattr(mesh.c10d, "_abort_process_group", raising=False)
    started = time.perf_counter()
    mesh.abort_all()
    assert len(aborted) == 7 and time.perf_counter() - started < 0.2 * 3


def test_a_failed_abort_is_raised_after_every_group_had_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    aborted: list[str] = []

    class _Failing(_Group):
        def abort(self) -> None:
            raise RuntimeError("NCCL error")

    _world(monkeypatch, [_Failing("bad", aborted), _Group("good", aborted)])
    with pytest.raises(RuntimeError, match="NCCL error"):
        mesh.abort_all()
    assert aborted == ["good"]


def test_a_worker_outside_any_world_does_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    worker: Any = TrainWorker.__new__(TrainWorker)
    worker.device_type, worker._trainer = "cuda", None
    assert worker.abort() == ""
    monkeypatch.setattr(mesh.dist, "is_initialized", lambda: False)
    assert mesh.abort_all() == ""


def test_cuda_workers_keep_running_after_a_failed_nccl_collective() -> None:
    assert process_env("cuda")["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2"
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in process_env("cpu")


def test_a_worker_in_its_own_process_sets_that_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    # Ray starts workers with no runtime_env (to reuse its prestarted processes): the worker
    # itself must set what process_env says, before DeepSpeed or NCCL read it.
    from ringtrain import config

    monkeypatch.setattr(os, "environ", dict(os.environ, DS_ACCELERATOR="cpu"))
    with warnings.catch_warnings():
        TrainWorker(config.load(None, []), -1, "cuda", own_process=True)
        assert warnings.filters[0][0] == "ignore"
    assert {k: os.environ[k] for k in process_env("cuda")} == process_env("cuda")

