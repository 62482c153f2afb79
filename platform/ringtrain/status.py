"""Values that cross actor boundaries: what a worker is, and what one step on one rank did."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional


@dataclass(frozen=True)
class WorkerInfo:
    rank: int
    host: str
    pid: int
    device: str  # "cpu" or "cuda:N"
    node_id: str = ""  # Ray node id: where the rank's holder and buddy are chosen
    device_name: str = "cpu"  # e.g. "NVIDIA H100 80GB HBM3": picks the peak FLOP/s for MFU


# What a step of a preference objective reports beside its loss, means over the global batch's
# pairs: TRL's names (train/preference.py defines them).
PREFERENCE_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
                      "logps/rejected")  # fmt: skip


@dataclass(frozen=True)
class StepReport:
    """One rank's account of one optimizer step.

    ``loss`` is the global mean token loss of the step (already reduced over dp x cp), so every
    rank reports the same value; ``num_tokens`` counts the tokens this rank attended (its share
    of the step's sequences, padding left out) and ``trained_tokens`` its labels with a loss.
    """

    step: int  # 1-based: the number of optimizer steps completed, this one included
    rank: int
    loss: float
    local_loss: float  # this rank's own mean before the reduction: says which rank went non-finite
    lr: float
    grad_norm: float
    num_tokens: int
    step_time_s: float
    samples: tuple[int, ...]  # global sample indices this rank's replica trained on (ring_pos 0 only)
    batch: int = 0  # index of the data batch the step trained on (runs ahead of step after a skip)
    snapshot_step: int = 0  # newest finished in-memory snapshot (0: none yet)
    snapshot_taken: bool = False  # this step's state was captured: its snapshot is on the way
    snapshot_s: float = 0.0  # its latency: copy + encode + checksum, off the critical path
    snapshot_bytes: int = 0
    memory_bytes: int = 0  # peak device memory during the step (CUDA) or peak RSS (CPU)
    probes: Optional[dict[str, str]] = None  # SDC probe digests, when the step ended with a probe round
    data_wait_s: float = 0.0  # of step_time_s: waiting for the step's batches (the prefetch fell behind)
    # (source, document of its first token) of each of ``samples``, for prepared datasets.
    origins: tuple[tuple[int, int], ...] = ()
    # The step's time outside its collectives (waiting on peers left out): what tells a slow
    # rank, whose peers wait for it, from the ones that wait (policies.stragglers).
    compute_s: float = 0.0
    trained_tokens: int = 0
    # A preference objective's step metrics over the global batch (PREFERENCE_METRICS).
    objective_metrics: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Incident:
    """Something that stopped or disturbed training, as written to ``incidents/NNNN-<kind>.json``."""

    id: int
    kind: str  # one of incidents.INCIDENT_KINDS
    ranks: tuple[int, ...]
    detected_at_step: int  # the step that was running when it was seen
    detected_at: float  # unix time
    detect_s: float  # from the fault's first sign to its detection, when known
    action: str  # abort | retry | replace | shrink | grow | rollback
    reason: str
    dp_before: int
    dp_after: Optional[int] = None
    recover_s: Optional[float] = None
    lost_steps: int = 0
    verdict: Optional[dict[str, Any]] = None
    phases: Optional[dict[str, float]] = None  # recovery time by phase (plan, warm, join, restore)
    # The recovery carried out: the step restored and where each rank's shard came from, who took
    # each seat, and what a retry reused (``policies.recovery.RecoveryPlan.to_dict``).
    plan: Optional[dict[str, Any]] = None
