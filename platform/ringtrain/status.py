"""Values that cross actor boundaries: what a worker is, and what one step on one rank did."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class WorkerInfo:
    rank: int
    host: str
    pid: int
    device: str  # "cpu" or "cuda:N"
    node_id: str = ""  # Ray node id: where the rank's holder and buddy are chosen
    device_name: str = "cpu"  # e.g. "NVIDIA H100 80GB HBM3": picks the peak FLOP/s for MFU


@dataclass(frozen=True)
class StepReport:
    """One rank's account of one optimizer step.

    ``loss`` is the global mean token loss of the step (already reduced over dp x cp), so every
    rank reports the same value; ``num_tokens`` counts the tokens this rank trained on.
    """

    step: int  # 1-based: the number of optimizer steps completed, this one included
    rank: int
    loss: float
    lr: float
    grad_norm: float
    num_tokens: int
    step_time_s: float
    samples: tuple[int, ...]  # global sample indices this rank's replica trained on (ring_pos 0 only)
    snapshot_step: int = 0  # newest finished in-memory snapshot (0: none yet)
    snapshot_s: float = 0.0  # its latency: copy + encode + checksum, off the critical path
    snapshot_bytes: int = 0
    memory_bytes: int = 0  # peak device memory during the step (CUDA) or peak RSS (CPU)
