"""Roster: the worker actors the group keeps and where they sit, and what becomes of a worker
that dies while it warms up.

A spare or a worker started for growth or a recovery warms up in the background (see
``TrainWorker.warm``). One that dies meanwhile must not stay in the group's lists: a dead spare
still counted as a spare keeps the spare count from being replenished, and a dead worker among
those prepared for growth keeps growth from ever being ready. ``settle`` sorts the finished
warm-ups into ready and dead; ``WarmDeaths`` decides whether a dead one's slot is tried again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from ringtrain.status import WorkerInfo

# How many warm-up deaths a slot may see before it is held back for good: a device (a bundle
# keeps its GPU) that kills every worker placed on it would otherwise be retried forever.
MAX_WARM_DEATHS_PER_SLOT = 2


@dataclass(frozen=True)
class Slot:
    """Where an actor is placed: a bundle of one of the job's placement groups."""

    pg: Any
    index: int


@dataclass
class Member:
    """A live worker actor and where it sits."""

    handle: Any
    slot: Slot
    info: Optional[WorkerInfo] = None
    warm: Any = None  # pending result of warm(), while a spare or a new worker starts
    error: str = ""  # why its warm-up failed, once it did


# Pending warm() results -> the results that finished (an exception for a failed one); never waits.
Poll = Callable[[list[Any]], dict[int, "WorkerInfo | BaseException"]]


def settle(members: list[Member], poll: Poll) -> list[Member]:
    """Give every member whose warm-up finished its WorkerInfo; return those whose warm-up
    failed (their ``warm`` cleared and ``error`` set, so they are never taken as ready)."""
    pending = [m for m in members if m.warm is not None]
    if not pending:
        return []
    finished = poll([m.warm for m in pending])
    dead = []
    for i, m in enumerate(pending):
        if i not in finished:
            continue
        result = finished[i]
        m.warm = None
        if isinstance(result, BaseException):
            m.error = f"{type(result).__name__}: {str(result).strip().splitlines()[0] if str(result).strip() else ''}"
            dead.append(m)
        else:
            m.info = result
    return dead


@dataclass
class WarmDeaths:
    """Warm-up deaths per slot: a slot is reused until it has seen ``limit`` of them."""

    limit: int = MAX_WARM_DEATHS_PER_SLOT
    counts: dict[tuple[str, int], int] = field(default_factory=dict)

    def record(self, slot: Slot) -> bool:
        """Count one death in ``slot``; whether the slot may take another worker."""
        # By the placement group's own id: a Python id() is reused once a group is freed, and two
        # handles of one group have two.
        key = (str(getattr(slot.pg, "id", slot.pg)), slot.index)
        self.counts[key] = self.counts.get(key, 0) + 1
        return self.counts[key] < self.limit

    @property
    def total(self) -> int:
        return sum(self.counts.values())
