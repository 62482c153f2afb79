"""TrainWorker: one rank on one device; a plain class, made a Ray actor where it is spawned."""

from __future__ import annotations

import os
import socket
from typing import TYPE_CHECKING, Any, Optional, Sequence

from ringtrain.config import JobConfig
from ringtrain.status import StepReport, WorkerInfo

if TYPE_CHECKING:
    from ringtrain.train.snapshot import Snapshot


class TrainWorker:
    """Owns one device, joins the job's process group, and trains one step per call.

    Construction is cheap (no torch import), so a failed placement costs nothing; the heavy
    work happens in ``setup``, which all ranks call together because it is collective.
    """

    def __init__(self, job: JobConfig, rank: int, device_type: str) -> None:
        self.job = job
        self.rank = rank
        self.device_type = device_type
        self._store: Any = None  # rank 0's rendezvous store, kept alive for the job
        self._trainer: Any = None

    def info(self) -> WorkerInfo:
        return WorkerInfo(
            rank=self.rank,
            host=_node_ip(),
            pid=os.getpid(),
            device=self.device_type,
            node_id=_node_id(),
            device_name=_device_name(self.device_type),
        )

    def create_store(self) -> tuple[str, int]:
        """Rank 0 only: open the rendezvous store on a free port and say where it is."""
        from ringtrain.train.mesh import create_store

        host = _node_ip()
        self._store, port = create_store(host, self.job.world_size, self.job.controllers.start_timeout_s)
        return host, port

    def setup(self, host: str, port: int, holders: Sequence[Any] = ()) -> int:
        """Join the process group and build model, engine and data; returns the parameter count.

        ``holders`` are the SnapshotHolder actors every snapshot of this rank is handed to.
        """
        import torch

        from ringtrain.train.mesh import init_process_group
        from ringtrain.train.model import num_params
        from ringtrain.train.trainer import Trainer, set_rank_env

        device = torch.device("cuda", 0) if self.device_type == "cuda" else torch.device("cpu")
        if device.type == "cpu":
            # Ray sets OMP_NUM_THREADS=1 only for actors with num_cpus < 1; be explicit either way.
            torch.set_num_threads(max(1, int(self.job.cluster.cpus_per_worker)))
        else:
            torch.cuda.set_device(device)
        set_rank_env(rank=self.rank, world_size=self.job.world_size, device=device)
        _quiet_deepspeed()
        init_process_group(
            backend="nccl" if device.type == "cuda" else "gloo",
            host=host,
            port=port,
            rank=self.rank,
            world_size=self.job.world_size,
            timeout_s=self.job.controllers.step_timeout_s,
        )
        self._trainer = Trainer(self.job, rank=self.rank, device=device, deliver=_HolderDelivery(holders))
        return num_params(self._trainer.model)

    def train_step(self) -> StepReport:
        assert self._trainer is not None, "setup() must run before train_step()"
        return self._trainer.train_step()

    def snapshot(self, step: int) -> tuple[bytes, str]:
        """This rank's snapshot of ``step`` and its checksum (waits if still being taken)."""
        assert self._trainer is not None
        snap = self._trainer.snapshot(step)
        return snap.blob, snap.checksum

    def restore(self, blobs: list[bytes]) -> int:
        """Load a snapshot (every rank's shard, any dp); returns the step to continue after."""
        assert self._trainer is not None
        return self._trainer.restore(blobs)

    def shutdown(self) -> None:
        if self._trainer is not None:
            self._trainer.close()
            self._trainer = None


class _HolderDelivery:
    """Hands each snapshot to the holders, at most one round in flight (runs on the snapshot
    thread, so waiting here never touches the training loop)."""

    def __init__(self, holders: Sequence[Any]) -> None:
        self.holders = list(holders)
        self._in_flight: list[Any] = []

    def __call__(self, snap: Snapshot) -> None:
        if not self.holders:
            return
        import ray

        if self._in_flight:
            ray.get(self._in_flight)
        # One copy into the object store for all holders; each keeps its own copy of the bytes,
        # so the worker's object going away with the worker loses nothing.
        blob = ray.put(snap.blob)
        self._in_flight = [h.put.remote(snap.rank, snap.step, snap.world_size, blob, snap.checksum) for h in self.holders]


def _device_name(device_type: str) -> str:
    if device_type != "cuda":
        return "cpu"
    import torch

    return str(torch.cuda.get_device_name(0))


def _node_id() -> str:
    try:
        import ray

        return str(ray.get_runtime_context().get_node_id())
    except Exception:
        return ""


def _node_ip() -> str:
    try:
        import ray

        return str(ray.util.get_node_ip_address())
    except Exception:  # outside Ray (tests that use the class as a plain object)
        return socket.gethostbyname(socket.gethostname())


def _quiet_deepspeed(level: Optional[int] = None) -> None:
    import logging

    from deepspeed.utils import logger

    logger.setLevel(level or logging.WARNING)
