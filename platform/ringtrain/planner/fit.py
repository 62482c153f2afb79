"""The pre-launch fit check: ``ringtrain run``'s warning when a job's layout is predicted not to fit."""

from __future__ import annotations

from typing import Optional

from ringtrain.config import JobConfig
from ringtrain.errors import ConfigError
from ringtrain.planner import devices
from ringtrain.planner.devices import GB
from ringtrain.planner.layout import layout_of, workload_of
from ringtrain.planner.search import MAX_GPUS, Cluster, evaluate, fewest_gpus, search
from ringtrain.planner.throughput import Assumptions


def fit_warning(job: JobConfig, device_type: str) -> Optional[str]:
    """A one-line warning when ``job``'s layout is predicted not to fit on ``device_type``, else None.

    ``device_type`` is "cpu" (host memory is not checked: None), "cuda" (an 80 GB H100 is
    assumed) or a GPU type of the device table.
    """
    if device_type == "cpu":
        return None
    try:
        device = devices.device(device_type, key="cluster.device")
    except ConfigError:
        device = devices.H100
    workload = workload_of(job, "cuda")
    cluster = Cluster(device, job.world_size)
    assume = Assumptions()
    mine = evaluate(workload, layout_of(job), cluster, assume)
    if mine.fits:
        return None
    m = mine.memory
    line = (
        f"ringtrain: warning: predicted peak {m.total / GB:.1f} GB per GPU exceeds the "
        f"{cluster.usable_bytes / GB:.1f} GB usable on an {device.memory_bytes / GB:.0f} GB {device.name} "
        f"(activations {m.activations / GB:.1f}, model states {m.model_states / GB:.1f}, "
        f"ZeRO buffers {m.zero_buffers / GB:.1f})"
    )
    host_per_node = m.host * min(cluster.gpus, cluster.gpus_per_node)
    if host_per_node > device.host_memory_bytes:
        line += f", host memory {host_per_node / GB:.0f} GB per node"
    ranked = search(workload, cluster, assume, micro_batch=job.train.micro_batch)
    if ranked and ranked[0].fits:
        return line + f"; predicted to fit: {' '.join(ranked[0].layout.overrides())}"
    more = fewest_gpus(workload, cluster, assume, micro_batch=job.train.micro_batch)
    if more is not None:
        return line + f"; no layout of {job.world_size} GPUs fits, {more.layout.world} would ({more.layout.describe()})"
    return line + f"; no layout fits on up to {MAX_GPUS} GPUs"
