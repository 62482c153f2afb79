"""The sizes of DeepSpeed ZeRO's buffers a run uses: one value the engine writes into DeepSpeed's
config (train/engine.py) and the planner's memory model counts (planner/memory.py).

Declared here rather than left to DeepSpeed's defaults, so a plan counts the buffers a run
actually allocates even where a DeepSpeed release changes its defaults. The numbers are
DeepSpeed 0.19's defaults (``deepspeed.runtime.zero.config``), so setting them changed nothing.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ZeroSizes:
    """Element counts (not bytes) of ZeRO's buffers and thresholds."""

    # Stages 1-3: gradients staged in a contiguous bucket of this many elements per reduction
    # (``reduce_bucket_size``).
    reduce_bucket: int = 500_000_000
    # Stage 3: parameter elements gathered ahead of their use (``stage3_prefetch_bucket_size``).
    prefetch: int = 50_000_000
    # Stage 3: a tensor of at most this many elements is kept whole on every rank
    # (``stage3_param_persistence_threshold``).
    persistence_threshold: int = 100_000
    # Stage 3: at most this many gathered parameter elements live at once
    # (``stage3_max_live_parameters``).
    max_live: int = 1_000_000_000
    # Stage 0: gradients all-reduced in buckets of this many elements. No config key sets it:
    # it is DeepSpeed's engine constant ``MEMORY_OPT_ALLREDUCE_SIZE``, which a test holds this to.
    allreduce_bucket: int = 500_000_000


ZERO_SIZES = ZeroSizes()
