"""A simulated cluster: the Controller's worker group and recovery with no process, on a clock
that only the simulation moves.

``SimulatedGroup`` is a dp x cp world on the real data order: a data cursor; a step trains the
global samples [cursor * G, (cursor + 1) * G) and moves it on; replica d reports its contiguous
G / dp of them from its ring position 0. Snapshots hold the cursor, every ``snapshot_every``
steps, kept as the workers and node holders keep them (``actors.simulated_snapshots``), and a
step's snapshots are safe off their ranks either at once or, with ``transit``, while the next
step runs. ``faults`` strike
a step once, on its next attempt (``Fault``: a crash, a lost node, a hang, an error, a NaN, a
crash before the last step's snapshots left the rank), a ``poisoned`` batch makes every attempt
at it NaN, a ``Corruption`` makes some ranks' SDC probe digests differ from the rest, and a
``Straggle`` makes a rank compute slowly for some steps, until a new world replaces it.

``SimulatedRecovery`` carries the Controller's decisions out on it (``actors.protocols.Elastic``)
as Ray's ``actors.recovery`` does: each reform, rollback or grow is the plan
``policies.recovery.plan_recovery`` makes from the cluster as it is (the snapshots each rank's
memory and each node's holder hold, ``actors.simulated_snapshots``; the spares ready; the job's
chaos faults; an interrupted recovery's restore point), so the step restored, the ranks a lost
node takes, who takes each seat and what a retry keeps follow the product's own rules. A skip
drops a batch; spares, free slots and returning capacity are numbers. The job's
``crash_restoring`` chaos faults strike its recoveries as on Ray: a worker of the world being
formed dies while it restores.

The Controller and its policies run on them unchanged: the same decisions, incidents and sample
ledger as on Ray, in milliseconds, each move taking the time ``Durations`` says.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable, Optional

from ringtrain.actors.protocols import Reform, Reformed
from ringtrain.actors.simulated_snapshots import SimulatedSnapshots
from ringtrain.actors.steps import StepResult
from ringtrain.chaos import FaultSpec
from ringtrain.config import JobConfig
from ringtrain.errors import WorkerError
from ringtrain.policies.faults import Capacity, Outcome, RankOutcome
from ringtrain.policies.recovery import (
    Fetched, RecoveryPlan, kept_by_new_world, node_losses, nodes_to_check, plan_recovery,
)  # fmt: skip
from ringtrain.policies.snapshots import NODE, Holding, Location
from ringtrain.status import StepReport, WorkerInfo
from ringtrain.topology import Topology

UNIX0 = 1.7e9  # the simulation's wall clock at clock time 0
# What a healthy rank reports when a peer's death breaks the step's collective.
PEER_ERROR = "RuntimeError: [gloo] Connection closed by peer"
ERROR_FRAME = "ringtrain/train/trainer.py:210 in train_step"  # where a simulated "error" fault raises
FAULT_KINDS = ("crash", "node_lost", "hang", "error", "nan", "crash_in_transit", "crash_in_transit_rebuilt")
# A crash before the last step's snapshots left the rank (with ``transit``): its newest snapshot
# is lost; ``_rebuilt``: the shard is written again from a replica (ZeRO-0), so it stays whole.
IN_TRANSIT = ("crash_in_transit", "crash_in_transit_rebuilt")


@dataclass(frozen=True)
class Durations:
    """Seconds each move takes on the simulated clock."""

    step_s: float = 1.0  # one step
    detect_s: float = 0.25  # from a failed step's start to the failure being seen
    recover_s: float = 2.0  # a reform or a rollback
    grow_s: float = 0.5  # adding replicas at a step boundary


class Clock:
    """Seconds since the simulation began; only the simulation moves it."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@dataclass(frozen=True)
class Fault:
    """What strikes a step: ``kind`` (one of FAULT_KINDS) on ``rank``."""

    kind: str
    rank: int


@dataclass(frozen=True)
class Corruption:
    """From the probe round after ``step`` on, ``ranks``' probe digests differ from the rest
    (``once``: only in that round)."""

    step: int
    ranks: tuple[int, ...]
    once: bool = False


