"""Ray placement on a multi-GPU machine: every worker binds a GPU of its own.

A worker takes the device Ray assigned it (``ray.get_gpu_ids()`` read against
CUDA_VISIBLE_DEVICES), not ``cuda:0``. Ray usually hides the other GPUs from an actor, which
would make ``cuda:0`` right by accident; with RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES set it
does not, and then only the mapping keeps two workers off one device. Both ways are run, each on
a fresh embedded cluster with one worker per GPU: each worker reports the UUID of the device it
bound, and a job trains two steps over NCCL (which refuses two ranks on one GPU).

Skipped with fewer than two GPUs; reported as not run, naming Ray, where Ray is not installed
(an air-gapped node's Python carries none: see support.needs_module).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from ringtrain import config

from .support import MARKS, needs_module

NUM_GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
NOSET = "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"

pytestmark = [
    *MARKS,
    needs_module("ray", "ray", "Ray"),  # before the GPU count: a node without Ray says so first
    pytest.mark.slow,
    pytest.mark.skipif(NUM_GPUS < 2, reason=f"needs 2 GPUs or more, this machine has {NUM_GPUS}"),
]

JOB = [
    "model.dim=128",
    "model.n_layers=2",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "data.seq_len=256",
    "train.steps=2",
    "cluster.device=cuda",
    "cluster.gpus_per_worker=1",
    "cluster.cpus_per_worker=1",
    "controllers.start_timeout_s=300",
]


@pytest.fixture(params=[False, True], ids=["ray-hides-gpus", "noset-all-visible"])
def cluster(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[bool]:
    """An embedded Ray cluster with every GPU; with the parameter set, Ray leaves
    CUDA_VISIBLE_DEVICES alone in its workers (they inherit the variable from this driver)."""
    import ray

    noset: bool = request.param
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    if noset:
        monkeypatch.setenv(NOSET, "1")
    else:
        monkeypatch.delenv(NOSET, raising=False)
    temp_dir = tempfile.mkdtemp(prefix="rtg-", dir="/tmp")
    monkeypatch.setenv("RAY_TMPDIR", temp_dir)
    try:
        ray.init(
            address="local",
            num_cpus=NUM_GPUS + 2,
            num_gpus=NUM_GPUS,
            include_dashboard=False,
            log_to_driver=False,
            _temp_dir=temp_dir,
        )
        try:
            yield noset
        finally:
            ray.shutdown()
    finally:
        shutil.rmtree(temp_dir, ignore_errors=True)


def test_every_worker_binds_a_gpu_of_its_own(cluster: bool) -> None:
    import ray

    from ringtrain.actors.worker import TrainWorker

    class BoundDevice(TrainWorker):
        """A TrainWorker that also says which physical device it bound (defined here, so Ray
        ships it by value)."""

        def bound(self) -> dict[str, Any]:
            import torch as torch_

            device = self._bind_device(self.job)
            props = torch_.cuda.get_device_properties(device)
            return {
                "index": device.index,
                "current": torch_.cuda.current_device(),
                "uuid": str(getattr(props, "uuid", "") or getattr(props, "pci_bus_id", "")),
                "visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
                "num_visible": torch_.cuda.device_count(),
                "gpu_ids": [str(i) for i in ray.get_gpu_ids()],
            }

    job = config.load(None, [*JOB, f"mesh.dp={NUM_GPUS}"])
    actors = [ray.remote(BoundDevice).options(num_gpus=1, num_cpus=1).remote(job, -1, "cuda") for _ in range(NUM_GPUS)]
    try:
        seen = ray.get([a.bound.remote() for a in actors], timeout=300)
    finally:
        for actor in actors:
            ray.kill(actor)
    if cluster and all(s["num_visible"] == 1 for s in seen):
        pytest.skip(f"Ray narrowed CUDA_VISIBLE_DEVICES despite {NOSET}: the case cannot be made here")
    assert all(s["index"] == s["current"] for s in seen), seen
    assert all(s["uuid"] for s in seen), seen
    assert len({s["uuid"] for s in seen}) == NUM_GPUS, f"workers share a GPU: {seen}"
    assert len({tuple(s["gpu_ids"]) for s in seen}) == NUM_GPUS, seen


def test_a_job_with_one_rank_per_gpu_trains(cluster: bool) -> None:
    from ringtrain.actors.group import WorkerGroup

    job = config.load(None, [*JOB, f"mesh.dp={NUM_GPUS}", f"train.global_batch={NUM_GPUS}"])
    group = WorkerGroup(job, "cuda")
    try:
        group.start()
        assert len(group.infos) == NUM_GPUS
        for _ in range(2):
            reports = group.train_step().reports_or_raise()
            assert len(reports) == NUM_GPUS
            assert len({r.loss for r in reports}) == 1, [r.loss for r in reports]  # one world, one mean loss
    finally:
        group.shutdown()
