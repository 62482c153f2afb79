"""Recovery plan: what a recovery restores and from whom, who takes each seat of the new world,
which chaos faults that world keeps, and what a retry keeps. Pure.

Every world formed again is planned by one function, ``plan_recovery``: a reform after lost
ranks, a rollback in place (no rank lost, the same dp) and a grow (replicas added at a step
boundary). It reads a narrow view of the cluster (``ClusterView``): the grid of the world the
failure broke, what each place holds of the snapshots, the warm spares ready, the world's chaos
faults, and the restore point an interrupted recovery fetched. Ray's worker group answers the
view from its workers and node holders and carries the plan out (``actors.recovery``); the
simulated cluster answers it from its own state and carries it out on its clock
(``actors.simulated``), so the goodput study and the chaos replay recover by the product's own
rules:

- restore: the newest step at or before the one asked for whose every rank's shard some place
  holds, each shard from the cheapest place (``policies.snapshots.plan_restore``); step 0 is the
  initial state, which forming a world builds (the job's seeded or pretrained weights, the data
  at its start), so a run that began there goes back to it when it failed before its first
  snapshot was due. A resumed run began at the step its checkpoint held: every rank keeps
  that state as a snapshot, and without it whole there is no way back. A lost rank's own memory
  is read only when it is alive with a state to trust (``evicted_alive``: a straggler's).
- retry: a recovery asked for the step an interrupted recovery fetched (a worker died while the
  new world formed) reads the shards that recovery fetched, while every one is still readable:
  the world it was forming may already have overwritten its holders' copies of that step. It
  meets no crash_restoring fault (its first attempt took them).
- seats: ``policies.elastic.reseat``; the empty seats go to warm spares first (as many as the
  decision took and are ready), then to new workers.
- chaos: a new world's job keeps the step faults due after the step the failure was seen in (a
  replacement does not meet those already due) and the crash_restoring faults still waiting.
- nodes: a node found gone takes every rank on it, whatever that rank's own call reported
  (``node_losses``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Iterable, Optional, Protocol, Sequence

from ringtrain.chaos import RESTORING_FAULT, FaultPlan, FaultSpec
from ringtrain.errors import RingtrainError
from ringtrain.policies.elastic import evicted, reseat
from ringtrain.policies.faults import Outcome, RankOutcome
from ringtrain.policies.snapshots import Holding, Location, RestorePlan, plan_restore
from ringtrain.topology import Topology


class RecoveryError(RingtrainError):
    """No way back: no whole snapshot to resume from, or the new world could not form."""


# --- nodes ---------------------------------------------------------------------------------


def nodes_to_check(outcomes: Sequence[RankOutcome], *, node_of: Sequence[str]) -> list[str]:
    """The nodes whose liveness a failed step puts in question: those of the ranks whose
    process died, each once, in rank order."""
    return list(dict.fromkeys(node_of[o.rank] for o in outcomes if o.outcome is Outcome.DIED))


def node_losses(outcomes: Sequence[RankOutcome], *, node_of: Sequence[str], gone: Iterable[str]) -> list[RankOutcome]:
    """``outcomes`` with every rank on a node in ``gone`` dead with its node, whatever that
    rank's own call reported (``node_of``: each rank's node)."""
    lost = set(gone)
    return [
        dataclasses.replace(o, outcome=Outcome.DIED, node_alive=False, error=o.error or "node lost")
        if node_of[o.rank] in lost else o
        for o in outcomes
    ]  # fmt: skip


# --- chaos ---------------------------------------------------------------------------------


def kept_by_new_world(fault: FaultSpec, *, fired_through: int) -> bool:
    """Whether a world formed after a failure seen in step ``fired_through`` keeps ``fault``:
    a step fault due later, or a crash_restoring fault (it waits for its recovery)."""
    return fault.kind == RESTORING_FAULT or fault.step > fired_through


def restoring_crashes(faults: Sequence[FaultSpec], *, fired_through: int, retry: bool, restores: bool) -> tuple[FaultSpec, ...]:
    """The crash_restoring faults that strike the recovery from a failure seen in step
    ``fired_through`` (``FaultPlan.restoring_due``): none in a retry (the first attempt took
    them) or in a recovery with no snapshot to restore (``restores``: they wait for one)."""
    return tuple(FaultPlan(list(faults)).restoring_due(fired_through)) if restores and not retry else ()


def new_world_faults(faults: Sequence[FaultSpec], *, fired_through: int, struck: Sequence[FaultSpec] = ()) -> tuple[FaultSpec, ...]:
    """The chaos faults of a new world's job: those ``kept_by_new_world``, less the ``struck``
    crash_restoring faults (``restoring_crashes``), which strike the recovery forming it."""
    return tuple(f for f in faults if all(f is not s for s in struck) and kept_by_new_world(f, fired_through=fired_through))


# --- the restore point ---------------------------------------------------------------------


def evicted_alive(*, quarantine: bool, last_step: int, fired_through: int) -> bool:
    """Whether the ranks a reform drops are alive, their state that of ``last_step``, and
    trusted: an eviction between steps (no step failed: the failure was seen in the step
    restored, ``fired_through == last_step``) of ranks whose slots are quarantined is a
    straggler's, slow but right. A rank evicted for corrupting data is never read: its scan
    failed in a step after the restore point (the last clean scan), so ``fired_through`` is
    later; nor is a rank of a failed step (died, stalled), nor one of a world that broke while
    it formed (its slot is reused)."""
    return quarantine and fired_through == last_step


@dataclass(frozen=True)
class Fetched:
    """The restore point a recovery fetched before the old world was left: the newest step it
    was asked for, and the shards' plan (None: the initial state)."""

    newest: int
    restore: Optional[RestorePlan]


