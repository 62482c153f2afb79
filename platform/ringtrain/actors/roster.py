"""Roster: the worker actors the group keeps and where they sit, and what becomes of a worker
that dies while it warms up.

``Roster`` is the one writer of the group's lists: the seated ``members`` (index = rank), the
warm ``spares``, the workers ``growing`` for the next grow, the ``free_slots`` a new worker may
take, the ``quarantined`` slots never reused and the ``cordoned`` nodes. It is plain data with
methods (no Ray): the WorkerGroup starts and stops the actors and tells the roster.

A spare or a worker started for growth or a recovery warms up in the background (see
``TrainWorker.warm``). One that dies meanwhile must not stay in the group's lists: a dead spare
still counted as a spare keeps the spare count from being replenished, and a dead worker among
those prepared for growth keeps growth from ever being ready. ``settle`` sorts the finished
warm-ups into ready and dead; ``WarmDeaths`` decides whether a dead one's slot is tried again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional

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


@dataclass
class Roster:
    """Who is seated, waiting or starting, and which slots and nodes may take a new worker."""

    members: list[Member] = field(default_factory=list)  # index = rank
    spares: list[Member] = field(default_factory=list)  # warm (or warming) workers with no seat
    growing: list[Member] = field(default_factory=list)  # workers starting for the next grow
    free_slots: list[Slot] = field(default_factory=list)  # slots whose actor is gone
    # Slots of ranks evicted for corrupting data: held for the job's lifetime and never
    # reused, so the device behind them (a bundle keeps its GPU) trains nothing again.
    quarantined: list[Slot] = field(default_factory=list)
    cordoned: set[str] = field(default_factory=set)  # nodes evicted whole: nothing new is placed there
    warm_deaths: WarmDeaths = field(default_factory=WarmDeaths)  # workers that died warming up, by slot

    def seat(self, members: list[Member]) -> None:
        """``members`` are the world's ranks 0..n-1."""
        self.members = members

    def add_spares(self, new: list[Member]) -> None:
        self.spares += new

    def take_spares(self, taken: list[Member]) -> None:
        """``taken`` leave the spares (for seats)."""
        self.spares = [s for s in self.spares if s not in taken]

    def add_growing(self, new: list[Member]) -> None:
        self.growing += new

    def take_growing(self, count: int) -> list[Member]:
        """The first ``count`` workers started for growth, leaving the list (for seats)."""
        fill = self.growing[:count]
        self.growing = self.growing[len(fill) :]
        return fill

    def free(self, slot: Slot) -> None:
        """``slot``'s actor is gone: a new worker may take it (once, however often it is freed)."""
        if not any(s.pg is slot.pg and s.index == slot.index for s in self.free_slots):
            self.free_slots.append(slot)

    def take_free_slots(self, count: int) -> list[Slot]:
        """Up to ``count`` free slots, oldest first, no longer free."""
        return [self.free_slots.pop(0) for _ in range(min(count, len(self.free_slots)))]

    def hold(self, slots: list[Slot]) -> None:
        """Never reuse ``slots``."""
        self.quarantined += slots

    def warm_death(self, member: Member, *, reusable: Callable[[], bool]) -> bool:
        """``member`` died warming up: it leaves the spares and the growing, and its slot is
        held back once it has seen too many such deaths, else freed when ``reusable()`` (its
        node is alive and not cordoned). Whether the slot may be tried again."""
        retry = self.warm_deaths.record(member.slot)
        if not retry:
            self.quarantined.append(member.slot)
        elif reusable():
            self.free(member.slot)
        self.spares = [m for m in self.spares if m is not member]
        self.growing = [m for m in self.growing if m is not member]
        return retry

    def cordon(self, nodes: set[str], node_of: Callable[[Member], str], slot_node: Callable[[Slot], str]) -> list[Member]:
        """Place nothing new on ``nodes``: their free slots are dropped, and their spares and
        starting workers leave the roster (returned, for the caller to stop)."""
        self.cordoned |= nodes
        self.free_slots = [s for s in self.free_slots if slot_node(s) not in nodes]
        gone = [m for m in self.spares + self.growing if node_of(m) in nodes]
        self.spares = [m for m in self.spares if m not in gone]
        self.growing = [m for m in self.growing if m not in gone]
        return gone

    def slots_in_use(self) -> Iterable[Slot]:
        """Every slot a worker, spare, free slot or quarantined slot holds."""
        return [m.slot for m in self.members + self.spares + self.growing] + self.free_slots + self.quarantined

    def clear(self) -> None:
        """Every actor is gone (the group shut down)."""
        self.members, self.spares, self.growing, self.free_slots = [], [], [], []
