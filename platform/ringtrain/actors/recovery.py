"""Recovery: carries out a fault or elastic decision on the WorkerGroup.

Survivors keep their processes. The state of the step to resume from is gathered before anyone
leaves the old world: each survivor's own shard from its memory, a lost rank's shard from a
node holder (its own node's, or the buddy node's when its node is gone), picked by
``policies.snapshots.plan_restore``. Then the new world forms (survivors, warm spares and
new workers join one process group) and every rank loads the snapshot resharded to the new dp.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Any, Optional, Union

from ringtrain.actors.group import Member, StepResult, WorkerGroup
from ringtrain.actors.protocols import Reform
from ringtrain.chaos import RESTORING_FAULT, FaultPlan, FaultSpec
from ringtrain.config import ChaosConfig, JobConfig
from ringtrain.policies.elastic import evicted, reseat
from ringtrain.policies.faults import Capacity, Outcome, RankOutcome
from ringtrain.policies.snapshots import REBUILD, Holding, RestorePlan, Source, plan_restore
from ringtrain.errors import RingtrainError

log = logging.getLogger(__name__)


class RecoveryError(RingtrainError):
    """No way back: no whole snapshot to resume from, or the new world could not form."""


@dataclass(frozen=True)
class Resumed:
    step: int  # the step training continues after
    dp: int
    spares_used: int
    new_workers: int
    phases: dict[str, float]  # seconds per phase: plan (find and fetch the state), warm, join, restore
    seats: tuple[Optional[int], ...] = ()  # new rank -> the old rank seated there (None: a new worker)


# Who serves a shard of a restore plan: a surviving worker, or a node's holder (by node id).
Producer = Union[Member, str]


def producers(plan: RestorePlan, survivors: dict[int, Member]) -> list[Producer]:
    """The worker or node holder serving each of ``plan.fetch``'s shards, in its order."""
    out: list[Producer] = []
    for _, where in plan.fetch:
        kind, _, name = where.partition(":")
        if kind == "peer":
            out.append(survivors[int(name)])
        elif kind == REBUILD:
            out.append(survivors[int(name.partition(":")[2])])
        else:
            out.append(name)
    return out


def world_job(job: JobConfig, *, dp: int, fired_through: int, restoring: tuple[FaultSpec, ...] = ()) -> JobConfig:
    """The job for a world of ``dp`` replicas: the step faults due at or before
    ``fired_through`` (the step that failed) are dropped, so a replacement does not meet them
    again, and so are the ``restoring`` faults (those that strike the recovery forming this
    world: ``restoring_crashes``); the other crash_restoring faults wait for their recovery."""
    faults = [
        f
        for f in job.chaos.faults
        if all(f is not r for r in restoring) and (f.kind == RESTORING_FAULT or f.step > fired_through)
    ]
    return dataclasses.replace(job, mesh=dataclasses.replace(job.mesh, dp=dp), chaos=ChaosConfig(faults=faults))


def restoring_crashes(job: JobConfig, *, fired_through: int, retry: bool, restores: bool) -> tuple[FaultSpec, ...]:
    """The crash_restoring faults of ``job`` that strike the recovery from a failure seen in
    step ``fired_through`` (``FaultPlan.restoring_due``): none in a retry (the first attempt
    took them) or in a recovery with no snapshot to restore (``restores``: they wait for one)."""
    return tuple(FaultPlan(job.chaos.faults).restoring_due(fired_through)) if restores and not retry else ()


def evicted_alive(*, quarantine: bool, last_step: int, fired_through: int) -> bool:
    """Whether the ranks a reform drops are alive, their state that of ``last_step``, and
    trusted: an eviction between steps (no step failed: the failure was seen in the step
    restored, ``fired_through == last_step``) of ranks whose slots are quarantined is a
    straggler's, slow but right. A rank evicted for corrupting data is never read: its scan
    failed in a step after the restore point (the last clean scan), so ``fired_through`` is
    later; nor is a rank of a failed step (died, stalled), nor one of a world that broke while
    it formed (its slot is reused)."""
    return quarantine and fired_through == last_step


