"""Persister: copies snapshots to the durable store on a background thread of the driver.

The Controller hands it the *pending* results of the workers' ``snapshot(step)`` calls and goes
on with the next step; the workers answer those calls on their second concurrency slot while
they train, and this thread writes the shards and commits the manifest. So a durable
checkpoint costs the step loop nothing but the actor calls themselves.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from ringtrain.checkpoint import CheckpointStore

log = logging.getLogger(__name__)


def shard_name(rank: int) -> str:
    return f"rank-{rank:05d}"


@dataclass(frozen=True)
class Persisted:
    step: int
    uri: str
    num_bytes: int
    seconds: float  # from the request to the committed manifest


class Persister:
    def __init__(self, store: CheckpointStore, meta: Mapping[str, Any], *, guard: Callable[[], None] = lambda: None) -> None:
        self.store = store
        self.meta = dict(meta)
        # Raises before every write once this run may no longer write the store (its writer
        # lease was lost, see checkpoint/lease.py): the write then fails like any other.
        self.guard = guard
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="persist")
        self._pending: list[Future[Persisted]] = []
        self.done: list[Persisted] = []
        self.errors: list[str] = []

    @property
    def last_durable_step(self) -> int:
        return max((p.step for p in self.done), default=0)

    def submit(self, step: int, snapshot_refs: list[Any]) -> None:
        """Persist ``step`` once the workers' snapshots (Ray object refs, rank order) arrive."""
        self._pending.append(self._pool.submit(self._guarded, step, snapshot_refs, time.perf_counter()))

    def poll(self) -> list[Persisted]:
        """Checkpoints committed since the last call (failures are logged and kept in ``errors``)."""
        finished, still_running = [], []
        for future in self._pending:  # one done() per future: it may finish while we look
            (finished if future.done() else still_running).append(future)
        self._pending = still_running
        return self._collect(finished)

    def flush(self) -> list[Persisted]:
        """Wait for every requested checkpoint."""
        finished, self._pending = self._pending, []
        return self._collect(finished)

    def discard_after(self, step: int) -> list[int]:
        """Delete the checkpoints this run committed after ``step``: they hold a state found
        corrupt, which a later resume must not pick up. Waits for writes in flight first (a
        corrupt one may be among them); a delete that fails is logged and kept in ``errors``.
        Returns the steps deleted."""
        self.flush()
        gone = []
        for persisted in [p for p in self.done if p.step > step]:
            try:
                self.guard()
                self.store.delete(persisted.step)
                gone.append(persisted.step)
            except Exception as exc:
                message = f"could not delete checkpoint {persisted.uri}: {type(exc).__name__}: {exc}"
                log.warning(message)
                self.errors.append(message)
        self.done = [p for p in self.done if p.step not in gone]
        return gone

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def _collect(self, finished: list[Future[Persisted]]) -> list[Persisted]:
        out = []
        for future in finished:
            try:
                out.append(future.result())
            except Exception as exc:  # a failed write loses a checkpoint, not the run
                message = f"{type(exc).__name__}: {exc}"
                log.warning("durable checkpoint failed: %s", message)
                self.errors.append(message)
        self.done.extend(out)
        return out

    def _guarded(self, step: int, snapshot_refs: list[Any], t0: float) -> Persisted:
        self.guard()
        return self._persist(step, snapshot_refs, t0)

    def _persist(self, step: int, snapshot_refs: list[Any], t0: float) -> Persisted:
        import ray

        pairs = ray.get(snapshot_refs)
        shards = {shard_name(rank): blob for rank, (blob, _) in enumerate(pairs)}
        meta = dict(self.meta, step=step, world_size=len(shards))
        ref = self.store.save(step, shards, meta)
        return Persisted(step=step, uri=ref.uri, num_bytes=sum(len(b) for b in shards.values()), seconds=time.perf_counter() - t0)
