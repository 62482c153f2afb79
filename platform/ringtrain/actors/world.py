"""Forming a world: live workers made ranks 0..n-1 of a job's world, joined, and restored.

A world that fails is given up at its first failed call: the failure is reported at once, and
the calls still running (a survivor blocked in a collective with a dead peer) are the
``Leftovers``, waited for (bounded) only before the next world forms, so no worker is ever
asked to join or restore twice at once: a worker still inside one then is a failure of the
next world (it cannot leave a blocked native call before the process group's timeout; the
retry replaces it). A rank that fails in the join closes rank 0's store, so the others stop
waiting in it for the dead one.

The WorkerGroup calls these from its ``form_world`` and ``restore_refs``, handing them what
they use: the members to seat, its leftovers, how to wait for a worker to warm and to seat the
holders, and the dict the phases' times go in as each completes (a failure's phase is the first
missing one, ``policies.retries.phase_of``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

from ringtrain.actors.calls import gather, get, host_of
from ringtrain.actors.roster import Member
from ringtrain.config import JobConfig
from ringtrain.errors import WorkerError

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


def settle_leftovers(leftovers: Leftovers, job: JobConfig, members: list[Member]) -> None:
    """Wait for the calls of the last world that failed (``leftover_wait``). A worker still
    inside one cannot be asked into another world: the first is named as a failed rank of the
    world of ``members``."""
    waited = leftover_wait(job)
    stuck = leftovers.settle(waited)
    for rank, m in enumerate(members):
        if any(m is s for s in stuck):
            raise WorkerError(rank, host_of(members, rank), f"still inside the failed world's call after {waited:g} s", kind="timeout")


@dataclass(frozen=True)
class World:
    """A world formed: the step its ranks restored (0 without a snapshot), the model's
    parameter count, and how long each phase of forming it took."""

    step: int
    num_params: int
    phases: dict[str, float]


def form_world(
    members: list[Member],
    job: JobConfig,
    *,
    leftovers: Leftovers,
    phases: dict[str, float],
    wait_warm: Callable[[list[Member], float], None],
    seat_holders: Callable[[], list[list[Any]]],
    timeout: float,
    snapshot: Optional[list[Any]] = None,
    crash_restoring: frozenset[int] = frozenset(),
    reference: Any = None,
    join: Optional[tuple[float, str]] = None,
) -> World:
    """Join the seated ``members`` as ranks 0..n-1 of ``job``'s world, once each has warmed
    (``wait_warm``) and the holders are seated, restoring ``snapshot`` when given. ``phases``
    takes each phase's time as it completes; ``reference`` (a pending ``Reference``, or None)
    is what every rank is given for DPO's and IPO's reference. Each phase may take ``timeout``;
    ``join``: the join's own (seconds, and what the join does that takes them), when it does
    more than build the world (it takes the reference pass)."""
    settle_leftovers(leftovers, job, members)
    t0 = time.monotonic()
    wait_warm(members, timeout)
    holders = seat_holders()
    t1 = time.monotonic()
    phases["warm_s"] = t1 - t0
    host, port = get(members[0].handle.create_store.remote(job.world_size), rank=0, host=host_of(members, 0), timeout=timeout)

    def abandon_join(pending: dict[Any, Member]) -> None:
        # A rank failed while the world was joining: the others may wait in rank 0's store for
        # it until the store's timeout. Close the store (rank 0 answers on its second slot) so
        # they fail now, and give the world up at once.
        stop_store(members[0].handle)
        leftovers.give_up(pending)

    join_s, joining = join if join is not None else (timeout, "")
    counts = gather(members, lambda rank, w: w.join.remote(job, rank, host, port, holders[rank], reference), join_s,
                    on_failure=abandon_join, doing=joining)  # fmt: skip
    t2 = time.monotonic()
    phases["join_s"] = t2 - t1
    if snapshot is None:
        return World(0, counts[0], phases)
    steps = gather(
        members, lambda rank, w: w.restore.remote(*snapshot, chaos_exit=rank in crash_restoring), timeout, on_failure=leftovers.give_up
    )
    phases["restore_s"] = time.monotonic() - t2
    return World(int(steps[0]), counts[0], phases)


def restore_refs(
    members: list[Member], job: JobConfig, leftovers: Leftovers, shards: list[Any], crash_restoring: frozenset[int] = frozenset()
) -> int:
    """Every rank of the world of ``members`` loads the snapshot whose shards are pending in
    ``shards``; the step restored."""
    settle_leftovers(leftovers, job, members)
    steps = gather(
        members, lambda rank, w: w.restore.remote(*shards, chaos_exit=rank in crash_restoring), job.controllers.start_timeout_s
    )
    return int(steps[0])


def stop_store(handle: Any) -> None:
    """Close rank 0's store (answered on the worker's second slot), so no rank waits in it."""
    try:
        handle.drop_store.remote()
    except Exception:  # rank 0 is gone, and its store with it
        pass