class ClusterView(Protocol):
    """What a recovery plan reads of the cluster: Ray's worker group answers it from its
    workers and holders (``actors.recovery``), the simulated cluster from its state."""

    @property
    def topology(self) -> Topology:
        """The grid of the world the failure broke (or, for a grow, the world running now)."""
        ...

    def holdings(self, ranks: frozenset[int]) -> Sequence[Holding]:
        """What the memories of ``ranks`` (those that answer) and the live node holders hold."""
        ...

    def ready_spares(self) -> int: ...

    def start_step(self) -> int:
        """The step the run began at: 0 (the initial state), or the step of the checkpoint a
        resume loaded."""
        ...

    def snapshot_every(self) -> int:
        """Steps between snapshots (``checkpoint.snapshot_every``; 0: none taken)."""
        ...

    def faults(self) -> Sequence[FaultSpec]:
        """The chaos faults of the current world's job."""
        ...

    def fetched(self) -> Optional[Fetched]:
        """The restore point fetched by a recovery whose world has not formed (None: none)."""
        ...

    def fetched_readable(self, readers: frozenset[int]) -> bool:
        """Whether every shard ``fetched`` names can still be read (``readers``: the ranks of
        the broken world whose memories a restore may read)."""
        ...


@dataclass(frozen=True)
class RecoveryPlan:
    """A world to form again: the state it restores and from whom, who takes each seat, and
    which chaos faults its job keeps and which strike its restore."""

    last_step: int  # the newest step the restore may go back to
    dp: int  # the new world's replicas
    readers: frozenset[int]  # the ranks of the broken world whose memories are read (``evicted_alive``)
    restore: Optional[RestorePlan]  # each old rank's shard and where from; None: the initial state
    retry: bool  # a recovery asked for the step an interrupted one fetched
    reused: bool  # the retry reads the shards the interrupted recovery fetched
    seats: tuple[Optional[int], ...]  # new rank -> the old rank seated there (None: a seat to fill)
    evicted: tuple[int, ...]  # old ranks alive but with no seat
    spares: int  # empty seats warm spares take
    new_workers: int  # empty seats new workers take (the workers started for a grow)
    faults: tuple[FaultSpec, ...]  # the new world's chaos faults
    crashes: tuple[FaultSpec, ...]  # crash_restoring faults that strike this recovery's restore

    @property
    def step(self) -> int:
        """The step restored (0: the initial state)."""
        return self.restore.step if self.restore is not None else 0

    @property
    def crash_ranks(self) -> frozenset[int]:
        return frozenset(f.rank for f in self.crashes)

    def to_dict(self) -> dict[str, Any]:
        """The plan as an incident records it: where each rank's shard came from, by kind of
        place (peer memory, node holder, a rebuild from a replica)."""
        sources: dict[str, list[int]] = {}
        for rank, where in self.restore.fetch if self.restore is not None else ():
            sources.setdefault(Location.parse(where).kind, []).append(rank)
        return {
            "restore_step": self.step,
            "sources": sources,
            "seats": list(self.seats),
            "spares": self.spares,
            "new_workers": self.new_workers,
            "retry": self.retry,
            "reused": self.reused,
            "crash_restoring": sorted(self.crash_ranks),
            "faults": [f"{f.kind} rank {f.rank} step {f.step}" for f in self.faults],
        }