@dataclass(frozen=True)
class Straggle:
    """``rank`` computes ``slowdown`` x as long as its peers in ``steps``, until a world formed
    after its first step drops it (as a new world's job drops the chaos faults already due)."""

    rank: int
    steps: range
    slowdown: float = 10.0

    @property
    def fault(self) -> FaultSpec:
        """The chaos fault it stands for: ``slow`` on its steps."""
        return FaultSpec(kind="slow", rank=self.rank, step=self.steps.start, count=len(self.steps))


class SimulatedGroup:
    """A dp x cp world of simulated ranks, ``ranks_per_node`` to a node (``actors.protocols.Group``)."""

    # One world as far as the records go, no start-up timed, no holder actors.
    startup: dict[str, float] = {}
    generation = 1
    start_step = 0  # a simulated run starts from step 0 (``restore``)
    holders: dict[str, Any] = {}

    def __init__(
        self,
        job: JobConfig,
        clock: Clock,
        faults: Optional[dict[int, list[Fault]]] = None,
        poisoned: frozenset[int] = frozenset(),
        snapshot_every: int = 1,
        corrupt: Optional[Corruption] = None,
        keep: Optional[int] = None,
        transit: bool = False,
        durations: Durations = Durations(),
        ranks_per_node: Optional[int] = None,
        straggles: tuple[Straggle, ...] = (),
    ) -> None:
        self.num_params = 7
        self.G, self.dp, self.cp = job.train.global_batch, job.mesh.dp, job.mesh.cp
        self.ranks_per_node = ranks_per_node or self.cp  # default: a ring on its own node
        self.clock = clock
        self.durations = durations
        self.faults = {step: list(fs) for step, fs in (faults or {}).items()}
        self.poisoned = poisoned
        self.snapshot_every = snapshot_every
        self.step, self.cursor = 0, 0
        self.skipped: set[int] = set()  # batches never to train, as the workers keep them
        self.attempts: list[int] = []  # every step started, in order
        self.shut_down = False
        self.corrupt = corrupt
        self.bad_ranks: set[int] = set()  # ranks whose device went bad (the corruption struck)
        self.scanned: list[int] = []  # the step each probe round ran after
        self.pins: list[int] = []
        self.transit = transit
        # The snapshots, held as the workers and node holders hold them (None: all kept).
        self.snapshots = SimulatedSnapshots(cp=self.cp, ranks_per_node=self.ranks_per_node, keep=keep, buddy=job.checkpoint.buddy)
        self.straggles = straggles
        self.phases: dict[str, float] = {}  # of the last world formed: a failed one's ends where it broke

    @property
    def topology(self) -> Topology:
        return Topology(self.dp, self.cp)  # dp follows the recovery's reforms and grows

    @property
    def infos(self) -> list[WorkerInfo]:
        return [
            WorkerInfo(rank=r, host="h", pid=100 + r, device="cpu", node_id=self.snapshots.node_of(r))
            for r in range(self.dp * self.cp)
        ]

    def start(self) -> None:
        pass

    def safe_through(self, wait_s: float = 0.0) -> int:
        if not self.transit or wait_s > 0:  # a wait lets the copy in flight land
            self.snapshots.safe = self.step
        return self.snapshots.safe

    def train_step(self, probe: bool = False, on_safe: Optional[Callable[[int], None]] = None) -> StepResult:
        step = self.step + 1
        self.attempts.append(step)
        world = self.dp * self.cp
        pending = self.faults.get(step, [])
        fault = pending.pop(0) if pending else None
        snaps = self.snapshots
        if fault is not None and fault.kind in IN_TRANSIT:
            snaps.unsent.add((self.step, fault.rank))  # the dead rank's newest shard never left it
            if fault.kind == "crash_in_transit_rebuilt":
                snaps.rebuildable = (self.step, world)
        elif self.transit and snaps.safe < self.step:
            snaps.safe = self.step  # the last step's snapshots land while this one runs
            if on_safe is not None:
                on_safe(snaps.safe)
        if fault is not None and fault.kind != "nan":
            self.clock.advance(self.durations.detect_s)
            first_hand = _first_hand(fault)
            outcomes = [first_hand if r == fault.rank else RankOutcome(r, Outcome.ERROR, error=PEER_ERROR) for r in range(world)]
            return StepResult(outcomes=tuple(outcomes), seen_at=self.clock(), seen_unix=UNIX0 + self.clock())
        self.clock.advance(self.durations.step_s)
        while self.cursor in self.skipped:
            self.cursor += 1
        nan_rank = fault.rank if fault is not None else 1 if self.cursor in self.poisoned else None
        loss = math.nan if nan_rank is not None else 4.0 / step
        batch = range(self.cursor * self.G, (self.cursor + 1) * self.G)
        per = self.G // self.dp
        compute_s = self.durations.step_s / 2  # the rest of a step is its collectives
        slow = {s.rank: s.slowdown for s in self.straggles if step in s.steps}
        reports = []
        for rank in range(world):
            replica, ring_pos = divmod(rank, self.cp)
            reports.append(
                StepReport(
                    step=step, rank=rank, loss=loss, local_loss=math.nan if rank == nan_rank else 4.0 / step, lr=1e-3,
                    grad_norm=1.0, num_tokens=32, step_time_s=self.durations.step_s, batch=self.cursor,
                    samples=tuple(batch[replica * per : (replica + 1) * per]) if ring_pos == 0 else (),
                    snapshot_taken=step % self.snapshot_every == 0, compute_s=compute_s * slow.get(rank, 1.0),
                )
            )  # fmt: skip
        self.step, self.cursor = step, self.cursor + 1
        if step % self.snapshot_every == 0:
            self.snapshots.take(step, self.cursor, world)
        if probe:
            found = self._probe_round()
            reports = [dataclasses.replace(r, probes=found[r.rank]) for r in reports]
        return StepResult(reports=tuple(reports))

    def _probe_round(self) -> dict[int, dict[str, str]]:
        self.scanned.append(self.step)
        c = self.corrupt
        struck = c is not None and self.step >= c.step
        if c is not None and struck:  # the devices stay bad (they leave with their workers), unless it was ``once``
            self.bad_ranks |= set(c.ranks)
            self.corrupt = None
        found = {r: {"gemm": "bad" if r in self.bad_ranks else "good"} for r in range(self.dp * self.cp)}
        if c is not None and struck and c.once:
            self.bad_ranks -= set(c.ranks)
        return found

    def pin_snapshots(self, step: int) -> None:
        self.pins.append(step)
        self.snapshots.pin(step)

    def restore_to(self, step: int) -> int:
        """Every rank of the world as formed now back at ``step``'s state (0: the initial state),
        the step a recovery plan restores; returns it."""
        self.cursor = self.snapshots.restore(step, self.dp * self.cp)
        self.step = step
        return step

    def snapshot_refs(self, step: int) -> list[Any]:
        return []

    def restore(self, blobs: list[bytes]) -> int:
        raise NotImplementedError("a simulated run starts from step 0")

    def shutdown(self) -> None:
        self.shut_down = True


