"""DurableCopies: the durable checkpoints a run keeps, the one owner of what they are.

The Persister (``actors.persister``, ``actors.protocols.Durable``) is handed a step's snapshots
on the ``checkpoint.persist_every`` cadence and at the last step; what it wrote is told as news;
each save that fails is an incident, and after ``checkpoint.max_failed_saves`` in a row the run
stops; a lost writer lease stops durable checkpointing for good, with an incident that says
so. A stop (SIGINT, SIGTERM) writes the newest in-memory snapshot within
``checkpoint.stop_persist_timeout_s`` and says what it saved. Durable checkpoints written after
a state the SDC probes rejected are deleted.
"""

from __future__ import annotations

from typing import Any, Optional

from ringtrain.actors.observers import Observers
from ringtrain.actors.protocols import Durable, Group
from ringtrain.actors.runbook import RunBook
from ringtrain.config import JobConfig
from ringtrain.policies.snapshots import persist_due

# The kind of the incident a lost writer lease or a failed save raises: not a fault of the
# training, which the policies never see.
DURABLE_INCIDENT = "checkpoint"


class DurableCopies:
    def __init__(self, job: JobConfig, group: Group, persister: Optional[Durable], book: RunBook, observers: Observers) -> None:
        """``persister``: None when the run keeps no durable checkpoints."""
        self.job, self.group, self.persister, self.book, self.observers = job, group, persister, book, observers
        self.persist_s = 0.0  # how long the last save took
        # The newest recorded step whose snapshot the workers hold: what a stop makes durable.
        self.newest_snapshot: Optional[int] = None
        self.stopped: Optional[str] = None  # why durable checkpointing stopped (lease lost)
        self._failures_seen = 0  # the Persister's failed saves already raised as incidents

    def step_fields(self) -> dict[str, Any]:
        """What a step's record says of the durable checkpoints."""
        return {"persist_s": self.persist_s, "last_durable_step": self.persister.last_durable_step if self.persister else 0}

    def summary_fields(self) -> dict[str, Any]:
        p = self.persister
        return {
            "last_durable_step": p.last_durable_step if p else 0,
            "checkpoint_errors": list(p.errors) if p else [],
            "durable_stopped": self.stopped,
        }

    def maybe_persist(self, step: int) -> None:
        if self.persister is None:
            return
        if persist_due(step, persist_every=self.job.checkpoint.persist_every, final_step=self.job.last_step):
            # Pending results: the workers serve them while they train the next step.
            self.persister.submit(step, self.group.snapshot_refs(step))
        self.drain(wait=False)

    def drain(self, *, wait: bool) -> None:
        if self.persister is None:
            return
        for persisted in self.persister.flush() if wait else self.persister.poll():
            self.persist_s = persisted.seconds
            self.observers.on_message(
                f"checkpoint step {persisted.step}: {persisted.num_bytes / 1e6:.1f} MB in {persisted.seconds:.2f} s -> {persisted.uri}"
            )

    def discard_after(self, step: int) -> None:
        """Durable checkpoints written after ``step`` hold state the probes have since rejected."""
        if self.persister is None:
            return
        self.drain(wait=True)
        gone = self.persister.discard_after(step)
        if gone:
            self.observers.on_message(f"deleted durable checkpoints of steps {gone}: written after the last clean scan")

    def close(self, wait_s: Optional[float] = None) -> None:
        """Wait for the saves in flight (at most ``wait_s``: a stopping run's bound) and close
        the Persister."""
        if self.persister is None:
            return
        try:
            if wait_s is None:
                self.drain(wait=True)
            else:
                self.persister.flush(timeout_s=wait_s)
        finally:
            self.persister.close(timeout_s=wait_s)

    # --- failures --------------------------------------------------------------------------

    def watch_failures(self, step: int, *, may_stop: bool = True) -> Optional[str]:
        """What failed since the last look, each as an incident at ``step``: durable checkpointing
        stopped for good, and every save that failed. Returns why the run stops, if it does
        (never without ``may_stop``)."""
        self._watch_stopped(step)
        return self._watch_saves(step, may_stop)

    def _watch_stopped(self, step: int) -> None:
        """Once the Persister stopped for good (the store's writer lease was lost): one incident,
        a warning, and the reason kept for the summary and the run's exit."""
        stopped = getattr(self.persister, "stopped", None)
        if stopped is None or self.stopped is not None:
            return
        self.stopped = stopped
        assert self.persister is not None
        last = self.persister.last_durable_step
        self.book.incident(
            DURABLE_INCIDENT, (), step, self.book.clock(), action="continue",
            reason=f"durable checkpointing stopped (the newest durable step is {last}): {stopped}",
        )  # fmt: skip

    def _watch_saves(self, step: int, may_stop: bool) -> Optional[str]:
        """Each failed durable save is an incident naming the store and the cause; the next save
        tries again, and after checkpoint.max_failed_saves failures in a row the run stops (its
        newest durable checkpoint kept, the stop's own save tried once more) instead of training
        on with nothing durable. Returns why the run stops, if it does."""
        p = self.persister
        if p is None:
            return None
        errors = p.failed_saves[self._failures_seen :]
        self._failures_seen = len(p.failed_saves)
        limit = self.job.checkpoint.max_failed_saves
        in_a_row = p.failed_in_a_row
        stop = may_stop and bool(limit) and in_a_row >= limit
        keep = f"the newest durable step is {p.last_durable_step}"
        for i, error in enumerate(errors):
            last = i == len(errors) - 1
            then = (
                f"stopping after {in_a_row} failed saves in a row (checkpoint.max_failed_saves={limit}); {keep}"
                if stop and last else f"the next save tries again; {keep}"
            )  # fmt: skip
            self.book.incident(
                DURABLE_INCIDENT, (), step, self.book.clock(), action="stop" if stop and last else "retry",
                reason=f"durable checkpoint failed: {error}; {then}",
            )  # fmt: skip
        if stop and errors:
            return f"{in_a_row} durable saves failed in a row (checkpoint.max_failed_saves={limit})"
        return None

    # --- a stop ----------------------------------------------------------------------------

    def persist_at_stop(self) -> str:
        """On a stop: the newest snapshot the workers hold written to the durable store within
        checkpoint.stop_persist_timeout_s (saves already queued first); the line that says what
        was saved, where and in how long, or why nothing was."""
        if self.persister is None:
            return "stop: nothing saved: this run keeps no durable checkpoints (checkpoint.snapshot_every=0)"
        clock = self.book.clock
        t0 = clock()
        budget = self.job.checkpoint.stop_persist_timeout_s
        step, p = self.newest_snapshot, self.persister
        earlier_errors = len(p.errors)
        try:
            p.poll()
            if p.stopped is not None:
                return f"stop: nothing saved: durable checkpointing had stopped ({p.stopped})"
            if step is None:
                return "stop: nothing saved: no step since the start holds a snapshot yet"
            if step <= p.last_durable_step:
                return f"stop: step {step} was already saved to {self._uri(step)}"
            if budget <= 0:
                return f"stop: step {step} not saved (checkpoint.stop_persist_timeout_s=0); the newest durable step is {p.last_durable_step}"
            if step not in p.requested:
                p.submit(step, self.group.snapshot_refs(step), timeout_s=budget)
            p.flush(timeout_s=budget - (clock() - t0))
        except Exception as exc:  # the workers went with the stop, or the store refused
            return f"stop: step {step} not saved: {p.describe(exc)}; the newest durable step is {p.last_durable_step}"
        seconds = clock() - t0
        saved = [d for d in p.done if d.step == step]
        if saved:
            self.persist_s = saved[-1].seconds
            return f"stop: saved step {step} to {saved[-1].uri} in {seconds:.2f} s"
        errors = p.errors[earlier_errors:]
        why = p.stopped or (errors[-1] if errors else f"not written within checkpoint.stop_persist_timeout_s={budget:g}")
        return f"stop: step {step} not saved: {why}; the newest durable step is {p.last_durable_step}"

    def _uri(self, step: int) -> str:
        found = [d.uri for d in getattr(self.persister, "done", []) if d.step == step]
        return found[-1] if found else "the store"
