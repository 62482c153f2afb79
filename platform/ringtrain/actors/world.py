"""Forming a world: live workers made ranks 0..n-1 of a job's world, joined, and restored.

A world that fails is given up at its first failed call: the failure is reported at once, and
the calls still running (a survivor blocked in a collective with a dead peer) are the
``Leftovers``, waited for (bounded) only before the next world forms, so no worker is ever
asked to join or restore twice at once: a worker still inside one then is a failure of the
next world (it cannot leave a blocked native call before the process group's timeout; the
retry replaces it). A rank that fails in the join closes rank 0's store, so the others stop
waiting in it for the dead one.

Functions over the WorkerGroup, which calls them from its ``form_world`` and ``restore_refs``.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Optional

from ringtrain.actors.roster import Member
from ringtrain.config import JobConfig
from ringtrain.errors import WorkerError

if TYPE_CHECKING:
    from ringtrain.actors.group import WorkerGroup

log = logging.getLogger(__name__)


class Leftovers:
    """Calls of the last world that failed still running when it was given up."""

    def __init__(self) -> None:
        self.calls: dict[Any, Member] = {}  # a pending call -> the worker running it

    def give_up(self, pending: dict[Any, Member]) -> None:
        """A world failed at its first failed call: the failure is reported now, and the calls
        still running are waited for only before the next world forms (``settle``), so a
        survivor blocked in a collective with a dead peer does not delay the recovery's
        detection."""
        self.calls = dict(pending)

    def settle(self, timeout: float) -> list[Member]:
        """Wait (up to ``timeout``) for the calls of the last world that failed to end: a retry
        must not find a worker still inside the last attempt's join or restore. Returns the
        workers whose call still runs; their calls stay pending, for the next world to wait for
        (a worker replaced meanwhile ends its call as it is stopped)."""
        import ray

        if not self.calls:
            return []
        _, running = ray.wait(list(self.calls), num_returns=len(self.calls), timeout=timeout)
        self.calls = {ref: self.calls[ref] for ref in running}
        if running:
            log.warning("%d calls of the failed world still running after %g s", len(running), timeout)
        return list(self.calls.values())


def leftover_wait(job: JobConfig) -> float:
    """How long the calls of a failed world are waited for: its joins end within
    ``join_timeout_s`` of starting (each group gives up on a dead peer then), and a heartbeat
    timeout more covers one that started late, behind its worker's last call."""
    return job.controllers.join_timeout_s + job.controllers.heartbeat_timeout_s


def settle_leftovers(g: "WorkerGroup", members: list[Member]) -> None:
    """Wait for the calls of the last world that failed (``leftover_wait``). A worker still
    inside one cannot be asked into another world: the first is named as a failed rank of the
    world of ``members``."""
    waited = leftover_wait(g.job)
    stuck = g.leftovers.settle(waited)
    for rank, m in enumerate(members):
        if any(m is s for s in stuck):
            raise WorkerError(rank, g._host(rank), f"still inside the failed world's call after {waited:g} s", kind="timeout")


def form_world(
    g: "WorkerGroup",
    members: list[Member],
    job: JobConfig,
    snapshot: Optional[list[Any]] = None,
    crash_restoring: frozenset[int] = frozenset(),
) -> int:
    """As ``WorkerGroup.form_world``: seat ``members`` as ranks of ``job``'s world, join them,
    restore ``snapshot`` when given; the step restored (0 without one)."""
    timeout = g.job.controllers.start_timeout_s
    g.job = job
    g.roster.seat(members)
    g.phases = {}  # filled as phases complete: a failure's phase is the first missing
    settle_leftovers(g, members)
    t0 = time.monotonic()
    g._wait_warm(members, timeout)
    holders = g.seat_holders()
    g.generation += 1
    t1 = time.monotonic()
    g.phases["warm_s"] = t1 - t0
    host, port = g._call(members[0].handle.create_store.remote(job.world_size), rank=0, timeout=timeout)

    def abandon_join(pending: dict[Any, Member]) -> None:
        # A rank failed while the world was joining: the others may wait in rank 0's store for
        # it until the store's timeout. Close the store (rank 0 answers on its second slot) so
        # they fail now, and give the world up at once.
        stop_store(g.members[0].handle)
        g.leftovers.give_up(pending)

    counts = g._gather(lambda rank, w: w.join.remote(job, rank, host, port, holders[rank]), timeout, on_failure=abandon_join)
    g.num_params = counts[0]
    t2 = time.monotonic()
    g.phases["join_s"] = t2 - t1
    if snapshot is None:
        return 0
    steps = g._gather(
        lambda rank, w: w.restore.remote(*snapshot, chaos_exit=rank in crash_restoring), timeout, on_failure=g.leftovers.give_up
    )
    g.phases["restore_s"] = time.monotonic() - t2
    return int(steps[0])


def restore_refs(g: "WorkerGroup", shards: list[Any], crash_restoring: frozenset[int] = frozenset()) -> int:
    """As ``WorkerGroup.restore_refs``: every rank of the current world loads the snapshot whose
    shards are pending in ``shards``; the step restored."""
    settle_leftovers(g, g.members)
    steps = g._gather(
        lambda rank, w: w.restore.remote(*shards, chaos_exit=rank in crash_restoring), g.job.controllers.start_timeout_s
    )
    return int(steps[0])


def stop_store(handle: Any) -> None:
    """Close rank 0's store (answered on the worker's second slot), so no rank waits in it."""
    try:
        handle.drop_store.remote()
    except Exception:  # rank 0 is gone, and its store with it
        pass
