"""WorkerGroup: places, spawns, drives and re-forms the dp x cp TrainWorker actors.

One placement group per replica, one bundle per ring position, PACK strategy: a ring's ranks
land on one node when it fits, so the ring's P2P traffic rides the fastest links, and a
replica stays the unit that comes and goes as a whole. Every actor sits in a *slot* (a bundle
of a placement group); a slot whose actor died is reused for its replacement, so a restarted
rank lands where its ring is.

The group has no policy of its own: the Controller decides (``policies.faults`` and
``policies.elastic``), ``policies.stepwatch`` says when a rank of a step is lost or the step
stalled, and the group carries it out: ``train_step`` reports how every rank's step ended, ``form_world`` moves a set of live workers into a new world, ``spawn`` starts new
ones in the background.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Callable, Optional, TypeVar

from ringtrain.actors.cluster import worker_resources
from ringtrain.actors.holder import SnapshotHolder
from ringtrain.actors.roster import Member, Roster, Slot, WarmDeaths, settle
from ringtrain.actors.worker import TrainWorker
from ringtrain.config import JobConfig
from ringtrain.policies.faults import Outcome, RankOutcome, abort_survivors
from ringtrain.policies.hangs import RankDiagnostics, Verdict, diagnose
from ringtrain.policies.repeats import user_frame
from ringtrain.policies.stepwatch import Action, StepWatch
from ringtrain.errors import CapacityError, WorkerError
from ringtrain.status import StepReport, WorkerInfo
from ringtrain.topology import Topology

if TYPE_CHECKING:
    from ringtrain.evaluation.tally import LossTally

log = logging.getLogger(__name__)
T = TypeVar("T")
NODE_ID_LABEL = "ray.io/node-id"


class StepFailed(Exception):
    """A step did not finish on every rank; ``outcomes`` says how each rank's call ended, and
    ``verdict`` (a stall only) who stopped it and why."""

    def __init__(
        self, outcomes: list[RankOutcome], seen_at: float, seen_unix: float, verdict: Optional[dict[str, Any]] = None
    ) -> None:
        failed = [f"rank {o.rank}: {o.outcome.value} {o.error}".strip() for o in outcomes if o.outcome is not Outcome.OK]
        super().__init__(", ".join(failed))
        self.outcomes = outcomes
        self.seen_at = seen_at  # monotonic time the first failure was seen
        self.seen_unix = seen_unix
        self.verdict = verdict


class WorkerGroup:
    def __init__(self, job: JobConfig, device: str) -> None:
        self.job = job  # the job of the current world: mesh.dp follows resizes
        self.device = device
        self.roster = Roster()  # who sits where; its methods are the only writers of its lists
        self._pins = 0  # pin_snapshots calls so far
        self.placement_groups: list[Any] = []
        self.holders: dict[str, Any] = {}  # node id -> SnapshotHolder
        self.num_params = 0
        self.generation = 0  # worlds formed so far
        self.phases: dict[str, float] = {}  # how long the last world took to form, by phase
        self.startup: dict[str, float] = {}  # seconds by phase of the first world's start
        # Calls of the last world that failed still running when it was given up: waited for
        # before the next world forms, so no worker is ever asked to join twice at once.
        self._unsettled: list[Any] = []

    # --- views ---------------------------------------------------------------------------

    @property
    def members(self) -> list[Member]:
        return self.roster.members

    @members.setter
    def members(self, members: list[Member]) -> None:
        self.roster.seat(members)

    @property
    def spares(self) -> list[Member]:
        return self.roster.spares

    @spares.setter
    def spares(self, spares: list[Member]) -> None:
        self.roster.spares = spares  # as given (a test's setup); the group itself adds and takes them

    @property
    def growing(self) -> list[Member]:
        return self.roster.growing

    @property
    def free_slots(self) -> list[Slot]:
        return self.roster.free_slots

    @property
    def quarantined(self) -> list[Slot]:
        return self.roster.quarantined

    @property
    def cordoned(self) -> set[str]:
        return self.roster.cordoned

    @property
    def warm_deaths(self) -> WarmDeaths:
        return self.roster.warm_deaths

    @property
    def topology(self) -> Topology:
        return self.job.topology

    @property
    def workers(self) -> list[Any]:
        return [m.handle for m in self.members]

    @property
    def infos(self) -> list[WorkerInfo]:
        return [m.info for m in self.members if m.info is not None]

    def layout(self) -> dict[str, Any]:
        """Who is who, as written to the run directory's workers.json."""
        topo = self.topology
        return {
            "generation": self.generation,
            "dp": topo.dp,
            "cp": topo.cp,
            "workers": [
                {
                    "rank": rank,
                    "pid": m.info.pid if m.info else None,
                    "host": m.info.host if m.info else "",
                    "node_id": m.info.node_id if m.info else "",
                    "replica": topo.coord(rank).replica,
                    "ring_pos": topo.coord(rank).ring_pos,
                }
                for rank, m in enumerate(self.members)
            ],
            "spares": [
                {"pid": s.info.pid, "host": s.info.host, "node_id": s.info.node_id} for s in self.spares if s.info
            ],
        }

    # --- start ---------------------------------------------------------------------------

    def start(self) -> None:
        """Place and spawn every rank and the warm spares, then form the first world."""
        import ray
        from ray.util.placement_group import placement_group

        t0 = time.monotonic()
        bundle = worker_resources(self.job, self.device)
        topo = self.topology
        self.placement_groups = [
            placement_group([dict(bundle) for _ in range(topo.cp)], strategy="PACK", name=f"replica-{d}")
            for d in range(topo.dp)
        ]
        if self.job.mesh.spares:
            self.placement_groups.append(
                placement_group([dict(bundle) for _ in range(self.job.mesh.spares)], strategy="SPREAD", name="spares")
            )
        timeout = self.job.controllers.start_timeout_s
        ready, _ = ray.wait([pg.ready() for pg in self.placement_groups], num_returns=len(self.placement_groups), timeout=timeout)
        if len(ready) < len(self.placement_groups):
            raise CapacityError(
                "mesh.dp",
                f"only {len(ready)} of {len(self.placement_groups)} placement groups ({topo.cp} x {bundle} per replica, "
                f"mesh.spares={self.job.mesh.spares}) could be placed within controllers.start_timeout_s={timeout:g}",
            )
        t1 = time.monotonic()
        members = [
            self._spawn(Slot(self.placement_groups[r // topo.cp], r % topo.cp), rehearse=False) for r in range(topo.world_size)
        ]
        if self.job.mesh.spares:
            self.roster.add_spares([self._spawn(Slot(self.placement_groups[-1], i)) for i in range(self.job.mesh.spares)])
        t2 = time.monotonic()
        self.form_world(members, self.job)  # the spares warm up meanwhile
        # The start by phase (summary.json's startup): warm is process start and imports, join
        # the process groups with model, DeepSpeed engine and data built.
        self.startup = {"placement_s": t1 - t0, "spawn_s": t2 - t1, **self.phases}

    def _spawn(self, slot: Slot, *, rehearse: bool = True) -> Member:
        """Start a worker actor in ``slot``; it warms up in the background (see TrainWorker.warm)."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        bundle = worker_resources(self.job, self.device)
        handle = (
            ray.remote(TrainWorker)
            .options(
                num_cpus=bundle["CPU"],
                num_gpus=bundle.get("GPU", 0),
                max_concurrency=2,  # heartbeats and snapshot reads are answered while a step runs
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=slot.pg, placement_group_bundle_index=slot.index
                ),
                runtime_env={"env_vars": _worker_env(self.device)},
            )
            .remote(self.job, -1, self.device)
        )
        return Member(handle, slot, warm=handle.warm.remote(rehearse))

    def _wait_warm(self, members: list[Member], timeout: float) -> None:
        for i, m in enumerate(members):
            if m.info is None:
                m.info = self._call(m.warm, rank=i, timeout=max(0.001, timeout))
                m.warm = None

    # --- worlds --------------------------------------------------------------------------

    def form_world(
        self,
        members: list[Member],
        job: JobConfig,
        snapshot: Optional[list[Any]] = None,
        crash_restoring: frozenset[int] = frozenset(),
    ) -> int:
        """Make ``members`` ranks 0..n-1 of ``job``'s world; all join together. With ``snapshot``
        (one pending shard per rank of the snapshot's world), every rank restores it; returns the
        step restored (0 without one). ``crash_restoring``: ranks whose process exits as it
        restores (chaos: a second failure inside the recovery)."""
        timeout = self.job.controllers.start_timeout_s
        self._settle()
        self.job = job
        self.roster.seat(members)
        self.phases = {}  # filled as phases complete: a failure's phase is the first missing
        t0 = time.monotonic()
        self._wait_warm(members, timeout)
        self._start_holders()
        self.generation += 1
        t1 = time.monotonic()
        self.phases["warm_s"] = t1 - t0
        host, port = self._call(members[0].handle.create_store.remote(job.world_size), rank=0, timeout=timeout)
        counts = self._gather(
            lambda rank, w: w.join.remote(job, rank, host, port, self._holders_of(rank)), timeout, on_failure=self._abandon_join
        )
        self.num_params = counts[0]
        t2 = time.monotonic()
        self.phases["join_s"] = t2 - t1
        if snapshot is None:
            return 0
        steps = self._gather(
            lambda rank, w: w.restore.remote(*snapshot, chaos_exit=rank in crash_restoring), timeout, on_failure=self._give_up
        )
        self.phases["restore_s"] = time.monotonic() - t2
        return int(steps[0])

    def _abandon_join(self, pending: list[Any]) -> None:
        """A rank failed while the world was joining: the others may wait in rank 0's store
        for it until the store's timeout. Close the store (rank 0 answers on its second slot)
        so they fail now, and give the world up at once (``_give_up``)."""
        _stop_store(self.members[0].handle)
        self._give_up(pending)

    def _give_up(self, pending: list[Any]) -> None:
        """A world failed at its first failed call: the failure is reported now, and the calls
        still running are waited for only before the next world forms (``_settle``), so a
        survivor blocked in a collective with a dead peer does not delay the recovery's
        detection."""
        self._unsettled = list(pending)

    def _settle(self) -> None:
        """Wait (bounded) for the calls of the last world that failed to end: a retry must not
        find a worker still inside the last attempt's join or restore."""
        import ray

        pending, self._unsettled = self._unsettled, []
        if pending:
            timeout = self.job.controllers.heartbeat_timeout_s
            ended, running = ray.wait(pending, num_returns=len(pending), timeout=timeout)
            if running:
                log.warning("%d calls of the failed world still running after %g s; forming the next", len(running), timeout)

    def _start_holders(self) -> None:
        """One SnapshotHolder per node that runs a worker, pinned there, reserving no CPU."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        if self.job.checkpoint.snapshot_every == 0:
            return
        holder_cls = ray.remote(SnapshotHolder)
        for node_id in dict.fromkeys(i.node_id for i in self.infos):
            if node_id not in self.holders:
                self.holders[node_id] = holder_cls.options(
                    num_cpus=0,
                    max_concurrency=4,
                    scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node_id, soft=False),
                ).remote(self.job.checkpoint.keep_in_memory)

    def _holders_of(self, rank: int) -> list[Any]:
        """This node's holder, and a buddy node's when there is one and buddies are on."""
        if not self.holders:
            return []
        nodes = list(self.holders)
        own = self.infos[rank].node_id
        chosen = [self.holders[own]]
        if self.job.checkpoint.buddy:
            buddy = buddy_node(rank, self.topology, [i.node_id for i in self.infos], nodes)
            if buddy is not None:
                chosen.append(self.holders[buddy])
        return chosen

    def on_live_node(self, member: Member) -> bool:
        """Whether ``member``'s node is not known to be gone (every node with a worker has a
        holder, until it is found dead; without holders no node is known to be gone)."""
        return not self.holders or (member.info is not None and member.info.node_id in self.holders)

    def ready_spares(self) -> list[Member]:
        """The spares that finished warming up (never waits)."""
        return [s for s in self.spares if self.ready([s])]

    def node_alive(self, node_id: str) -> bool:
        """Whether ``node_id`` still runs: its holder answers (a dead node takes its holder with
        it at once, well before the cluster's own health check gives up on the node)."""
        import ray

        holder = self.holders.get(node_id)
        if holder is not None:
            try:
                ray.get(holder.inventory.remote(), timeout=2.0)
                return True
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                return False
        return any(n["NodeID"] == node_id and n["Alive"] for n in ray.nodes())

    def forget_node(self, node_id: str) -> None:
        self.holders.pop(node_id, None)

    # --- members come and go -------------------------------------------------------------

    def kill(self, members: list[Member], *, reuse_slots: bool = True) -> None:
        """Stop these actors; their slots become free for replacements, except on a node known
        to be gone (a worker placed there would wait for Ray to move the bundle elsewhere)."""
        import ray

        for m in members:
            try:
                ray.kill(m.handle, no_restart=True)
            except Exception:  # already dead: nothing to stop
                pass
            if reuse_slots and self.on_live_node(m):
                self.roster.free(m.slot)

    def quarantine(self, members: list[Member]) -> None:
        """Stop these actors and hold their slots, never to be reused."""
        self.kill(members, reuse_slots=False)
        self.roster.hold([m.slot for m in members])

    def cordon(self, nodes: set[str]) -> None:
        """Place nothing new on ``nodes``: their free slots are dropped, spares and starting
        workers there stopped, and later placement groups kept off them."""
        gone = self.roster.cordon(nodes, lambda m: m.info.node_id if m.info else _slot_node(m.slot), _slot_node)
        self.kill(gone, reuse_slots=False)
        log.info("cordoned nodes %s (%d spare or starting workers there stopped)", sorted(nodes), len(gone))

    def release_unused_placement(self) -> None:
        """Remove placement groups no worker, spare or free slot uses any more, so the cluster
        can give their resources to whoever needs them (a returning replica included)."""
        from ray.util.placement_group import remove_placement_group

        used = {id(s.pg) for s in self.roster.slots_in_use()}
        for pg in [pg for pg in self.placement_groups if id(pg) not in used]:
            try:
                remove_placement_group(pg)
            except Exception:
                pass
            self.placement_groups.remove(pg)

    def call_all(self, method: str, *args: Any) -> list[Any]:
        """Call ``method`` on every rank and wait for all (names the first rank that fails)."""
        return self._gather(lambda _, w: getattr(w, method).remote(*args), self.job.controllers.start_timeout_s)

    def restore_refs(self, shards: list[Any], crash_restoring: frozenset[int] = frozenset()) -> int:
        """Every rank loads the snapshot whose shards are pending in ``shards`` (``crash_restoring``
        as for ``form_world``)."""
        self._settle()
        steps = self._gather(
            lambda rank, w: w.restore.remote(*shards, chaos_exit=rank in crash_restoring), self.job.controllers.start_timeout_s
        )
        return int(steps[0])

    def spawn(self, count: int) -> list[Member]:
        """Start ``count`` workers, in free slots first, then in a new PACK placement group."""
        from ray.util.placement_group import placement_group

        slots = self.roster.take_free_slots(count)
        if len(slots) < count:
            bundle = worker_resources(self.job, self.device)
            n = count - len(slots)
            pg = placement_group([dict(bundle) for _ in range(n)], strategy="PACK", bundle_label_selector=self._off_cordoned(n))
            self.placement_groups.append(pg)
            slots += [Slot(pg, i) for i in range(count - len(slots))]
        return [self._spawn(slot) for slot in slots]

    def _off_cordoned(self, bundles: int) -> Optional[list[dict[str, str]]]:
        """A label selector per bundle that keeps it off the cordoned nodes (Ray labels every
        node with its id)."""
        if not self.cordoned:
            return None
        return [{NODE_ID_LABEL: f"!in({','.join(sorted(self.cordoned))})"} for _ in range(bundles)]

    def free_capacity(self) -> int:
        """Worker-sized slots a new worker could take now: free slots on live nodes, plus what
        the cluster has unreserved."""
        import ray

        bundle = worker_resources(self.job, self.device)
        available = ray.available_resources()
        fits = min(int(available.get(k, 0.0) // v) if v > 0 else 10**6 for k, v in bundle.items())
        return fits + len(self.free_slots)

    def ready(self, members: list[Member]) -> bool:
        """Whether every one of ``members`` finished warming up (never waits); those that did
        get their WorkerInfo. One whose warm-up failed is dropped (``drop_dead``) and counts
        as not ready."""
        dead = settle(members, _poll_warm)
        if dead:
            self.drop_dead(dead)
        return all(m.warm is None and not m.error for m in members)

    def drop_dead(self, dead: list[Member]) -> None:
        """Remove workers that died warming up from the spares and the workers starting for
        growth. Each one's slot is freed for a replacement, unless its node is gone or the slot
        has seen ``roster.MAX_WARM_DEATHS_PER_SLOT`` such deaths (then it is held back, as a
        quarantined one). Replacements are the caller's to start: see Recovery."""
        for m in dead:
            _stop_actor(m.handle)
            node = _slot_node(m.slot)
            retry = self.roster.warm_death(m, reusable=lambda: self._placeable(node))
            log.warning("a worker died warming up (%s); slot %s reused: %s", m.error, m.slot.index, retry)

    def _placeable(self, node: str) -> bool:
        """Whether a new worker may go on ``node`` ("": not known, so yes)."""
        return not node or (node not in self.cordoned and self.node_alive(node))

    def add_spares(self, count: int) -> None:
        """Start ``count`` spares (free slots first); they warm up in the background."""
        self.roster.add_spares(self.spawn(count))

    def take_spares(self, taken: list[Member]) -> None:
        """``taken`` (ready spares) leave the spares, to be seated."""
        self.roster.take_spares(taken)

    def add_growing(self, count: int) -> None:
        """Start ``count`` workers for the next grow; they warm up while training goes on."""
        self.roster.add_growing(self.spawn(count))

    def take_growing(self, count: int) -> list[Member]:
        """Up to ``count`` of the workers started for growth, to be seated."""
        return self.roster.take_growing(count)

    # --- steps and snapshots -------------------------------------------------------------

    def train_step(self, probe: bool = False) -> list[StepReport]:
        """Every rank's report of one step (with ``probe``, ending in an SDC probe round, so a
        rank that dies or stalls in it is handled as in any step); raises StepFailed with every
        rank's outcome."""
        import ray

        c = self.job.controllers
        watch = StepWatch(
            range(len(self.members)),
            time.monotonic(),
            step_timeout_s=c.step_timeout_s,
            heartbeat_s=c.heartbeat_s,
            heartbeat_timeout_s=c.heartbeat_timeout_s,
            hang_timeout_s=c.hang_timeout_s,
        )
        calls = [w.train_step.remote(probe) for w in self.workers]
        rank_of = {ref: rank for rank, ref in enumerate(calls)}
        results: dict[int, RankOutcome | StepReport] = {}
        pings: dict[Any, int] = {}
        verdict: Optional[Verdict] = None
        while watch.pending:
            done, _ = ray.wait([calls[r] for r in watch.pending], num_returns=1, timeout=watch.wait_s(time.monotonic()))
            for ref in done:
                rank = rank_of[ref]
                results[rank] = self._outcome(ref, rank)
                watch.finished(rank, isinstance(results[rank], StepReport), time.monotonic())
            now = time.monotonic()
            for ping in ray.wait(list(pings), num_returns=len(pings), timeout=0)[0] if pings else []:
                rank = pings.pop(ping)
                if _answered(ping):
                    watch.heard(rank, now)
            decision = watch.check(now)
            if decision.action is Action.STALL:
                # Find who stopped the step, and evict it so the others' collectives fail.
                verdict = self._diagnose_stall()
                culprits = verdict.ranks if verdict is not None else decision.ranks
                why = verdict.explanation if verdict is not None else decision.why
                for rank in culprits:  # its seat is freed when the recovery drops the rank
                    ray.kill(self.members[rank].handle, no_restart=True)
                survivors = abort_survivors(device=self.device, pending=list(decision.ranks), evicted=culprits)
                for rank in survivors:  # not waited for: answered on the worker's second slot
                    self.workers[rank].abort.remote()
                for rank in culprits:
                    results[rank] = RankOutcome(rank, Outcome.LOST, why)
                watch.lose(culprits, time.monotonic())
                continue
            if decision.action is Action.LOSE:
                for rank, why in decision.lost:
                    results[rank] = RankOutcome(rank, Outcome.LOST, why)
                watch.lose([rank for rank, _ in decision.lost], now)
            waiting = set(pings.values())
            for rank in watch.pending:
                if rank not in waiting:
                    pings[self.workers[rank].heartbeat.remote()] = rank
        if watch.failed_at is not None:
            outcomes = [
                r if isinstance(r, RankOutcome) else RankOutcome(rank, Outcome.OK) for rank, r in sorted(results.items())
            ]
            seen_unix = time.time() - (time.monotonic() - watch.failed_at)
            raise StepFailed(outcomes, watch.failed_at, seen_unix, verdict=verdict.to_dict() if verdict is not None else None)
        return [results[rank] for rank in range(len(self.members))]  # type: ignore[misc]

    def _diagnose_stall(self, timeout_s: float = 5.0) -> Optional[Verdict]:
        """Every rank's collective records and stacks (answered on its second concurrency slot
        while its step is blocked), and the culprit they point at."""
        import ray

        topo = self.topology
        refs = [w.diagnostics.remote() for w in self.workers]
        ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        found = []
        for rank, ref in enumerate(refs):
            c = topo.coord(rank)
            where = {"replica": c.replica, "ring_pos": c.ring_pos, "host": self._host(rank)}
            try:
                d = ray.get(ref, timeout=0)
                found.append(RankDiagnostics.from_probe(rank, d, busy=bool(d.get("busy", True)), **where))
            except Exception:  # dead, or too stuck to answer: that is a finding too
                found.append(RankDiagnostics.unreachable(rank, **where))
        return diagnose(found)

    def _outcome(self, ref: Any, rank: int) -> RankOutcome | StepReport:
        import ray

        try:
            report = ray.get(ref)
            assert isinstance(report, StepReport)
            return report
        except ray.exceptions.RayActorError as exc:
            return RankOutcome(rank, Outcome.DIED, type(exc).__name__)
        except ray.exceptions.RayTaskError as exc:
            cause = exc.cause if getattr(exc, "cause", None) is not None else exc
            where = user_frame(str(getattr(exc, "traceback_str", "") or ""))
            return RankOutcome(rank, Outcome.ERROR, f"{type(cause).__name__}: {_first_line(cause)}", where=where)

    # --- evaluation ----------------------------------------------------------------------

    def evaluate(self, evalset: Any, bucket_tokens: int) -> "LossTally":
        """Every rank's loss tally of ``evalset`` (an EvalSet), summed: the world's. Between steps."""
        import ray

        from ringtrain.evaluation.tally import merge_all

        ref = ray.put(evalset)  # one copy in the object store for every rank
        forwards = -(-evalset.num_rows // self.topology.dp)
        tallies = self._gather(lambda _, w: w.evaluate.remote(ref, bucket_tokens), self._collective_timeout(forwards))
        return merge_all(tallies)

    def generate(self, prompts: list[list[int]], num_new: int) -> list[list[int]]:
        """Greedy continuations (``num_new`` tokens) of ``prompts``, shared out over the replicas."""
        import ray

        topo = self.topology
        ref = ray.put(prompts)
        forwards = -(-len(prompts) // topo.dp) * num_new
        outputs = self._gather(lambda _, w: w.generate.remote(ref, num_new), self._collective_timeout(forwards))
        # Every rank of a replica holds its replica's answers; ring position 0 speaks for it.
        return [ids for d in range(topo.dp) for ids in outputs[topo.rank_of(d, 0)]][: len(prompts)]

    def _collective_timeout(self, forwards: int) -> float:
        # A forward takes no longer than a training step, which the step timeout bounds.
        return self.job.controllers.step_timeout_s * max(1, forwards)

    def pin_snapshots(self, step: int) -> None:
        """Every worker and holder keeps its newest snapshot at or before ``step`` until the next
        pin: the rollback point should a later scan fail. Not waited for: each pin carries a
        sequence number, so one overtaken by a later pin (calls to a threaded actor may run out
        of order) is ignored."""
        self._pins += 1
        for worker in self.workers:
            worker.pin_snapshot.remote(step, self._pins)
        for holder in self.holders.values():
            holder.pin.remote(step, self._pins)

    def snapshot_refs(self, step: int) -> list[Any]:
        """Pending results of every rank's ``snapshot(step)``, in rank order; the workers answer
        on their second concurrency slot, so this never waits for the step in flight."""
        return [w.snapshot.remote(step) for w in self.workers]

    def restore(self, blobs: list[bytes]) -> int:
        import ray

        return self.restore_refs([ray.put(b) for b in blobs])  # one copy of each shard for every rank

    def shutdown(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        for handle in [m.handle for m in self.members + self.spares + self.growing] + list(self.holders.values()):
            try:
                ray.kill(handle, no_restart=True)
            except Exception:  # already dead: nothing to stop
                pass
        for pg in self.placement_groups:
            try:
                remove_placement_group(pg)
            except Exception:
                pass
        self.roster.clear()
        self.placement_groups, self.holders = [], {}

    # --- calls ---------------------------------------------------------------------------

    def _gather(
        self, call: Callable[[int, Any], Any], timeout: float, on_failure: Optional[Callable[[list[Any]], None]] = None
    ) -> list[Any]:
        """Call every worker (with its rank), wait for all; the first failure names its rank.
        ``on_failure`` is given the calls still pending when one failed, before the error."""
        import ray

        rank_of = {call(rank, w): rank for rank, w in enumerate(self.workers)}
        results: dict[int, Any] = {}
        deadline = time.monotonic() + timeout
        pending = list(rank_of)
        while pending:
            done, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            try:
                if not done:
                    stuck = sorted(rank_of[r] for r in pending)
                    raise WorkerError(
                        stuck[0], self._host(stuck[0]), f"no answer within {timeout:g} s (ranks {stuck})", kind="timeout"
                    )
                rank = rank_of[done[0]]
                results[rank] = self._call(done[0], rank=rank, timeout=0)
            except WorkerError:
                if on_failure is not None:
                    on_failure(pending)
                raise
        return [results[rank] for rank in range(len(self.workers))]

    def _call(self, ref: Any, *, rank: int, timeout: float) -> Any:
        import ray

        try:
            return ray.get(ref, timeout=timeout or None)
        except ray.exceptions.GetTimeoutError:
            raise WorkerError(rank, self._host(rank), f"no answer within {timeout:g} s", kind="timeout") from None
        except ray.exceptions.RayActorError as exc:
            raise WorkerError(rank, self._host(rank), f"worker process died ({type(exc).__name__})", kind="died") from None
        except ray.exceptions.RayTaskError as exc:
            cause = exc.cause if getattr(exc, "cause", None) is not None else exc
            raise WorkerError(rank, self._host(rank), f"{type(cause).__name__}: {_first_line(cause)}") from None

    def _host(self, rank: int) -> str:
        info = self.members[rank].info if rank < len(self.members) else None
        return info.host if info else "?"


def buddy_node(rank: int, topology: Topology, rank_nodes: list[str], nodes: list[str]) -> Optional[str]:
    """Another node to keep a copy of ``rank``'s snapshots: the node of the same ring position in
    the next replica when that is elsewhere (spreads the copies evenly), else any other node."""
    own = rank_nodes[rank]
    c = topology.coord(rank)
    peer = rank_nodes[topology.rank_of((c.replica + 1) % topology.dp, c.ring_pos)]
    if peer != own:
        return peer
    others = [n for n in nodes if n != own]
    return others[rank % len(others)] if others else None


def _slot_node(slot: Slot) -> str:
    """The node a slot's bundle is placed on ("" when not known)."""
    import ray

    try:
        return str(ray.util.placement_group_table(slot.pg)["bundles_to_node_id"].get(slot.index, ""))
    except Exception:
        return ""


def _poll_warm(refs: list[Any]) -> dict[int, "WorkerInfo | BaseException"]:
    """The warm() results among ``refs`` that finished, by index (never waits)."""
    import ray

    done, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
    finished: dict[int, WorkerInfo | BaseException] = {}
    for i, ref in enumerate(refs):
        if ref in done:
            try:
                finished[i] = ray.get(ref)
            except Exception as exc:  # it died starting
                finished[i] = exc
    return finished


def _stop_actor(handle: Any) -> None:
    import ray

    try:
        ray.kill(handle, no_restart=True)
    except Exception:  # already dead: nothing to stop
        pass


def _stop_store(handle: Any) -> None:
    try:
        handle.drop_store.remote()
    except Exception:  # rank 0 is gone, and its store with it
        pass


def _answered(ref: Any) -> bool:
    import ray

    try:
        ray.get(ref, timeout=0)
        return True
    except Exception:  # the actor died: its step call reports that
        return False


def _worker_env(device: str) -> dict[str, str]:
    env = {"DS_ACCELERATOR": "cuda" if device == "cuda" else "cpu"}
    if device == "cuda":
        # A failed NCCL collective aborts its communicator and raises, without tearing the
        # process down (2: clean up only): the survivor keeps its snapshots for the recovery.
        env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "2"
    # Quiet the per-process banners; errors still surface through the controller.
    env["PYTHONWARNINGS"] = "ignore"
    return env


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""
