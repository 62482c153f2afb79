"""Fault policy: what went wrong in a step, and what to do about it. Pure.

A failed step is seen as one outcome per rank. A dead process takes its peers' collectives
down with it, so the ranks that merely lost a peer report communication errors; the policy
looks through those to the rank that failed first-hand. Then it picks the cheapest recovery
that keeps the configured global batch:

- a warm spare takes each lost seat (same dp, no cold start);
- else the broken replicas are evicted and the job shrinks, when ``mesh.min_dp`` allows (the
  elastic policy grows it back once replacements are ready, without stopping training);
- else new workers are started for the lost seats (the job waits for them);
- an exception in a rank's own code, or a non-finite loss, rolls back to the last snapshot in
  place; a non-finite loss then skips the poisoned batch or retries it (``controllers.on_nan``);
- a rank that failed an SDC scan is evicted like a lost one (its state is suspect, so the
  restore point is the last clean scan's, which the caller supplies); a scan that names no rank
  rolls back in place;
- the same exception again on the same step after a rollback (``policies.repeats``), anything
  beyond ``controllers.max_recoveries``, or with no way forward, aborts the run.
"""

from __future__ import annotations

import enum
import math
import re
from dataclasses import dataclass
from typing import Optional, Sequence

from ringtrain.incidents import Kind


class Outcome(enum.Enum):
    OK = "ok"
    DIED = "died"  # the process is gone (killed, crashed, its node removed)
    ERROR = "error"  # the step raised
    LOST = "lost"  # alive as far as Ray knows, but stopped answering heartbeats or never finished


@dataclass(frozen=True)
class RankOutcome:
    """How one rank's step call ended."""

    rank: int
    outcome: Outcome
    error: str = ""  # "<ExceptionType>: <first line>" for ERROR
    node_alive: bool = True
    where: str = ""  # for ERROR: the raising frame in ringtrain or user code (policies.repeats)


class Action(enum.Enum):
    REPLACE = "replace"  # fill lost seats (spares or new workers), same dp
    SHRINK = "shrink"  # evict the replicas with lost ranks
    ROLLBACK = "rollback"  # same workers, state from the last snapshot
    ABORT = "abort"
    REPORT = "report"  # nothing done: the incident is a report (a straggler with nowhere to go)


# Messages of a collective that failed because a peer went away, not because of this rank.
_PEER_FAILURE = re.compile(
    r"connection (closed|reset|refused)|broken pipe|read error|socket|gloo|nccl|"
    r"timed out|timeout|process ?group|peer|abort",
    re.IGNORECASE,
)


def is_peer_failure(error: str) -> bool:
    """True for the errors a rank reports when a collective lost one of its peers."""
    return bool(_PEER_FAILURE.search(error))


@dataclass(frozen=True)
class Failure:
    kind: Kind
    ranks: tuple[int, ...]  # the ranks that failed first-hand
    reason: str
    error: str = ""  # for ERROR: the first-hand exception, "<ExceptionType>: <first line>"
    where: str = ""  # for ERROR: the frame that raised it

    @property
    def lost_workers(self) -> bool:
        """Whether the failed ranks' processes are gone (or must be) and their seats need filling."""
        return self.kind in (Kind.CRASH, Kind.NODE_LOST, Kind.HANG, Kind.STRAGGLER) or (
            self.kind is Kind.SDC and bool(self.ranks)
        )

    @property
    def suspect_devices(self) -> bool:
        """Whether the failed ranks' devices corrupted data (their nodes may be cordoned)."""
        return self.kind is Kind.SDC and bool(self.ranks)

    @property
    def quarantine(self) -> bool:
        """Whether the failed ranks' slots must not be used again: a corrupting or slow device."""
        return self.suspect_devices or self.kind is Kind.STRAGGLER


def classify(outcomes: Sequence[RankOutcome]) -> Optional[Failure]:
    """The failure behind a step's outcomes, or None when every rank finished."""
    by = {o: [r for r in outcomes if r.outcome is o] for o in Outcome}
    died, lost, errors = by[Outcome.DIED], by[Outcome.LOST], by[Outcome.ERROR]
    if died:
        # Ranks still stuck when the others had settled cannot be trusted to join a new world.
        ranks = tuple(sorted(r.rank for r in died + lost))
        if any(not r.node_alive for r in died):
            return Failure(Kind.NODE_LOST, ranks, f"node lost with ranks {list(ranks)}")
        return Failure(Kind.CRASH, ranks, f"worker process of ranks {list(ranks)} died")
    if lost:
        ranks = tuple(sorted(r.rank for r in lost))
        why = lost[0].error or "stopped answering"
        return Failure(Kind.HANG, ranks, f"ranks {list(ranks)} stalled the step: {why}")
    if errors:
        own = [r for r in errors if not is_peer_failure(r.error)] or errors
        ranks = tuple(sorted(r.rank for r in own))
        where = f" at {own[0].where}" if own[0].where else ""
        return Failure(Kind.ERROR, ranks, f"rank {own[0].rank} raised {own[0].error}{where}", own[0].error, own[0].where)
    return None


