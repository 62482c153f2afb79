"""StepWatch: when a training step's ranks are waited for, declared lost, or declared stalled.

Every rank runs its step call; the group waits for them and, between results, pings each rank
still running on its second concurrency slot. Four rules decide what happens to a rank that has
not finished (each one a ``controllers.*`` key):

- ``step_timeout_s``: no step takes longer; a rank still running then is lost.
- ``heartbeat_timeout_s``: a rank that has not answered a ping for longer is lost (its process
  or node is gone, while its step call may not say so for a long time).
- ``hang_timeout_s``: while no rank has failed, a step that has not finished by then is a stall:
  the group finds who stopped it (``policies.hangs.diagnose``) and evicts them.
- after a first failure the others settle fast: a peer's death breaks their collectives, so the
  ranks still running get ``heartbeat_timeout_s`` more (never past the step timeout).

The watch is fed what the group sees (a rank's call finished, well or not; a rank answered a
ping; ranks the group evicted) with the time it saw it, and ``check`` says what to do now. It
never reads a clock itself, so every rule is tested with a made-up one.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Iterable, Optional

from ringtrain.policies.hangs import stalled


class Action(Enum):
    WAIT = "wait"  # nothing to do yet: wait up to ``wait_s`` for the next result
    LOSE = "lose"  # declare ``lost`` ranks lost (heartbeats stopped, or the deadline passed)
    STALL = "stall"  # the step stalled: find the culprits among ``ranks`` and evict them


@dataclass(frozen=True)
class Decision:
    action: Action
    lost: tuple[tuple[int, str], ...] = ()  # LOSE: (rank, why), in rank order
    ranks: tuple[int, ...] = ()  # STALL: the ranks still running
    why: str = ""  # STALL: what was seen, for when no culprit can be named

    @classmethod
    def wait(cls) -> Decision:
        return cls(Action.WAIT)


class StepWatch:
    """The watchdog of one step over ``ranks``, started at ``start`` (a monotonic clock)."""

    def __init__(
        self,
        ranks: Iterable[int],
        start: float,
        *,
        step_timeout_s: float,
        heartbeat_s: float,
        heartbeat_timeout_s: float,
        hang_timeout_s: float,
    ) -> None:
        self.start = start
        self.step_timeout_s = step_timeout_s
        self.heartbeat_s = heartbeat_s
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.hang_timeout_s = hang_timeout_s
        self.pending: list[int] = sorted(ranks)  # ranks whose step has not ended, in rank order
        self.last_seen: dict[int, float] = {rank: start for rank in self.pending}
        self.failed_at: Optional[float] = None  # when the step's first failure was seen

    # --- what the group saw ------------------------------------------------------------------

    def finished(self, rank: int, ok: bool, now: float) -> None:
        """``rank``'s step call ended, with its report when ``ok``, else with an error or death."""
        self._drop([rank])
        if not ok and self.failed_at is None:
            self.failed_at = now

    def heard(self, rank: int, now: float) -> None:
        """``rank`` answered a heartbeat."""
        self.last_seen[rank] = now

    def lose(self, ranks: Iterable[int], now: float) -> None:
        """``ranks`` are given up (a LOSE decision carried out, or the culprits of a stall)."""
        self._drop(ranks)
        if self.failed_at is None:
            self.failed_at = now

    # --- what to do --------------------------------------------------------------------------

    @property
    def deadline(self) -> float:
        """When the ranks still running are given up."""
        if self.failed_at is None:
            return self.start + self.step_timeout_s
        return min(self.start + self.step_timeout_s, self.failed_at + self.heartbeat_timeout_s)

    def wait_s(self, now: float) -> float:
        """How long to wait for the next result before checking again: pings go out at least
        every ``heartbeat_s``, and never past the deadline."""
        return max(0.0, min(self.heartbeat_s, self.deadline - now))

    def check(self, now: float) -> Decision:
        """What to do at ``now``; the group carries it out and reports back (``lose``)."""
        if not self.pending:
            return Decision.wait()
        if self.failed_at is None and stalled(self.start, now, self.hang_timeout_s):
            return Decision(Action.STALL, ranks=tuple(self.pending), why=f"no progress for {now - self.start:.1f} s")
        silent = {rank for rank in self.pending if now - self.last_seen[rank] > self.heartbeat_timeout_s}
        late = now >= self.deadline
        if not (late or silent):
            return Decision.wait()
        lost = tuple(
            (rank, "stopped answering heartbeats" if rank in silent else f"did not finish within {now - self.start:.1f} s")
            for rank in self.pending
            if late or rank in silent
        )
        return Decision(Action.LOSE, lost=lost)

    def _drop(self, ranks: Iterable[int]) -> None:
        gone = set(ranks)
        self.pending = [rank for rank in self.pending if rank not in gone]
