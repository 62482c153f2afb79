"""The longest sequence one device trains, as the planner sees it: the layout it picks at a length,
how far a fixed recipe reaches, and which memory limit stops a layout.

``search.max_seq_len`` answers "how long, at most" per saver rung. A measurement that walks the
lengths around that answer needs three more things from the same memory model, kept here so the
bench that measures them holds no planning logic of its own:

- ``pick``: the layout ``ringtrain plan --seq-len`` puts first at a length (the fastest that fits);
  past the planner's reach, where nothing fits, the leanest layout there (the reach's own rung with
  its MLP tiles re-chosen for the length), so that a try above the prediction still runs the
  savers the planner would reach for.
- ``recipe_reach``: the longest sequence one fixed layout fits, e.g. full checkpointing without
  savers, the recipe a stack without ringtrain's savers trains with (search's own, with which
  ``max_seq_len`` reaches each rung).
- ``binding_limit``: whether a layout's device memory, its host memory or both are out of reach.

``device_seen`` is the device table's entry for the device at hand with the memory it reports
(and its host's), so the prediction is for the machine measured, not the datasheet's.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from ringtrain.planner.devices import DEVICES, H100, Device, peak_flops
from ringtrain.planner.layout import Layout, Workload
from ringtrain.planner.memory import MemoryEstimate
# Search's reach of one layout (its rungs' for max_seq_len), named here with the rest a measurement asks.
from ringtrain.planner.search import MAX_TOKENS, Candidate, Cluster, Reach, at_length, max_seq_len, recipe_reach, search
from ringtrain.planner.throughput import Assumptions

DEVICE, HOST = "device", "host"


def device_seen(reported_name: str, memory_bytes: int, host_memory_bytes: int, *, cpu_cores: int = 1) -> Device:
    """The device table's entry for a device as torch names it ("NVIDIA H100 80GB HBM3", or "cpu"
    for a CPU standing in for a GPU under a memory cap) with ``memory_bytes`` of device memory and
    ``host_memory_bytes`` of host memory. An unknown GPU takes the H100's speeds (the table's
    reference); a CPU its nominal peak FLOP/s, so step times stay estimates of the machine at hand."""
    lowered = reported_name.lower()
    base = next((spec for key, spec in DEVICES.items() if key in lowered), H100)
    flops = peak_flops(reported_name, cpu_cores=cpu_cores) if lowered.startswith("cpu") else base.peak_flops
    return dataclasses.replace(
        base, name=reported_name, memory_bytes=memory_bytes, host_memory_bytes=host_memory_bytes, peak_flops=flops
    )


def longest(workload: Workload, cluster: Cluster, assume: Assumptions) -> Optional[Reach]:
    """The planner's longest sequence on ``cluster`` over every layout and saver rung (the first
    line of ``ringtrain plan --max-seq-len``), or None when not even one unit fits."""
    reaches = max_seq_len(workload, cluster, assume)
    return reaches[0] if reaches else None


def pick(
    workload: Workload, cluster: Cluster, assume: Assumptions, seq_len: int, *, leanest: Optional[Layout] = None
) -> Candidate:
    """The layout the planner trains ``seq_len`` with: the best fitting one of ``search``; where
    none fits, ``leanest`` (the reach's layout) at this length, else the smallest of ``search``."""
    ranked = search(dataclasses.replace(workload, seq_len=seq_len), cluster, assume)
    if ranked and ranked[0].fits:
        return ranked[0]
    if leanest is not None:
        return at_length(workload, leanest, seq_len, cluster, assume)
    if not ranked:
        raise ValueError(f"no valid layout of {cluster.gpus} GPUs at seq_len {seq_len}")
    return min(ranked, key=lambda c: c.memory.total)


def binding_limit(memory: MemoryEstimate, cluster: Cluster) -> tuple[str, ...]:
    """The limits ``memory`` exceeds on ``cluster``: ``DEVICE`` (the usable GPU memory), ``HOST``
    (the node's host memory, for offloaded state and activations), both, or none (it fits)."""
    over: list[str] = []
    if memory.total > cluster.usable_bytes:
        over.append(DEVICE)
    if memory.host * min(cluster.gpus, cluster.gpus_per_node) > cluster.device.host_memory_bytes:
        over.append(HOST)
    return tuple(over)
