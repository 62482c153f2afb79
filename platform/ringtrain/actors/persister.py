"""Persister: copies snapshots to the durable store on a background thread of the driver.

The Controller hands it the *pending* results of the workers' ``snapshot(step)`` calls and goes
on with the next step; the workers answer those calls on their second concurrency slot while
they train, and this thread writes the shards and commits the manifest. So a durable
checkpoint costs the step loop nothing but the actor calls themselves.

Every write goes through the run's fence (its writer lease, checkpoint/lease.py): once the
lease is lost a save stops where it is, durable checkpointing stops for the rest of the run and
``stopped`` says why, for the Controller to raise an incident and the run's exit to repeat.
``close`` bounds the wait for a save in flight and says whether one is still writing: the lease
is released only when none is (commands/run.py). A save that fails (the store refused it, or could
not be reached after botocore's retries) loses that checkpoint, not the run: it is kept in
``errors`` as one line naming the store and the cause (``checkpoint.s3_access``), and
``failed_in_a_row`` counts the failures since the last save that succeeded, for the Controller's
rule (``checkpoint.max_failed_saves``).
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from ringtrain.checkpoint import CheckpointStore
from ringtrain.checkpoint.fence import Fence, FenceLost
from ringtrain.checkpoint.fence import confirm as confirm_fence

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
    def __init__(self, store: CheckpointStore, meta: Mapping[str, Any], *, fence: Optional[Fence] = None) -> None:
        self.store = store
        self.meta = dict(meta)
        self.fence = fence
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="persist")
        self._pending: list[Future[Persisted]] = []
        self._writing = threading.Lock()  # held while a save runs: close() waits on it
        self._stopping = threading.Lock()  # the save's thread and the caller's may both see the loss
        self.requested: list[int] = []  # every step submitted, in order
        self.done: list[Persisted] = []
        self.errors: list[str] = []
        # Why durable checkpointing stopped for good (the fence was lost), or None.
        self.stopped: Optional[str] = None
        self.failed_saves: list[str] = []  # each failed save (not a lost lease), as errors tells it
        self.failed_in_a_row = 0  # saves failed since the last one that succeeded

    @property
    def last_durable_step(self) -> int:
        return max((p.step for p in self.done), default=0)

    def submit(self, step: int, snapshot_refs: list[Any], *, timeout_s: Optional[float] = None) -> None:
        """Persist ``step`` once the workers' snapshots (Ray object refs, rank order) arrive
        (within ``timeout_s`` of now, if given). Nothing once durable checkpointing stopped."""
        if self.stopped is not None:
            return
        self.requested.append(step)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        self._pending.append(self._pool.submit(self._guarded, step, snapshot_refs, time.perf_counter(), deadline))

    def poll(self) -> list[Persisted]:
        """Checkpoints committed since the last call (failures are logged and kept in ``errors``)."""
        finished, still_running = [], []
        for future in self._pending:  # one done() per future: it may finish while we look
            (finished if future.done() else still_running).append(future)
        self._pending = still_running
        return self._collect(finished)

    def flush(self, timeout_s: Optional[float] = None) -> list[Persisted]:
        """Wait for every requested checkpoint (up to ``timeout_s``: the ones still running then
        stay pending)."""
        if timeout_s is not None:
            wait_futures(self._pending, timeout=max(0.0, timeout_s))
            return self.poll()
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
                self.store.delete(persisted.step, fence=self.fence)
                gone.append(persisted.step)
            except FenceLost as exc:
                self._stop(exc)
                break
            except Exception as exc:
                message = f"could not delete checkpoint {persisted.uri}: {type(exc).__name__}: {exc}"
                log.warning(message)
                self.errors.append(message)
        self.done = [p for p in self.done if p.step not in gone]
        return gone

    def close(self, timeout_s: Optional[float] = None) -> bool:
        """Start no further save (queued ones are dropped) and wait up to ``timeout_s`` (None:
        as long as it takes) for the one writing; whether none is writing any more."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        if not self._writing.acquire(timeout=-1 if timeout_s is None else max(0.0, timeout_s)):
            return False
        self._writing.release()
        return True

    def _collect(self, finished: list[Future[Persisted]]) -> list[Persisted]:
        out = []
        for future in finished:
            if future.cancelled():
                continue
            try:
                out.append(future.result())
                self.failed_in_a_row = 0
            except FenceLost as exc:
                self._stop(exc)
            except Exception as exc:  # a failed write loses a checkpoint, not the run
                self.failed_in_a_row += 1
                self.failed_saves.append(self.describe(exc))
                self.errors.append(self.failed_saves[-1])
        self.done.extend(out)
        return out

    def describe(self, exc: BaseException) -> str:
        """A failed save in one line: the workers' snapshot that could not be fetched (they, or
        their cluster, went away), or the store and the cause (an S3 failure in its own
        sentence, never botocore's trace)."""
        from ray.exceptions import RayError

        from ringtrain.checkpoint.s3_access import cause

        if isinstance(exc, RayError):
            first = (str(exc).strip().splitlines() or [""])[0]
            return f"the snapshot could not be fetched from the workers, which (or whose cluster) went away: {type(exc).__name__}: {first}"
        said = cause(exc)
        return f"{self.store.uri}: {said}" if said else f"{self.store.uri}: {type(exc).__name__}: {exc}"

    def _stop(self, exc: FenceLost) -> None:
        with self._stopping:
            if self.stopped is None:
                self.stopped = str(exc)
                log.error("durable checkpointing stopped: %s", exc)
                self.errors.append(f"{type(exc).__name__}: {exc}")

    def _guarded(self, step: int, snapshot_refs: list[Any], t0: float, deadline: Optional[float]) -> Persisted:
        with self._writing:
            try:
                confirm_fence(self.fence)  # before fetching the snapshots: a lost lease costs no transfer
                timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
                return self._persist(step, snapshot_refs, t0, timeout)
            except FenceLost as exc:
                self._stop(exc)  # at once: the next submit is refused without waiting for a poll
                raise

    def _persist(self, step: int, snapshot_refs: list[Any], t0: float, timeout_s: Optional[float]) -> Persisted:
        import ray

        pairs = ray.get(snapshot_refs, timeout=timeout_s)
        shards = {shard_name(rank): blob for rank, (blob, _) in enumerate(pairs)}
        meta = dict(self.meta, step=step, world_size=len(shards))
        ref = self.store.save(step, shards, meta, fence=self.fence)
        return Persisted(step=step, uri=ref.uri, num_bytes=sum(len(b) for b in shards.values()), seconds=time.perf_counter() - t0)