def plan_recovery(
    view: ClusterView,
    *,
    last_step: int,
    lost: frozenset[int] = frozenset(),
    new_dp: Optional[int] = None,
    spares: int = 0,
    fired_through: Optional[int] = None,
    quarantine: bool = False,
    grow: bool = False,
) -> RecoveryPlan:
    """The world to form after dropping ``lost`` ranks: ``new_dp`` replicas (default: the
    same), up to ``spares`` warm spares in the empty seats, resuming from the newest whole
    snapshot at or before ``last_step`` (0: the initial state; also for a run that began there
    and failed before its first snapshot was due).

    ``fired_through``: the step the failure was seen in (default ``last_step + 1``): chaos
    faults due by then have fired. ``quarantine``: the lost ranks' slots are never reused (their
    devices corrupted data, or are slow). ``grow``: replicas added at the step boundary after
    ``last_step``, which must restore that very step; no failure, so no retry and no
    crash_restoring fault. Raises RecoveryError when there is no way back: no whole snapshot
    where one was taken (or a resumed run's own step is not whole), or a grow none of
    ``last_step``."""
    topo = view.topology
    fired = last_step + 1 if fired_through is None else fired_through
    read_lost = evicted_alive(quarantine=quarantine, last_step=last_step, fired_through=fired)
    readers = frozenset(range(topo.world_size)) - (frozenset() if read_lost else lost)
    fetched = None if grow else view.fetched()
    retry = fetched is not None and fetched.newest == last_step
    reused = retry and view.fetched_readable(readers)
    restore = fetched.restore if fetched is not None and reused else _restore_point(view, readers, newest=last_step)
    if grow and (restore.step if restore is not None else 0) != last_step:
        raise RecoveryError(f"the snapshot of step {last_step} is not whole; cannot grow at this step")
    dp = topo.dp if new_dp is None else new_dp
    seats = reseat(dp=topo.dp, cp=topo.cp, lost=lost, new_dp=dp)
    empty = seats.count(None)
    from_spares = min(spares, empty, view.ready_spares()) if spares and empty and not grow else 0
    crashes = () if grow else restoring_crashes(view.faults(), fired_through=fired, retry=retry, restores=restore is not None)
    return RecoveryPlan(
        last_step=last_step,
        dp=dp,
        readers=readers,
        restore=restore,
        retry=retry,
        reused=reused,
        seats=tuple(seats),
        evicted=tuple(evicted(dp=topo.dp, cp=topo.cp, seats=seats, lost=lost)),
        spares=from_spares,
        new_workers=empty - from_spares,
        faults=new_world_faults(view.faults(), fired_through=fired, struck=crashes),
        crashes=crashes,
    )


def _restore_point(view: ClusterView, readers: frozenset[int], *, newest: int) -> Optional[RestorePlan]:
    """The newest whole snapshot at or before ``newest`` in what ``readers``' memories and the
    node holders hold; None for step 0 (the initial state: nothing to read), which a run that
    began there goes back to when it failed before its first snapshot was due. Snapshots taken
    and lost since (a node gone without its buddy's copy) end the run, its durable checkpoints
    kept: going back to step 0 would train every step again."""
    if not newest:
        return None
    holdings = view.holdings(readers)
    plan = plan_restore(holdings, newest=newest)
    if plan is not None:
        return plan
    start, every = view.start_step(), view.snapshot_every()
    if not start and 0 < every and newest < every:
        return None  # failed before its first snapshot was due: nothing was taken, nothing is lost going back
    since = f", not even of step {start}, which the run resumed from" if start else ""
    raise RecoveryError(
        f"no snapshot at or before step {newest} is whole in the survivors' memory or the node holders{since} "
        f"(checkpoint.snapshot_every sets how often one is taken); held: {held(holdings)}"
    )


def held(holdings: Sequence[Holding]) -> str:
    """What each place holds, for an error message: ``peer:0 {3: [0]}; node:ab12 {2: [0, 1]}``."""
    parts = []
    for h in holdings:
        by_step: dict[int, list[int]] = {}
        for step, rank in sorted(h.shards):
            by_step.setdefault(step, []).append(rank)
        parts.append(f"{h.location[:13]} {by_step}")
    return "; ".join(parts) or "nothing"