def _producer_node(where: str, snaps: SimulatedSnapshots) -> str:
    """The node of the place a restore plan's shard came from: a holder's, or a worker's (a peer,
    or a survivor that rebuilds it)."""
    place = Location.parse(where)
    return place.name if place.kind == NODE else snaps.node_of(place.rank)


def _first_hand(fault: Fault) -> RankOutcome:
    """How the struck rank's step call ends."""
    if fault.kind in ("crash", *IN_TRANSIT):
        return RankOutcome(fault.rank, Outcome.DIED)
    if fault.kind == "node_lost":
        return RankOutcome(fault.rank, Outcome.DIED, node_alive=False)
    if fault.kind == "hang":
        return RankOutcome(fault.rank, Outcome.LOST)
    if fault.kind == "error":
        return RankOutcome(fault.rank, Outcome.ERROR, error="ValueError: bad batch", where=ERROR_FRAME)
    raise ValueError(f"no simulated fault {fault.kind!r}: one of {', '.join(FAULT_KINDS)}")


class SimulatedRecovery:
    """Carries the Controller's decisions out on a SimulatedGroup (``actors.protocols.Elastic``):
    each as the plan ``policies.recovery.plan_recovery`` makes of it from this cluster's answers
    to the plan's view (``policies.recovery.ClusterView``), so a recovery restores, seats and
    retries by the rules Ray's worker group does.

    ``spares``: warm spares at the start; ``free_slots``: room for new workers; from clock time
    ``capacity_from`` on (or once step ``capacity_after_step`` is done), ``capacity_replicas``
    more replicas' worth of workers are free for growth; ``warm_polls``: how many
    ``growth_ready`` polls answer False before the workers started for growth are ready.
    ``whole_nodes``: a node found gone takes every rank on it, as on Ray (off: only the rank that
    reported it). ``replenish``: after a recovery the warm spares are made whole at once, as on a
    cluster with room for them once their warm-up is done (off: spares seated are gone).
    ``job``: whose chaos faults the worlds' jobs carry (its ``crash_restoring`` faults strike
    the recoveries)."""

    def __init__(
        self,
        group: SimulatedGroup,
        *,
        spares: int = 0,
        free_slots: int = 0,
        capacity_from: Optional[float] = None,
        capacity_after_step: Optional[int] = None,
        capacity_replicas: int = 1,
        warm_polls: int = 0,
        whole_nodes: bool = True,
        replenish: bool = False,
        job: Optional[JobConfig] = None,
    ) -> None:
        self.group = group
        self.whole_nodes = whole_nodes
        self.replenish = replenish
        self.spares, self.free_slots = spares, free_slots
        self.capacity_from, self.capacity_after_step = capacity_from, capacity_after_step
        self.capacity_replicas, self.warm_polls = capacity_replicas, warm_polls
        self.preparing = 0
        self.chaos: tuple[FaultSpec, ...] = tuple(job.chaos.faults) if job is not None else ()  # the world's job's
        self.unfinished: Optional[Fetched] = None  # the restore point of a world that broke forming

    # --- the plan's view of the cluster (policies.recovery.ClusterView) -------------------

    @property
    def topology(self) -> Topology:
        return self.group.topology

    def holdings(self, ranks: frozenset[int]) -> list[Holding]:
        return self.group.snapshots.holdings(ranks, self.group.dp * self.group.cp)

    def ready_spares(self) -> int:
        return self.spares

    def start_step(self) -> int:
        return self.group.start_step

    def snapshot_every(self) -> int:
        return self.group.snapshot_every

    def faults(self) -> tuple[FaultSpec, ...]:
        return self.chaos

    def fetched(self) -> Optional[Fetched]:
        return self.unfinished

    def fetched_readable(self, readers: frozenset[int]) -> bool:
        """As Ray's (``actors.recovery.GroupView``): a fetched shard lives in its producer's
        node, so one a node found gone since produced (its holder, or a worker there) is lost."""
        restore = self.unfinished.restore if self.unfinished is not None else None
        snaps = self.group.snapshots
        return not any(_producer_node(where, snaps) in snaps.gone for _, where in (restore.fetch if restore else ()))

    # --- the Controller's calls ------------------------------------------------------------

    def assess(self, failure: StepResult) -> list[RankOutcome]:
        g = self.group
        node_of = [g.snapshots.node_of(r) for r in range(g.dp * g.cp)]
        # A node is found gone when a rank that died there says so (a holder that stopped answering on Ray).
        dead_nodes = {node_of[o.rank] for o in failure.outcomes if o.outcome is Outcome.DIED and not o.node_alive}
        gone = [node for node in nodes_to_check(failure.outcomes, node_of=node_of) if node in dead_nodes]
        g.snapshots.gone.update(gone)
        if not self.whole_nodes:
            return list(failure.outcomes)
        return node_losses(failure.outcomes, node_of=node_of, gone=gone)

    def capacity(self, lost: tuple[int, ...], *, reuse_slots: bool = True) -> Capacity:
        return Capacity(self.spares, self.free_slots)

    def reform(self, request: Reform) -> Reformed:
        plan = plan_recovery(
            self, lost=request.lost, new_dp=request.new_dp, spares=request.spares, last_step=request.last_step,
            fired_through=request.fired, quarantine=request.quarantine,
        )  # fmt: skip
        return self._form(plan, fired_through=request.fired, seconds=self.group.durations.recover_s, phases={"plan_s": 0.5})

    def rollback(self, *, last_step: int, rejoin: bool, fired_through: Optional[int] = None) -> Reformed:
        fired = last_step + 1 if fired_through is None else fired_through
        plan = plan_recovery(self, last_step=last_step, fired_through=fired)
        # In place, the workers keep the chaos faults they hold; a world joined again (a rejoin,
        # or the initial state rebuilt) starts from its job's.
        new_world = rejoin or plan.restore is None
        return self._form(plan, fired_through=fired if new_world else None, seconds=self.group.durations.recover_s)

    def _form(
        self, plan: RecoveryPlan, *, fired_through: Optional[int], seconds: float, phases: Optional[dict[str, float]] = None
    ) -> Reformed:
        """Carry ``plan`` out: the new world's seats, dp, spares and job; its restore, unless a
        crash_restoring fault strikes it (``fired_through``: a world joined after a failure seen
        then, whose workers start from its job's faults; None: the same workers, in place)."""
        g = self.group
        if not plan.reused:
            self.unfinished = Fetched(plan.last_step, plan.restore)
        # A bad device leaves with its worker; one that keeps a seat moves with it.
        g.bad_ranks = {new for new, old in enumerate(plan.seats) if old in g.bad_ranks}
        if fired_through is not None:
            g.straggles = tuple(s for s in g.straggles if kept_by_new_world(s.fault, fired_through=fired_through))
        self.chaos = plan.faults
        g.dp = plan.dp
        self.spares -= plan.spares
        g.clock.advance(seconds)
        g.phases = {"warm_s": 0.0, "join_s": 0.0}  # a world formed to its restore
        if plan.crashes:
            raise WorkerError(plan.crashes[0].rank, "h", "worker process died (ActorDiedError)", kind="died")
        g.restore_to(plan.step)
        g.phases = {**g.phases, "restore_s": 0.0}
        self.unfinished = None
        return Reformed(plan.step, phases if phases is not None else {}, plan.seats, plan)

    def cordon(self, ranks: tuple[int, ...]) -> None:
        pass

    def skip_batch(self, batch: int) -> range:
        g = self.group
        g.skipped.add(batch)
        return range(batch * g.G, (batch + 1) * g.G)

    def replenish_spares(self, target: int) -> None:
        if self.replenish:
            self.spares = max(self.spares, target)

    def spares_changed(self) -> bool:
        return False

    def growth_capacity(self) -> int:
        g = self.group
        free = (self.capacity_from is not None and g.clock() >= self.capacity_from) or (
            self.capacity_after_step is not None and g.step >= self.capacity_after_step
        )
        return self.capacity_replicas * g.cp if free else 0

    def prepare_growth(self, replicas: int) -> None:
        self.preparing = replicas

    def growth_ready(self) -> bool:
        if self.warm_polls:
            self.warm_polls -= 1
            return False
        return self.preparing > 0

    def grow(self, *, new_dp: int, last_step: int) -> Reformed:
        plan = plan_recovery(self, last_step=last_step, new_dp=new_dp, fired_through=last_step, grow=True)
        self.preparing = 0
        return self._form(plan, fired_through=last_step, seconds=self.group.durations.grow_s)

    def layout(self) -> dict[str, Any]:
        return {"dp": self.group.dp, "ranks": list(range(self.group.dp * self.group.cp))}
