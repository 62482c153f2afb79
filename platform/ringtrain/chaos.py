"""Fault plan: which fault to inject on which rank at which step. Inert unless configured.

Used by tests and by users who want to rehearse failures: ``chaos.faults=[{kind: nan, rank: 1,
step: 3}]``. A fault fires once, at the start of the given step (1-based) on the given rank.
"""

from __future__ import annotations

from dataclasses import dataclass

# crash: the worker process exits at once (as if killed); nan: the rank's loss becomes NaN,
# so its gradients poison the step; slow: the rank sleeps ``seconds`` before the step.
FAULT_KINDS = ("crash", "nan", "slow")


@dataclass
class FaultSpec:
    kind: str = "crash"
    rank: int = 0
    step: int = 1
    seconds: float = 0.0  # for slow


class FaultPlan:
    def __init__(self, faults: list[FaultSpec]) -> None:
        self.faults = list(faults)

    def at(self, rank: int, step: int) -> list[FaultSpec]:
        return [f for f in self.faults if f.rank == rank and f.step == step]

    def __bool__(self) -> bool:
        return bool(self.faults)
