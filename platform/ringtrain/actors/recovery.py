"""Recovery: carries out a recovery plan (``policies.recovery``) on the WorkerGroup.

The plan is computed from the group's view of the cluster (``GroupView``): what each survivor's
memory and each node holder holds of the snapshots, the warm spares ready, the job's chaos
faults, and the restore point a recovery interrupted by a second failure fetched. Survivors
keep their processes. The state of the step to resume from is fetched before anyone leaves the
old world: each survivor's own shard from its memory, a lost rank's shard from a node holder
(its own node's, or the buddy node's when its node is gone). Then the new world forms
(survivors, warm spares and new workers join one process group, in the seats the plan gives
them) and every rank loads the snapshot resharded to the new dp. The simulated cluster
(``actors.simulated``) carries out the same plans.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Union

from ringtrain.actors.group import Member, StepResult, WorkerGroup
from ringtrain.actors.protocols import Reform, Reformed
from ringtrain.chaos import FaultSpec
from ringtrain.config import ChaosConfig, JobConfig
from ringtrain.policies.faults import Capacity, RankOutcome
from ringtrain.policies.recovery import (
    Fetched, RecoveryError, RecoveryPlan, evicted_alive, node_losses, nodes_to_check, plan_recovery,
)  # fmt: skip
from ringtrain.policies.snapshots import NODE, PEER, REBUILD, Holding, Location, RestorePlan, Source, node_at, peer_at
from ringtrain.topology import Topology

log = logging.getLogger(__name__)

__all__ = ["GroupView", "Recovery", "RecoveryError", "evicted_alive", "produced", "producers"]


# Who serves a shard of a restore plan: a surviving worker, or a node's holder (by node id).
Producer = Union[Member, str]


def producers(plan: RestorePlan, survivors: dict[int, Member]) -> list[Producer]:
    """The worker or node holder serving each of ``plan.fetch``'s shards, in its order."""
    out: list[Producer] = []
    for _, where in plan.fetch:
        place = Location.parse(where)
        out.append(place.name if place.kind == NODE else survivors[place.rank])
    return out


def world_job(job: JobConfig, plan: RecoveryPlan) -> JobConfig:
    """The job of the world ``plan`` forms: its dp, and the chaos faults it keeps."""
    return dataclasses.replace(job, mesh=dataclasses.replace(job.mesh, dp=plan.dp), chaos=ChaosConfig(faults=list(plan.faults)))


@dataclass(frozen=True)
class Unfinished:
    """The restore point of a recovery whose new world has not formed yet, fetched before the
    old world was left: its plan, the pending shards, and who holds each one's only copy."""

    fetched: Fetched
    shards: Optional[list[Any]]
    sources: list[Producer]


class GroupView:
    """The WorkerGroup as a recovery plan reads it (``policies.recovery.ClusterView``): the
    members of the world the failure broke, what they and the node holders hold."""

    def __init__(self, recovery: "Recovery", members: Sequence[Member]) -> None:
        self._recovery = recovery
        self._members = members

    @property
    def topology(self) -> Topology:
        return self._recovery.group.topology

    def readers(self, ranks: frozenset[int]) -> dict[int, Member]:
        return {r: self._members[r] for r in sorted(ranks)}

    def holdings(self, ranks: frozenset[int]) -> list[Holding]:
        return self._recovery._holdings(self.readers(ranks))

    def ready_spares(self) -> int:
        return len(self._recovery.group.ready_spares())

    def start_step(self) -> int:
        return self._recovery.group.start_step

    def snapshot_every(self) -> int:
        return self._recovery.group.job.checkpoint.snapshot_every

    def faults(self) -> list[FaultSpec]:
        return self._recovery.group.job.chaos.faults

    def fetched(self) -> Optional[Fetched]:
        unfinished = self._recovery._unfinished
        return unfinished.fetched if unfinished is not None else None

    def fetched_readable(self, ranks: frozenset[int]) -> bool:
        """Whether every shard the interrupted recovery fetched still exists. A fetched shard
        lives only in its producer's node (an actor call's result is not re-run): a call that
        failed, or a producer's node found gone, means the shards are read again."""
        unfinished = self._recovery._unfinished
        if unfinished is None:
            return False
        made = produced(unfinished.shards) if unfinished.shards is not None else []
        readers = self.readers(ranks)
        return all(ok and self._recovery._readable(source, readers) for ok, source in zip(made, unfinished.sources))


