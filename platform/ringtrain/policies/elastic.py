"""Elastic policy: how many replicas to run, who sits where after a resize, when to grow. Pure.

The unit that comes and goes is a whole replica (one CP ring of ``cp`` workers). Any dp in
``[mesh.min_dp, max_dp]`` that divides the global batch into whole micro-batches is allowed;
gradient accumulation absorbs the rest, so the global batch never changes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


def allowed_dps(*, global_batch: int, micro_batch: int, min_dp: int, max_dp: int) -> list[int]:
    """Replica counts the global batch can be split over, ascending."""
    return [dp for dp in range(min_dp, max_dp + 1) if global_batch % (dp * micro_batch) == 0]


def target_dp(replicas: int, *, global_batch: int, micro_batch: int, min_dp: int, max_dp: int) -> Optional[int]:
    """The most replicas that ``replicas`` of capacity can run, or None when even min_dp cannot."""
    allowed = allowed_dps(global_batch=global_batch, micro_batch=micro_batch, min_dp=min_dp, max_dp=max_dp)
    fitting = [dp for dp in allowed if dp <= replicas]
    return fitting[-1] if fitting else None


def reseat(*, dp: int, cp: int, lost: frozenset[int], new_dp: int) -> list[Optional[int]]:
    """Who takes each rank of the new ``new_dp x cp`` world: an old rank, or None for a seat a
    spare or a new worker fills.

    Whole replicas keep their rings (so their ring neighbours and node placement stay); when
    the world shrinks, replicas that lost a rank go first, then the highest-numbered ones. A
    broken replica that stays keeps its survivors in place and leaves its lost seats empty.
    """
    replicas = list(range(dp))
    broken = {rank // cp for rank in lost}
    kept = [d for d in replicas if d not in broken] + [d for d in replicas if d in broken]
    kept = sorted(kept[:new_dp]) if new_dp <= dp else replicas
    seats: list[Optional[int]] = []
    for d in kept:
        seats.extend(None if r in lost else r for r in range(d * cp, (d + 1) * cp))
    seats.extend([None] * (new_dp - len(kept)) * cp)
    return seats


def evicted(*, dp: int, cp: int, seats: list[Optional[int]], lost: frozenset[int]) -> list[int]:
    """Old ranks that are alive but have no seat in the new world."""
    seated = {r for r in seats if r is not None}
    return [r for r in range(dp * cp) if r not in seated and r not in lost]


@dataclass
class GrowGate:
    """Grow only after capacity for more replicas has been seen for ``after_s`` without a gap
    (so a node that flaps in and out does not resize the job each time)."""

    after_s: float
    _since: Optional[float] = field(default=None, init=False)
    _dp: int = field(default=0, init=False)

    def observe(self, now: float, *, current_dp: int, possible_dp: Optional[int]) -> Optional[int]:
        """Feed what capacity allows now; returns the dp to grow to once the gate opens."""
        if possible_dp is None or possible_dp <= current_dp:
            self._since = None
            return None
        if self._since is None or possible_dp < self._dp:
            self._since = now
        self._dp = possible_dp
        return possible_dp if now - self._since >= self.after_s else None

    def reset(self) -> None:
        self._since = None
