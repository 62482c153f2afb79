"""Connecting to Ray: join a given cluster, or start an embedded one and stop it afterwards.

An embedded cluster is started with ``address="local"``, never ``ray.init()`` with no address:
the latter joins whatever cluster was last started on the machine, someone else's included.
What ringtrain starts it stops itself, through ``ray.shutdown()`` (which ends the processes the
driver started); it never runs ``ray stop``, which would end every Ray process on the host.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import Optional

from ringtrain.config import JobConfig
from ringtrain.errors import CapacityError, ClusterError

log = logging.getLogger(__name__)


@dataclass
class ClusterHandle:
    address: str
    embedded: bool
    temp_dir: Optional[str]

    def close(self, *, keep_logs: bool = False) -> None:
        """Disconnect; an embedded cluster's processes end, and its temp dir goes unless kept."""
        import ray

        if ray.is_initialized():
            ray.shutdown()
        if self.temp_dir and not keep_logs:
            shutil.rmtree(self.temp_dir, ignore_errors=True)


def connect(job: JobConfig) -> ClusterHandle:
    import ray

    address = job.cluster.address or os.environ.get("RAY_ADDRESS")
    try:
        if address:
            ray.init(address=address, log_to_driver=False, logging_level=logging.WARNING)
            return ClusterHandle(address=address, embedded=False, temp_dir=None)
        # Short path: Ray's unix sockets live under it and must stay below 107 characters.
        # RAY_TMPDIR is Ray's own variable for where its temp dirs go.
        temp_dir = tempfile.mkdtemp(prefix="rt-", dir=os.environ.get("RAY_TMPDIR", "/tmp"))
        ray.init(
            address="local",
            num_cpus=job.cluster.num_cpus or os.cpu_count() or 1,
            include_dashboard=False,
            log_to_driver=False,
            _metrics_export_port=job.telemetry.metrics_port,
            logging_level=logging.WARNING,
            _temp_dir=temp_dir,
        )
        return ClusterHandle(address="local", embedded=True, temp_dir=temp_dir)
    except ConnectionError as exc:
        raise ClusterError(f"cannot reach the Ray cluster at {address}: {exc}") from None


def resolve_device(job: JobConfig) -> str:
    """'cuda' or 'cpu': what the workers will run on, given the config and the cluster."""
    import ray

    if job.cluster.device != "auto":
        return job.cluster.device
    return "cuda" if ray.cluster_resources().get("GPU", 0) > 0 else "cpu"


def worker_resources(job: JobConfig, device: str) -> dict[str, float]:
    res = {"CPU": job.cluster.cpus_per_worker}
    if device == "cuda":
        res["GPU"] = job.cluster.gpus_per_worker
    return res


def check_capacity(job: JobConfig, device: str) -> None:
    """Refuse a mesh the cluster can never place, naming the keys to change."""
    import ray

    total = ray.cluster_resources()
    for resource, per_worker in worker_resources(job, device).items():
        workers = job.world_size + job.mesh.spares
        need = per_worker * workers
        have = total.get(resource, 0.0)
        if need > have:
            per_key = "cluster.gpus_per_worker" if resource == "GPU" else "cluster.cpus_per_worker"
            keys, values = "mesh.dp x mesh.cp", f"{job.mesh.dp} x {job.mesh.cp}"
            if job.mesh.spares:
                keys, values = f"{keys} + mesh.spares", f"{values} + {job.mesh.spares}"
            raise CapacityError(
                "mesh.dp",
                f"{keys} = {values} = {workers} workers need "
                f"{need:g} {resource} ({per_key}={per_worker:g}) but the cluster has {have:g}",
            )
