"""WorkerGroup: places, spawns, drives and re-forms the dp x cp TrainWorker actors.

One placement group per replica, one bundle per ring position, PACK strategy: a ring's ranks
land on one node when it fits, so the ring's P2P traffic rides the fastest links, and a
replica stays the unit that comes and goes as a whole. Every actor sits in a *slot* (a bundle
of a placement group); a slot whose actor died is reused for its replacement, so a restarted
rank lands where its ring is.

The group has no policy of its own: the Controller decides (``policies.faults`` and
``policies.elastic``), ``policies.stepwatch`` says when a rank of a step is lost or the step
stalled, and the group carries it out: ``train_step`` reports how every rank's step ended,
``form_world`` moves a set of live workers into a new world, ``spawn`` starts new ones in the
background.

The group is the facade its callers use; the work is shared out by noun: ``actors.placement``
(placement groups, holders, capacity), ``actors.world`` (forming a world, restoring it, the
calls a failed one left running), ``actors.steps`` (a step watched on every rank), and
``actors.roster`` (who sits where), ``actors.calls`` (calls to the workers, and Ray's errors
turned into the platform's). None of them imports this module: each takes what it uses.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Callable, Optional

from ringtrain.actors import placement, steps, world
from ringtrain.actors.calls import gather, get, host_of
from ringtrain.actors.roster import Member, Roster, Slot, WarmDeaths, settle
from ringtrain.actors.safekeeping import Safekeeping
from ringtrain.actors.steps import StepResult
from ringtrain.config import JobConfig
from ringtrain.status import WorkerInfo
from ringtrain.topology import Topology

if TYPE_CHECKING:
    import numpy as np

    from ringtrain.actors.reference_keeper import ReferenceKeeper
    from ringtrain.evaluation.generation import GenerationRequest, ScoreRequest
    from ringtrain.evaluation.tally import LossTally
    from ringtrain.train.pairset import PairSet
    from ringtrain.train.reference_input import ReferenceWeights

log = logging.getLogger(__name__)
_slot_node = placement.slot_node  # the group's own names for these: tests stand in for them here

__all__ = ["Member", "StepResult", "WorkerGroup"]


class WorkerGroup:
    def __init__(self, job: JobConfig, device: str) -> None:
        self.job = job  # the job of the current world: mesh.dp follows resizes
        self.device = device
        self.roster = Roster()  # who sits where; its methods are the only writers of its lists
        self._pins = 0  # pin_snapshots calls so far
        self.placement_groups: list[Any] = []
        self.holders: dict[str, Any] = {}  # node id -> SnapshotHolder
        # Rank -> the holders its snapshots go to in the current world (``seat_holders``).
        self.holders_by_rank: list[list[Any]] = []
        self.num_params = 0
        # The step the run began at: 0, or the step of the checkpoint a resume loaded (``restore``).
        self.start_step = 0
        self.generation = 0  # worlds formed so far
        self.phases: dict[str, float] = {}  # how long the last world took to form, by phase
        self.startup: dict[str, float] = {}  # seconds by phase of the first world's start
        # Calls of the last world that failed still running when it was given up: waited for
        # before the next world forms, so no worker is ever asked to join twice at once.
        self.leftovers = world.Leftovers()
        self.safekeeping = Safekeeping(self._ask_holders)  # which steps' snapshots the holders have
        # DPO's and IPO's reference table, handed to every world (None: the objective needs none).
        self.reference: Optional[ReferenceKeeper] = None

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
        """The grid of the world formed last: the one holder of the current dp (``self.job``'s
        mesh.dp, which forming a world sets); the Controller reads it from here."""
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
        t0 = time.monotonic()
        topo = self.topology
        self.placement_groups = placement.place_replicas(self.job, self.device)
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
        handle = placement.start_worker(self.job, self.device, slot)
        return Member(handle, slot, warm=handle.warm.remote(rehearse))

    def _wait_warm(self, members: list[Member], timeout: float) -> None:
        for i, m in enumerate(members):
            if m.info is None:
                m.info = get(m.warm, rank=i, host=host_of(members, i), timeout=max(0.001, timeout))
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
        restores (chaos: a second failure inside the recovery). See ``actors.world``."""
        import ray

        timeout = self.job.controllers.start_timeout_s
        self.job = job
        self.roster.seat(members)
        self.phases = {}
        keeper = self.reference
        try:
            formed = world.form_world(
                members,
                job,
                leftovers=self.leftovers,
                phases=self.phases,
                wait_warm=self._wait_warm,
                seat_holders=self.seat_holders,
                timeout=timeout,
                snapshot=snapshot,
                crash_restoring=crash_restoring,
                reference=ray.put(keeper.join_input()) if keeper is not None else None,
                join=self._reference_join(job, timeout),
            )
        finally:
            if "warm_s" in self.phases:  # a world counts once its workers are warm and its holders seated
                self.generation += 1
        self.num_params = formed.num_params
        if keeper is not None and keeper.table is None:  # this world computed it: every later one is given it
            keeper.learned(get(members[0].handle.reference_table.remote(), rank=0, host=host_of(members, 0), timeout=timeout))
        self.safekeeping.restart(formed.step)
        return formed.step

    def _reference_join(self, job: JobConfig, timeout: float) -> Optional[tuple[float, str]]:
        """How long a join of ``job``'s world may take, and why, when it takes DPO's and IPO's
        reference pass (no table yet): ``timeout`` for the world, and a forward per row of pairs
        a replica scores, plus one for putting another model's weights in place, or the
        starting weights back (as ``score_pairs``). None: the join takes ``timeout``."""
        keeper = self.reference
        if keeper is None or keeper.table is not None:
            return None
        rows = keeper.pass_rows(job)
        forwards = -(-rows // job.topology.dp) + 1
        return timeout + self._collective_timeout(forwards), (
            f"in a join that takes {job.train.objective}'s reference pass over {rows} rows of pairs "
            f"(controllers.start_timeout_s + controllers.step_timeout_s x {forwards} forwards)"
        )

    def restore_refs(self, shards: list[Any], crash_restoring: frozenset[int] = frozenset()) -> int:
        """Every rank loads the snapshot whose shards are pending in ``shards`` (``crash_restoring``
        as for ``form_world``)."""
        step = world.restore_refs(self.members, self.job, self.leftovers, shards, crash_restoring)
        self.safekeeping.restart(step)
        return step

    def seat_holders(self) -> list[list[Any]]:
        """Start the holders the current world needs and fix, per rank, the ones its snapshots
        go to: its node's, and a buddy node's when there is one and buddies are on. Kept for the
        world's life, so the group asks after a step the very holders the ranks sent it to."""
        placement.start_holders(self.job, self.infos, self.holders)
        self.holders_by_rank = [placement.holders_of(r, self.job, self.infos, self.holders) for r in range(len(self.members))]
        return self.holders_by_rank

    def on_live_node(self, member: Member) -> bool:
        """Whether ``member``'s node is not known to be gone (without holders no node is)."""
        return not self.holders or self.on_known_live_node(member)

    def on_known_live_node(self, member: Member) -> bool:
        """Whether ``member``'s node is known to live: every node with a worker has a holder,
        until it is found dead (without holders no node is known either way)."""
        return member.info is not None and member.info.node_id in self.holders

    def ready_spares(self) -> list[Member]:
        """The spares that finished warming up (never waits)."""
        return [s for s in self.spares if self.ready([s])]

    def node_alive(self, node_id: str) -> bool:
        """Whether ``node_id`` still runs: its holder answers (a dead node takes its holder with
        it at once, well before the cluster's own health check gives up on the node)."""
        return placement.node_alive(self.holders, node_id)


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
        placement.release_unused(self.placement_groups, self.roster.slots_in_use())

    def call_all(self, method: str, *args: Any) -> list[Any]:
        """Call ``method`` on every rank and wait for all (names the first rank that fails)."""
        return gather(self.members, lambda _, w: getattr(w, method).remote(*args), self.job.controllers.start_timeout_s)

    def spawn(self, count: int) -> list[Member]:
        """Start ``count`` workers, in free slots first, then in a new PACK placement group."""
        slots = self.roster.take_free_slots(count)
        if len(slots) < count:
            pg = placement.new_placement_group(self.job, self.device, count - len(slots), self.cordoned)
            self.placement_groups.append(pg)
            slots += [Slot(pg, i) for i in range(count - len(slots))]
        return [self._spawn(slot) for slot in slots]

    def free_capacity(self) -> int:
        """Worker-sized slots a new worker could take now: free slots on live nodes, plus what
        the cluster has unreserved."""
        return placement.free_capacity(self.job, self.device, len(self.free_slots))

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

    def train_step(self, probe: bool = False, on_safe: Optional[Callable[[int], None]] = None) -> StepResult:
        """How one step ended on every rank (with ``probe``, ending in an SDC probe round, so a
        rank that dies or stalls in it is handled as in any step): each rank's report, or each
        rank's outcome when one did not finish it (see ``actors.steps``). ``on_safe(step)`` is
        called while the step runs when the holders confirm an earlier step's snapshots
        (``safe_through`` moved)."""
        result = steps.run_step(self, probe, on_safe)
        if not result.failed and result.reports[0].snapshot_taken:
            self.safekeeping.taken(result.reports[0].step)
        return result

    def safe_through(self, wait_s: float = 0.0) -> int:
        """The newest step whose snapshots every holder has, as far as known (waiting up to
        ``wait_s`` for the answer about the newest one taken); see ``actors.safekeeping``."""
        self.safekeeping.poll(wait_s)
        return self.safekeeping.safe_through

    def _ask_holders(self, step: int) -> list[Any]:
        """One answer per holder: whether it has ``step`` (or newer) of every rank that sends
        it snapshots."""
        ranks_of: dict[int, tuple[Any, list[int]]] = {}
        for rank, holders in enumerate(self.holders_by_rank):
            for holder in holders:
                ranks_of.setdefault(id(holder), (holder, []))[1].append(rank)
        timeout = self.job.controllers.step_timeout_s  # bounded like the step whose snapshots they are
        return [holder.wait_for.remote(ranks, step, timeout) for holder, ranks in ranks_of.values()]

    # --- evaluation ----------------------------------------------------------------------

    def evaluate(self, evalset: Any, bucket_tokens: int) -> "LossTally":
        """Every rank's loss tally of ``evalset`` (an EvalSet), summed: the world's. Between steps."""
        import ray

        from ringtrain.evaluation.tally import merge_all

        ref = ray.put(evalset)  # one copy in the object store for every rank
        forwards = -(-evalset.num_rows // self.topology.dp)
        tallies = gather(self.members, lambda _, w: w.evaluate.remote(ref, bucket_tokens), self._collective_timeout(forwards))
        return merge_all(tallies)

    def generate(self, request: "GenerationRequest") -> list[list[int]]:
        """The new tokens of each prompt of ``request``, its batches shared out over the replicas."""
        return self._per_item(lambda w, ref: w.generate.remote(ref), request, len(request.prompts))

    def score(self, request: "ScoreRequest") -> list[tuple[float, bool]]:
        """Each sequence of ``request`` scored, its batches shared out over the replicas."""
        return self._per_item(lambda w, ref: w.score.remote(ref), request, len(request.sequences))

    def score_pairs(self, pairs: "PairSet", weights: Optional["ReferenceWeights"] = None) -> tuple["np.ndarray", "np.ndarray"]:
        """Every pair of ``pairs`` scored on the mesh, ``weights`` first put in the model's place
        when given: (chosen, rejected) completion log-prob sums and trained-token counts,
        ``[pairs, 2]`` each (every rank holds the whole table: rank 0's is taken). Between steps."""
        import ray

        pairs_ref, weights_ref = ray.put(pairs), ray.put(weights)
        forwards = -(-pairs.num_rows // self.topology.dp) + (weights is not None)  # loading weights: about a forward's
        answers = gather(self.members, lambda _, w: w.score_pairs.remote(pairs_ref, weights_ref), self._collective_timeout(forwards))
        return answers[0]

    def _per_item(self, call: Callable[[Any, Any], Any], request: Any, items: int) -> list[Any]:
        """``call(worker, request)`` on every worker; each item's answer from the replica that
        had it (every rank of a replica holds its replica's answers; ring position 0 speaks)."""
        import ray

        topo = self.topology
        ref = ray.put(request)
        # A forward of a batch is no longer than a training step, which bounds a prefill; a
        # decode step of one token a row far shorter.
        forwards = -(-items // topo.dp) * 2
        outputs = gather(self.members, lambda _, w: call(w, ref), self._collective_timeout(forwards))
        found: list[Any] = [None] * items
        for d in range(topo.dp):
            for i, answer in enumerate(outputs[topo.rank_of(d, 0)]):
                if answer is not None:
                    found[i] = answer
        assert all(answer is not None for answer in found), "an item no replica answered"
        return found

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
        """Every rank loads a checkpoint (``blobs``: its shards; a resume's, or the one
        evaluated): the run begins at the step restored (``start_step``), which every rank then
        keeps as a snapshot."""
        import ray

        self.start_step = self.restore_refs([ray.put(b) for b in blobs])  # one copy of each shard for every rank
        return self.start_step

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
        self.placement_groups, self.holders, self.holders_by_rank = [], {}, []


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
