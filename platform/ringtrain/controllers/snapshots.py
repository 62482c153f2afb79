"""Snapshot policy: when to persist, and which copy of the state to restore from.

Sources are tried newest step first; at equal steps the cheapest wins: a peer's memory (no
disk, often no network hop), then this node's holder, then the durable store. A step counts
only when every rank's shard of it is present in that source.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Iterable, Optional


class Source(enum.IntEnum):
    """Where a snapshot lives; lower is cheaper to restore from."""

    PEER = 0
    NODE = 1
    DURABLE = 2


@dataclass(frozen=True)
class Candidate:
    source: Source
    step: int
    ranks: frozenset[int]  # ranks whose shard of ``step`` this source holds
    world_size: int  # how many ranks wrote the snapshot
    location: str  # holder name or checkpoint uri, for logs

    @property
    def complete(self) -> bool:
        return self.ranks == frozenset(range(self.world_size))


def choose_restore_point(candidates: Iterable[Candidate]) -> Optional[Candidate]:
    """The newest complete snapshot, from the cheapest source that has it."""
    complete = [c for c in candidates if c.complete]
    if not complete:
        return None
    return min(complete, key=lambda c: (-c.step, c.source))


def persist_due(step: int, *, persist_every: int, final_step: int) -> bool:
    """Persist every ``persist_every`` steps, and always the last step of the run."""
    return step == final_step or (persist_every > 0 and step % persist_every == 0)
