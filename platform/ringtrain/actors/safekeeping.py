"""Safekeeping: when a step's snapshots are safe, held by every holder their ranks send them to.

A step's record says the step is done and survives a failure, so the Controller writes it only
once this says so. Until then a worker's newest snapshot lives in its own process alone: a kill
there would take the step with it, and at ZeRO 1-3 no survivor holds the dead rank's optimizer
shard to write it again. For each step that took snapshots the holders are asked to answer once
they have them (``SnapshotHolder.wait_for``); the step loop watches the answers alongside the
next step's calls (``actors.steps``), so the wait costs training nothing and the record follows
the step by the transit window (``actors.transit``): tens of milliseconds on the CPU testbed.

One question is out at a time: a step taken while one is pending is asked about when it comes
back, and a newer snapshot answers for the older steps too.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Optional

log = logging.getLogger(__name__)


class Safekeeping:
    def __init__(self, ask: Callable[[int], list[Any]]) -> None:
        """``ask(step)``: one pending answer (an object ref) per holder, true once it holds
        ``step`` for every rank it should; none when there is no holder to ask."""
        self._ask = ask
        self.safe_through = 0  # every step up to here is safe (or was never going to be safer)
        self._pending: Optional[tuple[int, list[Any]]] = None  # (step asked about, answers)
        self._unanswered: list[Any] = []  # of those answers, the ones not in yet
        self._newest_taken = 0

    def taken(self, step: int) -> None:
        """The snapshots of ``step`` are on their way to the holders."""
        self._newest_taken = max(self._newest_taken, step)
        if self._pending is None:
            self._ask_about(self._newest_taken)

    def refs(self) -> list[Any]:
        """The answers still to come, for the step loop to wait on with its own calls."""
        return list(self._unanswered)

    def poll(self, timeout_s: float = 0.0) -> bool:
        """Take in the answers (waiting up to ``timeout_s`` for the newest step taken to be
        answered for); whether ``safe_through`` moved. A holder that said no, or died, does not
        hold records back: the step is counted as safe as it will get, with a warning."""
        deadline = time.monotonic() + timeout_s
        moved = False
        while self._pending is not None and self._answered(max(0.0, deadline - time.monotonic())):
            moved = True
        return moved

    def _answered(self, timeout_s: float) -> bool:
        """Whether every answer about the pending step is in (then the newer step taken
        meanwhile, if any, is asked about next)."""
        import ray

        assert self._pending is not None
        step, refs = self._pending
        if self._unanswered:
            _, self._unanswered = ray.wait(self._unanswered, num_returns=len(self._unanswered), timeout=timeout_s)
        if self._unanswered:
            return False
        if not all(_yes(ref) for ref in refs):
            log.warning("the snapshots of step %d did not all reach their holders", step)
        self._pending = None
        self.safe_through = max(self.safe_through, step)
        if self._newest_taken > step:
            self._ask_about(self._newest_taken)
        return True

    def restart(self, step: int) -> None:
        """A world starts from ``step``'s state: what was asked about the last one is moot."""
        self._pending, self._unanswered = None, []
        self._newest_taken = self.safe_through = step

    def _ask_about(self, step: int) -> None:
        refs = self._ask(step)
        if refs:
            self._pending, self._unanswered = (step, refs), list(refs)
        else:
            self.safe_through = max(self.safe_through, step)


def _yes(ref: Any) -> bool:
    import ray

    try:
        return bool(ray.get(ref, timeout=0))
    except Exception:  # the holder died: its node's failure is the recovery's to handle
        return False
