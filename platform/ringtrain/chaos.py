"""Fault plan: which fault to inject on which rank at which step. Inert unless configured.

Used by tests and by users who want to rehearse failures: ``chaos.faults=[{kind: nan, rank: 1,
step: 3}]``. A fault fires once, at the start of the given step (1-based) on the given rank:
the rank of the world the step runs in, so after a resize it may be another process.
"""

from __future__ import annotations

from dataclasses import dataclass

# crash: the worker process exits mid-step, after the forward pass (as if killed); nan: the
# rank's loss becomes NaN, so its gradients poison the step; slow: the rank sleeps ``seconds``
# before the step (on ``count`` consecutive steps); hang: mid-step, the rank stops in compute (sleeps ``seconds``, or for good
# when 0) while its peers wait in the step's collectives; skip_collective: the rank leaves out
# the step's closing loss all-reduce; wrong_shape: it enters that all-reduce with another shape.
# The last two leave the other ranks waiting in it. bitflip: the rank's device goes bad at the
# step and stays bad: every SDC probe round it runs from then on has one bit of its GEMM output
# flipped, and with target=gradients one bit of its gradient contribution to that step flips
# too (silent: the loss stays finite, every rank applies the corrupted update).
# crash_restoring: the worker process exits while it loads the snapshot in the first recovery
# from a failure seen at or after ``step`` (a second failure inside a recovery): see
# ``restoring_due``.
RESTORING_FAULT = "crash_restoring"
FAULT_KINDS = ("crash", "nan", "slow", "hang", "skip_collective", "wrong_shape", "bitflip", RESTORING_FAULT)
BITFLIP_TARGETS = ("probe", "gradients")


@dataclass
class FaultSpec:
    kind: str = "crash"
    rank: int = 0
    step: int = 1
    seconds: float = 0.0  # for slow and hang
    target: str = "probe"  # for bitflip: probe | gradients
    bit: int = 22  # for bitflip: which bit of an fp32 element (22: the top mantissa bit, up to 2x off)
    count: int = 1  # for slow: fire on this many consecutive steps from ``step`` (a persistent straggler)


class FaultPlan:
    """The faults still to fire. A fault fires once per process, so a step re-run after a
    rollback does not meet the same fault again on the ranks that survived it."""

    def __init__(self, faults: list[FaultSpec]) -> None:
        self.faults = list(faults)

    def take(self, rank: int, step: int) -> list[FaultSpec]:
        due = [
            f for f in self.faults if f.rank == rank and f.step <= step < f.step + max(1, f.count) and f.kind != RESTORING_FAULT
        ]
        # A fault with steps still to come stays; each step of it fires once.
        self.faults = [f for f in self.faults if f not in due or step + 1 < f.step + max(1, f.count)]
        return due

    def restoring_due(self, fired_through: int) -> list[FaultSpec]:
        """The crash_restoring faults that strike the recovery from a failure seen in step
        ``fired_through``: those whose step it reached (the recovery's ``fired_through`` is at
        or after the fault's step). Each strikes one recovery only, the first with a snapshot
        to restore whose ``fired_through`` reaches its step, and only that recovery's first
        attempt (not its retry): ``actors.recovery`` takes it out of the job then."""
        return [f for f in self.faults if f.kind == RESTORING_FAULT and f.step <= fired_through]

    def __bool__(self) -> bool:
        return bool(self.faults)
