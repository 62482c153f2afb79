"""How much a job recomputes when it says ``model.activation_checkpointing=auto``: the least that fits.

Recomputation buys activation memory with compute: ``selective`` reruns a layer's norms and MLP
in the backward (about a sixth of the layer's step at 32K tokens for a Llama), ``full`` its
whole forward (about a third). Where the activations fit without it, both are pure loss, and
where only some layers must recompute, the others need not: ``auto`` takes the first mode of
``LADDER`` and, within it, the fewest recomputing layers (the first ones; the rest keep
everything) whose predicted peak (planner/memory.py, for this job's layout and savers) fits the
device's memory less the planner's headroom; ``full`` for every layer when nothing does.

Selective comes before full: it frees about two thirds of what full does at half its cost per
layer, so recomputing more layers selectively beats recomputing fewer in full.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from ringtrain.config import JobConfig, checkpointing_mode
from ringtrain.planner.layout import Layout, layout_of, workload_of
from ringtrain.planner.memory import estimate
from ringtrain.planner.search import Cluster

LADDER = ("none", "selective", "full")
AUTO = "auto"


@dataclass(frozen=True)
class Recompute:
    """A checkpointing mode and how many layers (the first ones) run it; None: every layer."""

    mode: str
    layers: Optional[int] = None


def with_mode(layout: Layout, mode: str, layers: Optional[int] = None) -> Layout:
    return dataclasses.replace(
        layout, checkpointing=mode == "full", selective=mode == "selective", recompute_layers=layers
    )


def recompute_for(job: JobConfig, device_memory_bytes: int, *, headroom: float = Cluster.headroom) -> Recompute:
    """The job's recomputation on a device of ``device_memory_bytes``; a mode other than ``auto``
    is the job's own. Pure: the caller reads the device's memory."""
    mode = checkpointing_mode(job.model.activation_checkpointing)
    if mode != AUTO:
        return Recompute(mode, job.model.recompute_layers)
    workload, layout = workload_of(job, "cuda"), layout_of(job)
    n_layers = workload.model.n_layers
    usable = device_memory_bytes * (1 - headroom)

    def fits(candidate: str, layers: Optional[int]) -> bool:
        return estimate(workload, with_mode(layout, candidate, layers)).total <= usable

    if fits("none", None):
        return Recompute("none")
    # Layers recompute only whole with activation offload (config.checks refuses the mix).
    counts = [None] if layout.offload_layers else [*range(1, n_layers), None]
    for candidate in LADDER[1:]:
        for layers in counts:  # fewest first: memory falls as more layers recompute
            if fits(candidate, layers):
                return Recompute(candidate, layers)
    return Recompute(LADDER[-1])