class Recovery:
    def __init__(self, group: WorkerGroup) -> None:
        self.group = group
        self._growth_workers = 0  # workers the growth being prepared needs (0: none prepared)
        # A retry after a worker died while joining or restoring reads the same state
        # (policies.recovery), as long as its holders live.
        self._unfinished: Optional[Unfinished] = None

    def layout(self) -> dict[str, Any]:
        return self.group.layout()

    # --- what happened -------------------------------------------------------------------

    def assess(self, failure: StepResult) -> list[RankOutcome]:
        """The step's outcomes, with each dead rank's node checked; a node found gone takes
        every rank on it (``policies.recovery.node_losses``), and its holder and slots go."""
        g = self.group
        node_of = [m.info.node_id if m.info else "" for m in g.members]
        gone = [node for node in nodes_to_check(failure.outcomes, node_of=node_of) if not g.node_alive(node)]
        for node in gone:
            g.forget_node(node)
        return node_losses(failure.outcomes, node_of=node_of, gone=gone)

    def capacity(self, lost: tuple[int, ...], *, reuse_slots: bool = True) -> Capacity:
        """Warm spares ready now, and slots a new worker could start in: the cluster's free
        capacity plus (with ``reuse_slots``) the lost ranks' own slots on nodes still up."""
        g = self.group
        own = sum(1 for rank in lost if g.on_live_node(g.members[rank])) if reuse_slots else 0
        return Capacity(spares=len(g.ready_spares()), free_slots=g.free_capacity() + own)

    # --- where the state comes from ------------------------------------------------------

    def _holdings(self, survivors: dict[int, Member]) -> list[Holding]:
        world = self.group.topology.world_size
        timeout = self.group.job.controllers.heartbeat_timeout_s
        holdings = []
        peer_refs = {rank: m.handle.snapshot_steps.remote() for rank, m in survivors.items()}
        job = self.group.job
        rebuild = job.zero.stage == 0 and job.controllers.rebuild_from_replicas
        rebuild_refs = {rank: m.handle.rebuildable.remote() for rank, m in survivors.items()} if rebuild else {}
        holder_refs = {node: h.inventory.remote() for node, h in self.group.holders.items()}
        for rank, ref in peer_refs.items():
            steps = _get_or(ref, [], timeout)
            live = _get_or(rebuild_refs[rank], None, timeout) if rank in rebuild_refs else None
            holdings.append(
                Holding(
                    Source.PEER,
                    peer_at(rank),
                    frozenset((s, rank) for s in steps),
                    tuple((s, world) for s in steps),
                    rebuilds=(tuple(live),) if live else (),
                )
            )
        for node, ref in holder_refs.items():
            inventory = _get_or(ref, None, timeout)
            if inventory is None:  # the node went with its holder
                self.group.forget_node(node)
                continue
            shards = frozenset((step, r) for step, (_, ranks) in inventory.items() for r in ranks)
            worlds = tuple((step, w) for step, (w, _) in inventory.items())
            holdings.append(Holding(Source.NODE, node_at(node), shards, worlds))
        return holdings

    def _fetch(self, plan: RestorePlan, survivors: dict[int, Member]) -> list[Any]:
        """Pending shards of ``plan``'s step, in rank order; waits until every one exists, so
        the survivors may leave their world (and its memory) afterwards."""
        import ray

        refs = []
        for (rank, where), producer in zip(plan.fetch, producers(plan, survivors)):
            kind = Location.parse(where).kind
            if kind == PEER:
                refs.append(producer.handle.snapshot_blob.remote(plan.step))
            elif kind == REBUILD:
                refs.append(producer.handle.rebuild_shard.remote(rank, plan.step))
            else:
                refs.append(self.group.holders[producer].get.remote(rank, plan.step))
        timeout = self.group.job.controllers.start_timeout_s
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout, fetch_local=False)
        if len(ready) < len(refs):
            raise RecoveryError(f"the shards of snapshot step {plan.step} could not be read within {timeout:g} s")
        return refs

    def _plan(self, members: list[Member], **order: Any) -> tuple[RecoveryPlan, Optional[list[Any]]]:
        """The plan of a world to form from ``members`` (``policies.recovery.plan_recovery``
        with ``order``), and the pending shards of its restore point (None: the initial state),
        fetched unless a retry reuses those the interrupted recovery fetched."""
        view = GroupView(self, members)
        plan = plan_recovery(view, **order)
        if plan.reused and self._unfinished is not None:
            return plan, self._unfinished.shards
        if plan.retry:
            log.info("a shard of the interrupted recovery is lost: planning step %d's restore again", plan.last_step)
        if plan.restore is None:
            return plan, None
        readers = view.readers(plan.readers)
        log.info("restoring step %d from %s", plan.step, ", ".join(f"rank {r}: {where}" for r, where in plan.restore.fetch))
        return plan, self._fetch(plan.restore, readers)

    def _begin(self, plan: RecoveryPlan, shards: Optional[list[Any]], members: list[Member]) -> None:
        """Keep the restore point of the world about to form, for a retry should it break (a
        retry that reuses the interrupted recovery's keeps that one's)."""
        if plan.reused:
            return
        sources = producers(plan.restore, GroupView(self, members).readers(plan.readers)) if plan.restore is not None else []
        self._unfinished = Unfinished(Fetched(plan.last_step, plan.restore), shards, sources)

    # --- actions -------------------------------------------------------------------------

    def reform(self, request: Reform) -> Reformed:
        """Carry out ``request`` (``Reform`` says what it asks): the world
        ``policies.recovery.plan_recovery`` plans for it.

        Lost ranks that are alive with a state to trust (``evicted_alive``: a straggler's) are
        stopped only once the restore point is fetched: their own newest shards count, so the
        step they finished is not redone while its copy is still on the way to the holders."""
        lost, new_dp, spares, last_step = request.lost, request.new_dp, request.spares, request.last_step
        quarantine, fired = request.quarantine, request.fired
        g = self.group
        old = list(g.members)
        doomed = [old[r] for r in sorted(lost)]
        readable = evicted_alive(quarantine=quarantine, last_step=last_step, fired_through=fired)
        if not readable:
            self._drop(doomed, quarantine=quarantine)
        t0 = time.monotonic()
        plan, shards = self._plan(
            old, lost=lost, new_dp=new_dp, spares=spares, last_step=last_step, fired_through=fired, quarantine=quarantine
        )
        plan_s = time.monotonic() - t0
        self._begin(plan, shards, old)
        if readable:
            self._drop(doomed, quarantine=quarantine)

        g.kill([old[r] for r in plan.evicted])
        taken = g.ready_spares()[: plan.spares]
        g.take_spares(taken)
        new = g.spawn(plan.spares + plan.new_workers - len(taken))
        fill = taken + new
        members = [old[r] if r is not None else fill.pop(0) for r in plan.seats]
        step = g.form_world(members, world_job(g.job, plan), snapshot=shards, crash_restoring=plan.crash_ranks)
        self._unfinished = None
        g.release_unused_placement()
        self._forget_after(step)
        return Reformed(step, {"plan_s": plan_s, **g.phases}, plan.seats, plan)

    def _drop(self, members: list[Member], *, quarantine: bool) -> None:
        if quarantine:
            self.group.quarantine(members)
        else:
            self.group.kill(members)  # slots on live nodes are reused

    def _readable(self, producer: Producer, survivors: dict[int, Member]) -> bool:
        """Whether the shard ``producer`` served is still readable. A finished call's result
        stays in its node's object store after the process that made it dies, so a worker's
        shard outlives the worker while its node is known to live."""
        g = self.group
        if isinstance(producer, str):
            return producer in g.holders  # a node's holder, dropped once found dead
        return any(producer is m for m in survivors.values()) or g.on_known_live_node(producer)

    def cordon(self, ranks: tuple[int, ...]) -> None:
        """Place nothing new on the nodes of ``ranks`` (evicted whole for corrupting data)."""
        g = self.group
        infos = [g.members[r].info for r in ranks]
        g.cordon({info.node_id for info in infos if info is not None and info.node_id})

    # --- growth --------------------------------------------------------------------------

    def growth_capacity(self) -> int:
        """Workers that could start now beyond the spares the job keeps."""
        g = self.group
        return max(0, g.free_capacity() - max(0, g.job.mesh.spares - len(g.spares)))

    def prepare_growth(self, replicas: int) -> None:
        """Start the workers of ``replicas`` more replicas (those already starting count); they
        warm up while training goes on."""
        g = self.group
        self._growth_workers = replicas * g.topology.cp
        g.add_growing(max(0, self._growth_workers - len(g.growing)))

    def growth_ready(self) -> bool:
        """Whether the prepared workers are all warm (never waits). One that died warming up
        is replaced here, so the growth still happens, only later."""
        g = self.group
        if not g.growing and not self._growth_workers:
            return False
        ready = bool(g.growing) and g.ready(g.growing)
        missing = self._growth_workers - len(g.growing)
        if missing > 0:
            g.add_growing(missing)
            return False
        return ready

    def grow(self, *, new_dp: int, last_step: int) -> Reformed:
        """Add the prepared replicas at the step boundary after ``last_step``: every worker, old
        and new, loads ``last_step``'s snapshot resharded to ``new_dp``."""
        g = self.group
        old = list(g.members)
        t0 = time.monotonic()
        plan, shards = self._plan(old, last_step=last_step, new_dp=new_dp, fired_through=last_step, grow=True)
        plan_s = time.monotonic() - t0
        fill = g.take_growing(plan.new_workers)
        self._growth_workers = 0
        members = [old[r] if r is not None else fill.pop(0) for r in plan.seats]
        step = g.form_world(members, world_job(g.job, plan), snapshot=shards)
        return Reformed(step, {"plan_s": plan_s, **g.phases}, plan.seats, plan)

    # --- in place ----------------------------------------------------------------------

    def skip_batch(self, batch: int) -> range:
        """Every rank, and every worker that joins later, passes over data batch ``batch``;
        returns its global samples."""
        g = self.group
        g.call_all("skip_batch", batch)
        train = g.job.train
        g.job = dataclasses.replace(g.job, train=dataclasses.replace(train, skip_batches=[*train.skip_batches, batch]))
        return range(batch * train.global_batch, (batch + 1) * train.global_batch)

    def rollback(self, *, last_step: int, rejoin: bool, fired_through: Optional[int] = None) -> Reformed:
        """Same workers, state of the newest whole snapshot at or before ``last_step`` (0: the
        initial state); with ``rejoin`` the process group is rebuilt first (a failed collective
        may have broken it). ``fired_through`` as for ``reform``."""
        g = self.group
        members = list(g.members)
        t0 = time.monotonic()
        plan, shards = self._plan(members, last_step=last_step, fired_through=fired_through)
        plan_s = time.monotonic() - t0
        self._begin(plan, shards, members)
        job = world_job(g.job, plan)
        if shards is None:  # back to the initial state, which joining a world builds
            step = g.form_world(members, job)
        elif rejoin:
            step = g.form_world(members, job, snapshot=shards, crash_restoring=plan.crash_ranks)
        else:
            g.job = job  # the same world: only the faults that fired leave its job
            step = g.restore_refs(shards, crash_restoring=plan.crash_ranks)
        self._unfinished = None
        self._forget_after(step)
        return Reformed(step, {"plan_s": plan_s}, plan.seats, plan)

    def _forget_after(self, step: int) -> None:
        """Snapshots newer than ``step`` describe a future that was rolled back."""
        for holder in self.group.holders.values():
            holder.drop_after.remote(step)

    def spares_changed(self) -> bool:
        """Whether a spare finished warming up, or died doing so, since the last call (never
        waits). A dead one is replaced at once (in its freed slot), so the job keeps its
        ``mesh.spares``; this runs between steps, never inside a recovery."""
        g = self.group
        before = (len(g.spares), sum(1 for s in g.spares if s.info is not None))
        g.ready(g.spares)
        if len(g.spares) < before[0]:
            self.replenish_spares(g.job.mesh.spares)
            return True
        return sum(1 for s in g.spares if s.info is not None) != before[1]

    def replenish_spares(self, target: int) -> None:
        """Start spares in the background until ``target`` exist (free slots first)."""
        g = self.group
        missing = target - len(g.spares)
        if missing > 0 and g.free_slots:
            g.add_spares(min(missing, len(g.free_slots)))


# A call that raised holds its error in its result's place: a pickled exception, well under this.
_ERROR_SIZE_LIMIT = 1 << 20


def produced(refs: list[Any]) -> list[bool]:
    """Whether each call's result exists (it finished without an error), reading only results
    small enough to be an error: a call its worker's death interrupted holds no object at all;
    one that raised holds its error, which a retry must not restore again."""
    from ray.experimental import get_object_locations

    found = get_object_locations(refs)
    sizes = [found.get(ref, {}).get("object_size") for ref in refs]
    return [size is not None and (size > _ERROR_SIZE_LIMIT or _holds_value(ref)) for ref, size in zip(refs, sizes)]


def _holds_value(ref: Any) -> bool:
    import ray

    try:
        ray.get(ref, timeout=10.0)
        return True
    except Exception:  # the call's error, or a result no longer readable: either way not a shard
        return False


def _get_or(ref: Any, default: Any, timeout: float) -> Any:
    import ray

    try:
        return ray.get(ref, timeout=timeout)
    except Exception:  # the actor is gone or does not answer: it holds nothing we can use
        return default
