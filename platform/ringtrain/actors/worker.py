"""TrainWorker: one rank on one device; a plain class, made a Ray actor where it is spawned."""

from __future__ import annotations

import os
import socket
from typing import Any, Optional

from ringtrain.config import JobConfig
from ringtrain.status import StepReport, WorkerInfo


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
        return WorkerInfo(rank=self.rank, host=_node_ip(), pid=os.getpid(), device=self.device_type)

    def create_store(self) -> tuple[str, int]:
        """Rank 0 only: open the rendezvous store on a free port and say where it is."""
        from ringtrain.train.mesh import create_store

        host = _node_ip()
        self._store, port = create_store(host, self.job.world_size, self.job.controllers.start_timeout_s)
        return host, port

    def setup(self, host: str, port: int) -> int:
        """Join the process group and build model, engine and data; returns the parameter count."""
        import torch

        from ringtrain.train.mesh import init_process_group
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
        self._trainer = Trainer(self.job, rank=self.rank, device=device)
        return sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in self._trainer.model.parameters())

    def train_step(self) -> StepReport:
        assert self._trainer is not None, "setup() must run before train_step()"
        return self._trainer.train_step()

    def parameters(self) -> dict[str, Any]:
        """Full fp32 parameters as numpy arrays (collective under ZeRO-3: call on every rank)."""
        assert self._trainer is not None
        return {k: v.numpy() for k, v in self._trainer.parameters_fp32().items()}

    def shutdown(self) -> None:
        if self._trainer is not None:
            self._trainer.close()
            self._trainer = None


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
