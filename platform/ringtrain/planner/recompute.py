"""How much a job recomputes when it says ``model.activation_checkpointing=auto``: the least that fits.

Recomputation buys activation memory with compute: ``selective`` reruns the norms and the MLP
in the backward (about a sixth of a step at 32K tokens for a Llama), ``full`` a whole forward
(about a third). Where the activations fit without it, both are pure loss; so ``auto`` takes the
first mode of ``LADDER`` whose predicted peak (planner/memory.py, for this job's layout and
savers) fits the device's memory less the planner's headroom, and ``full`` when none does.
"""

from __future__ import annotations

import dataclasses

from ringtrain.config import JobConfig, checkpointing_mode
from ringtrain.planner.layout import Layout, layout_of, workload_of
from ringtrain.planner.memory import estimate
from ringtrain.planner.search import Cluster

LADDER = ("none", "selective", "full")
AUTO = "auto"


def with_mode(layout: Layout, mode: str) -> Layout:
    return dataclasses.replace(layout, checkpointing=mode == "full", selective=mode == "selective")


def checkpointing_for(job: JobConfig, device_memory_bytes: int, *, headroom: float = Cluster.headroom) -> str:
    """The job's checkpointing mode on a device of ``device_memory_bytes``; a mode other than
    ``auto`` is the job's own. Pure: the caller reads the device's memory."""
    mode = checkpointing_mode(job.model.activation_checkpointing)
    if mode != AUTO:
        return mode
    workload = workload_of(job, "cuda")
    usable = device_memory_bytes * (1 - headroom)
    for candidate in LADDER:
        if estimate(workload, with_mode(layout_of(job), candidate)).total <= usable:
            return candidate
    return LADDER[-1]
