"""Straggler policy: which rank is persistently slower than its peers. Pure.

In a synchronous step every rank waits for the slowest one inside the step's collectives, so
step time says nothing about who is slow; each rank's *compute* time does: the step's time
less the time blocked in collectives (``StepReport.compute_s``, from the collective recorder).
The straggler computes longer; its peers compute as usual and wait for it.

A rank whose compute time is at least ``factor`` times the median of the other ranks' (and at
least ``MIN_EXCESS_S`` longer, so that microsecond-scale steps do not flap) on ``steps``
consecutive steps is named. With two ranks the median of the others is the other rank, so a
slow rank in a pair is still told from its peer. Evidence resets with the world: ranks are
renumbered by a resize, and a straggler evicted leaves its peers with a clean slate.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

# A rank must compute this many seconds longer than its peers' median to count as slow at all.
MIN_EXCESS_S = 0.005


@dataclass(frozen=True)
class Straggler:
    """A rank found slow on ``len(steps)`` consecutive steps."""

    rank: int
    slowdown: float  # its compute time over the median of its peers', mean over ``steps``
    steps: tuple[int, ...]  # the consecutive steps it was slow on
    compute_s: float  # its compute time on the last of them
    median_s: float  # its peers' median on the last of them

    def to_dict(self, **where: Any) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "slowdown": round(self.slowdown, 3),
            "steps": list(self.steps),
            "compute_s": round(self.compute_s, 6),
            "median_s": round(self.median_s, 6),
            **where,
        }


def peer_medians(compute_s: dict[int, float]) -> dict[int, float]:
    """Each rank's peers' median compute time (its own for a lone rank). One sort for all
    ranks: the controller does this every step, and at 16,384 ranks a median per rank over its
    peers took seconds a step."""
    if len(compute_s) <= 1:
        return dict(compute_s)
    order = sorted(compute_s, key=compute_s.__getitem__)
    values = [compute_s[r] for r in order]
    mid, odd = divmod(len(values) - 1, 2)  # of each rank's peers
    medians = {}
    for position, rank in enumerate(order):
        upper = _peer(values, position, mid)
        medians[rank] = upper if odd else (_peer(values, position, mid - 1) + upper) / 2
    return medians


def _peer(values: list[float], position: int, i: int) -> float:
    """The i-th smallest of ``values`` (sorted) without the one at ``position``."""
    return values[i if i < position else i + 1]


def slowdowns(compute_s: dict[int, float], medians: Optional[dict[int, float]] = None) -> dict[int, float]:
    """Each rank's compute time over the median of the other ranks' (1.0 for a lone rank or
    when the peers took no time); ``medians``: ``peer_medians(compute_s)`` if already known."""
    if len(compute_s) <= 1:
        return {r: 1.0 for r in compute_s}
    medians = medians if medians is not None else peer_medians(compute_s)
    return {rank: own / medians[rank] if medians[rank] > 0 else 1.0 for rank, own in compute_s.items()}


@dataclass
class StragglerWatch:
    """Follows each step's per-rank compute times; ``observe`` names a persistent straggler."""

    factor: float
    steps: int
    _streaks: dict[int, list[tuple[int, float]]] = field(default_factory=dict)  # rank -> (step, slowdown)
    _named: set[int] = field(default_factory=set)  # ranks named in their current slow streak

    def reset(self) -> None:
        """A new world: ranks mean other processes now."""
        self._streaks.clear()
        self._named.clear()

    def observe(self, step: int, compute_s: dict[int, float]) -> Optional[Straggler]:
        """Take one completed step's compute times (rank -> seconds); returns the slowest rank
        whose streak just reached ``steps`` (each streak is named once), else None."""
        medians = peer_medians(compute_s)
        ratios = slowdowns(compute_s, medians)
        found: list[Straggler] = []
        for rank, ratio in ratios.items():
            median = medians[rank]
            slow = ratio >= self.factor and compute_s[rank] - median >= MIN_EXCESS_S
            if not slow:
                self._streaks.pop(rank, None)
                self._named.discard(rank)
                continue
            streak = self._streaks.setdefault(rank, [])
            if streak and streak[-1][0] != step - 1:
                streak.clear()  # not consecutive (a rollback, or a step without data)
            streak.append((step, ratio))
            del streak[: -self.steps]
            if len(streak) >= self.steps and rank not in self._named:
                mean = sum(r for _, r in streak) / len(streak)
                found.append(Straggler(rank, mean, tuple(s for s, _ in streak), compute_s[rank], median))
        if not found:
            return None
        worst = max(found, key=lambda s: s.slowdown)
        self._named.add(worst.rank)
        return worst