class Recovery:
    def __init__(self, group: WorkerGroup) -> None:
        self.group = group
        self._growth_workers = 0  # workers the growth being prepared needs (0: none prepared)
        # The restore point of a recovery whose new world has not formed yet: (newest step asked
        # for, pending shards, who holds each one's only copy). Fetched before the old world was
        # left, so a retry after a worker died while joining or restoring reads the same state
        # (policies.retries), as long as those holders live.
        self._unfinished: Optional[tuple[int, Optional[list[Any]], list[Producer]]] = None

    def layout(self) -> dict[str, Any]:
        return self.group.layout()

    # --- what happened -------------------------------------------------------------------

    def assess(self, failure: StepResult) -> list[RankOutcome]:
        """The step's outcomes, with each dead rank's node checked; a node found gone takes
        every rank on it, whatever that rank's own call reported."""
        g = self.group
        node_of = {rank: (m.info.node_id if m.info else "") for rank, m in enumerate(g.members)}
        alive: dict[str, bool] = {}
        for o in failure.outcomes:
            node = node_of[o.rank]
            if o.outcome is Outcome.DIED and node not in alive:
                alive[node] = g.node_alive(node)
                if not alive[node]:
                    g.forget_node(node)  # its holder and its slots went with it
        out = []
        for o in failure.outcomes:
            if alive.get(node_of[o.rank], True) is False:
                o = dataclasses.replace(o, outcome=Outcome.DIED, node_alive=False, error=o.error or "node lost")
            out.append(o)
        return out

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
                    f"peer:{rank}",
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
            holdings.append(Holding(Source.NODE, f"node:{node}", shards, worlds))
        return holdings

    def _fetch(self, plan: RestorePlan, survivors: dict[int, Member]) -> list[Any]:
        """Pending shards of ``plan``'s step, in rank order; waits until every one exists, so
        the survivors may leave their world (and its memory) afterwards."""
        import ray

        refs = []
        for (rank, where), producer in zip(plan.fetch, producers(plan, survivors)):
            kind = where.partition(":")[0]
            if kind == "peer":
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

    def restore_point(self, survivors: dict[int, Member], *, newest: int) -> tuple[RestorePlan, list[Any]]:
        holdings = self._holdings(survivors)
        plan = plan_restore(holdings, newest=newest)
        if plan is None:
            raise RecoveryError(
                f"no snapshot at or before step {newest} is whole in the survivors' memory or the node holders "
                f"(checkpoint.snapshot_every={self.group.job.checkpoint.snapshot_every}); held: {_held(holdings)}"
            )
        log.info("restoring step %d from %s", plan.step, ", ".join(f"rank {r}: {where}" for r, where in plan.fetch))
        return plan, self._fetch(plan, survivors)

    # --- actions -------------------------------------------------------------------------

    def reform(self, request: Reform) -> Resumed:
        """Carry out ``request`` (``Reform`` says what it asks).

        Lost ranks that are alive with a state to trust (``evicted_alive``: a straggler's) are
        stopped only once the restore point is fetched: their own newest shards count, so the
        step they finished is not redone while its copy is still on the way to the holders."""
        lost, new_dp, spares, last_step = request.lost, request.new_dp, request.spares, request.last_step
        quarantine, fired = request.quarantine, request.fired
        g = self.group
        topo = g.topology
        old = list(g.members)
        doomed = [old[r] for r in sorted(lost)]
        readable = evicted_alive(quarantine=quarantine, last_step=last_step, fired_through=fired)
        if not readable:
            self._drop(doomed, quarantine=quarantine)
        survivors = {r: m for r, m in enumerate(old) if r not in lost}
        t0 = time.monotonic()
        retry, shards = self._restore_shards(dict(enumerate(old)) if readable else survivors, last_step)
        plan_s = time.monotonic() - t0
        if readable:
            self._drop(doomed, quarantine=quarantine)

        seats = reseat(dp=topo.dp, cp=topo.cp, lost=lost, new_dp=new_dp)
        g.kill([old[r] for r in evicted(dp=topo.dp, cp=topo.cp, seats=seats, lost=lost)])
        taken = g.ready_spares()[: min(spares, seats.count(None))]
        g.take_spares(taken)
        fill = taken + g.spawn(seats.count(None) - len(taken))
        members = [old[r] if r is not None else fill.pop(0) for r in seats]

        crashes = restoring_crashes(g.job, fired_through=fired, retry=retry, restores=shards is not None)
        job = world_job(g.job, dp=new_dp, fired_through=fired, restoring=crashes)
        step = g.form_world(members, job, snapshot=shards, crash_restoring=frozenset(f.rank for f in crashes))
        self._unfinished = None
        g.release_unused_placement()
        self._forget_after(step)
        return Resumed(
            step, new_dp, len(taken), seats.count(None) - len(taken), {"plan_s": plan_s, **g.phases}, tuple(seats)
        )

    def _drop(self, members: list[Member], *, quarantine: bool) -> None:
        if quarantine:
            self.group.quarantine(members)
        else:
            self.group.kill(members)  # slots on live nodes are reused

    def _restore_shards(self, survivors: dict[int, Member], last_step: int) -> tuple[bool, Optional[list[Any]]]:
        """Whether this is a retry, and the pending shards of the newest whole snapshot at or
        before ``last_step`` (None: the initial state). A retry of an unfinished recovery
        reuses the shards that recovery fetched: the world it was forming may already have
        overwritten its holders' copies of that step with its own."""
        retry = self._unfinished is not None and self._unfinished[0] == last_step
        if self._unfinished is not None and retry:
            _, shards, sources = self._unfinished
            made = produced(shards) if shards is not None else []
            if all(ok and self._readable(source, survivors) for ok, source in zip(made, sources)):
                return True, shards
            # A fetched shard lives only in its producer's node (an actor call's result is not
            # re-run): when a call failed or such a node is gone, the shards are read again from
            # what is left.
            log.info("a shard of the interrupted recovery is lost: planning step %d's restore again", last_step)
        shards, sources = None, []
        if last_step:
            plan, shards = self.restore_point(survivors, newest=last_step)
            sources = producers(plan, survivors) if plan is not None else []
        self._unfinished = (last_step, shards, sources)
        return retry, shards

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

    def grow(self, *, new_dp: int, last_step: int) -> Resumed:
        """Add the prepared replicas at the step boundary after ``last_step``: every worker, old
        and new, loads ``last_step``'s snapshot resharded to ``new_dp``."""
        g = self.group
        topo = g.topology
        old = list(g.members)
        t0 = time.monotonic()
        plan, shards = self.restore_point(dict(enumerate(old)), newest=last_step)
        plan_s = time.monotonic() - t0
        if plan.step != last_step:
            raise RecoveryError(f"the snapshot of step {last_step} is not whole; cannot grow at this step")
        seats = reseat(dp=topo.dp, cp=topo.cp, lost=frozenset(), new_dp=new_dp)
        fill = g.take_growing(seats.count(None))
        self._growth_workers = 0
        members = [old[r] if r is not None else fill.pop(0) for r in seats]
        step = g.form_world(members, world_job(g.job, dp=new_dp, fired_through=last_step), snapshot=shards)
        return Resumed(step, new_dp, 0, seats.count(None), {"plan_s": plan_s, **g.phases}, tuple(seats))

    # --- in place ----------------------------------------------------------------------

    def skip_batch(self, batch: int) -> range:
        """Every rank, and every worker that joins later, passes over data batch ``batch``;
        returns its global samples."""
        g = self.group
        g.call_all("skip_batch", batch)
        train = g.job.train
        g.job = dataclasses.replace(g.job, train=dataclasses.replace(train, skip_batches=[*train.skip_batches, batch]))
        return range(batch * train.global_batch, (batch + 1) * train.global_batch)

    def rollback(self, *, last_step: int, rejoin: bool, fired_through: Optional[int] = None) -> int:
        """Same workers, state of the newest whole snapshot at or before ``last_step`` (0: the
        initial state); with ``rejoin`` the process group is rebuilt first (a failed collective
        may have broken it). ``fired_through`` as for ``reform``."""
        g = self.group
        members = list(g.members)
        retry, shards = self._restore_shards(dict(enumerate(members)), last_step)
        fired = last_step + 1 if fired_through is None else fired_through
        crashes = restoring_crashes(g.job, fired_through=fired, retry=retry, restores=shards is not None)
        job = world_job(g.job, dp=g.topology.dp, fired_through=fired, restoring=crashes)
        crashing = frozenset(f.rank for f in crashes)
        if shards is None:  # back to the initial state, which joining a world builds
            step = g.form_world(members, job)
        elif rejoin:
            step = g.form_world(members, job, snapshot=shards, crash_restoring=crashing)
        else:
            g.job = job  # the same world: only the faults that fired leave its job
            step = g.restore_refs(shards, crash_restoring=crashing)
        self._unfinished = None
        self._forget_after(step)
        return step

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


def _held(holdings: list[Holding]) -> str:
    """What each place holds, for an error message: ``peer:0 {3: [0]}; node:ab12 {2: [0, 1]}``."""
    parts = []
    for h in holdings:
        by_step: dict[int, list[int]] = {}
        for step, rank in sorted(h.shards):
            by_step.setdefault(step, []).append(rank)
        parts.append(f"{h.location[:13]} {by_step}")
    return "; ".join(parts) or "nothing"


def _get_or(ref: Any, default: Any, timeout: float) -> Any:
    import ray

    try:
        return ray.get(ref, timeout=timeout)
    except Exception:  # the actor is gone or does not answer: it holds nothing we can use
        return default