def non_finite(losses: dict[int, float], step: int) -> Optional[Failure]:
    """A NAN failure naming the ranks whose own loss went non-finite, if any did."""
    bad = tuple(sorted(rank for rank, loss in losses.items() if not math.isfinite(loss)))
    if not bad:
        return None
    return Failure(Kind.NAN, bad, f"non-finite loss at step {step}, first on ranks {list(bad)}")


def abort_survivors(*, device: str, pending: Sequence[int], evicted: Sequence[int]) -> tuple[int, ...]:
    """The ranks to abort after ``evicted`` were killed in a stall: on CUDA every survivor still
    in the step, since a dead peer does not fail an NCCL collective (it waits out the process
    group's timeout) and NCCL has no socket to shut; on CPU none, since a killed gloo peer's
    sockets close with it and its peers' reads fail at once."""
    if device != "cuda":
        return ()
    gone = set(evicted)
    return tuple(sorted(r for r in pending if r not in gone))


@dataclass(frozen=True)
class Capacity:
    """What the cluster offers to fill lost seats right now."""

    spares: int  # warm spare workers ready to join
    free_slots: int  # worker-sized slots where a new worker could start


@dataclass(frozen=True)
class Decision:
    action: Action
    reason: str
    dp_after: int
    evict_replicas: tuple[int, ...] = ()
    spares_used: int = 0  # lost seats filled by warm spares; the rest by new workers
    skip_batch: bool = False  # after a rollback: drop the batch that poisoned the step


def decide(
    failure: Failure,
    *,
    dp: int,
    cp: int,
    min_dp: int,
    capacity: Capacity,
    recoveries: int,
    max_recoveries: int,
    on_nan: str,
    allowed_dps: Sequence[int] = (),
    repeated: str = "",
) -> Decision:
    """The recovery for ``failure`` in a dp x cp job that has already made ``recoveries``.

    ``allowed_dps``: the replica counts the global batch divides into (all when empty); a
    shrink lands on the largest of them that the surviving replicas can run. ``repeated``: why
    the failure is deterministic (``policies.repeats``): then it is not retried.
    """
    if repeated:
        return Decision(Action.ABORT, repeated, dp)
    if recoveries >= max_recoveries:
        return Decision(Action.ABORT, f"controllers.max_recoveries={max_recoveries} recoveries already made", dp)
    if failure.kind is Kind.NAN:
        if on_nan == "abort":
            return Decision(Action.ABORT, "controllers.on_nan=abort", dp)
        skip = on_nan == "skip"
        what = "skip the poisoned batch" if skip else "retry the same batch"
        reason = f"roll back to the last snapshot and {what} (controllers.on_nan={on_nan})"
        return Decision(Action.ROLLBACK, reason, dp, skip_batch=skip)
    if failure.kind is Kind.ERROR:
        return Decision(Action.ROLLBACK, "roll back to the last snapshot and retry the step in place", dp)
    if failure.kind is Kind.SDC and not failure.ranks:
        return Decision(Action.ROLLBACK, "no rank can be named: roll back to the last clean scan and scan again", dp)

    lost = len(failure.ranks)
    broken = tuple(sorted({rank // cp for rank in failure.ranks}))
    if capacity.spares >= lost:
        return Decision(Action.REPLACE, f"{lost} warm spare(s) take the lost seats", dp, spares_used=lost)
    fitting = [d for d in (allowed_dps or range(1, dp + 1)) if min_dp <= d <= dp - len(broken)]
    if fitting:
        new_dp = max(fitting)
        return Decision(
            Action.SHRINK,
            f"no warm spare for {lost} lost rank(s): evict replicas {list(broken)}, "
            f"dp {dp} -> {new_dp} (mesh.min_dp={min_dp})",
            new_dp,
            evict_replicas=broken,
        )
    if failure.kind is Kind.STRAGGLER:
        # Slow is not broken: with no spare and no shrink it keeps its seat, and only a report.
        return Decision(
            Action.REPORT, f"no warm spare and dp {dp} cannot shrink (mesh.min_dp={min_dp}): the straggler keeps its seat", dp
        )
    if capacity.spares + capacity.free_slots >= lost:
        return Decision(
            Action.REPLACE,
            f"dp {dp} cannot lose {len(broken)} replica(s) (mesh.min_dp={min_dp}): start new workers "
            f"for {lost - capacity.spares} lost seat(s)",
            dp,
            spares_used=capacity.spares,
        )
    return Decision(
        Action.ABORT,
        f"{lost} rank(s) lost, no spare or free capacity to replace them and dp {dp} cannot shrink "
        f"below mesh.min_dp={min_dp}",
        dp,
    )
