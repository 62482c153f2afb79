"""A simulated cluster: the Controller's worker group and recovery with no process, on a clock
that only the simulation moves.

``SimulatedGroup`` is a dp x cp world on the real data order: a data cursor; a step trains the
global samples [cursor * G, (cursor + 1) * G) and moves it on; replica d reports its contiguous
G / dp of them from its ring position 0. Snapshots hold the cursor, every ``snapshot_every``
steps, kept as the workers keep them (``checkpoint.retention``), and a step's snapshots are safe
off their ranks either at once or, with ``transit``, while the next step runs. ``faults`` strike
a step once, on its next attempt (``Fault``: a crash, a lost node, a hang, an error, a NaN, a
crash before the last step's snapshots left the rank), a ``poisoned`` batch makes every attempt
at it NaN, a ``Corruption`` makes some ranks' SDC probe digests differ from the rest, and a
``Straggle`` makes a rank compute slowly for some steps, until a new world replaces it.

``SimulatedRecovery`` carries the Controller's decisions out on it (``actors.protocols.Elastic``):
a reform or a rollback restores the newest snapshot at or before the step asked for, a skip
drops a batch, a grow adds replicas; spares, free slots and returning capacity are numbers. The
job's ``crash_restoring`` chaos faults strike its reforms as they strike ``actors.recovery``'s:
a worker of the world being formed dies while it restores.

The Controller and its policies run on them unchanged: the same decisions, incidents and sample
ledger as on Ray, in milliseconds, each move taking the time ``Durations`` says.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable, Optional

from ringtrain.actors.protocols import Reform
from ringtrain.actors.steps import StepResult
from ringtrain.chaos import FaultPlan
from ringtrain.checkpoint.retention import retained
from ringtrain.config import JobConfig
from ringtrain.errors import WorkerError
from ringtrain.policies.elastic import reseat
from ringtrain.policies.faults import Capacity, Outcome, RankOutcome
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


@dataclass(frozen=True)
class Reformed:
    """A world formed again: the step it restored, the time of each phase, who sits where."""

    step: int
    phases: dict[str, float]
    seats: tuple[Optional[int], ...] = ()


class SimulatedGroup:
    """A dp x cp world of simulated ranks, ``ranks_per_node`` to a node (``actors.protocols.Group``)."""

    # One world as far as the records go, no start-up timed, no holder actors.
    startup: dict[str, float] = {}
    generation = 1
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
        self.snapshots = {0: 0}  # step -> data cursor after it
        self.attempts: list[int] = []  # every step started, in order
        self.shut_down = False
        self.corrupt = corrupt
        self.bad_ranks: set[int] = set()  # ranks whose device went bad (the corruption struck)
        self.keep = keep  # snapshots held as the workers hold them (None: all)
        self.pinned: Optional[int] = None
        self.scanned: list[int] = []  # the step each probe round ran after
        self.pins: list[int] = []
        self.transit = transit
        self.safe = 0  # the newest step whose snapshots reached the holders
        self.straggles = straggles
        self.phases: dict[str, float] = {}  # of the last world formed: a failed one's ends where it broke

    @property
    def topology(self) -> Topology:
        return Topology(self.dp, self.cp)  # dp follows the recovery's reforms and grows

    @property
    def infos(self) -> list[WorkerInfo]:
        return [
            WorkerInfo(rank=r, host="h", pid=100 + r, device="cpu", node_id=f"node-{r // self.ranks_per_node}")
            for r in range(self.dp * self.cp)
        ]

    def start(self) -> None:
        pass

    def safe_through(self, wait_s: float = 0.0) -> int:
        if not self.transit or wait_s > 0:  # a wait lets the copy in flight land
            self.safe = self.step
        return self.safe

    def train_step(self, probe: bool = False, on_safe: Optional[Callable[[int], None]] = None) -> StepResult:
        step = self.step + 1
        self.attempts.append(step)
        world = self.dp * self.cp
        pending = self.faults.get(step, [])
        fault = pending.pop(0) if pending else None
        if fault is not None and fault.kind == "crash_in_transit":
            self.snapshots.pop(self.step, None)  # the dead rank's newest shard never left it
        elif self.transit and self.safe < self.step and (fault is None or fault.kind not in IN_TRANSIT):
            self.safe = self.step  # the last step's snapshots land while this one runs
            if on_safe is not None:
                on_safe(self.safe)
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
            self.snapshots[step] = self.cursor
            self._trim()
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
        self.pinned = step
        self._trim()

    def _trim(self) -> None:
        if self.keep is not None:
            held = retained(self.snapshots, keep=self.keep, pin=self.pinned)
            self.snapshots = {s: c for s, c in self.snapshots.items() if s in held}

    def restore_to(self, newest: int) -> int:
        """Every rank back at the newest snapshot at or before ``newest``; the step restored."""
        step = max(s for s in self.snapshots if s <= newest)
        self.step, self.cursor = step, self.snapshots[step]
        self.safe = step  # the new world's holders get the restored state
        self.snapshots = {s: c for s, c in self.snapshots.items() if s <= step}  # a future rolled back
        return step

    def snapshot_refs(self, step: int) -> list[Any]:
        return []

    def restore(self, blobs: list[bytes]) -> int:
        raise NotImplementedError("a simulated run starts from step 0")

    def shutdown(self) -> None:
        self.shut_down = True


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
    """Carries the Controller's decisions out on a SimulatedGroup (``actors.protocols.Elastic``).

    ``spares``: warm spares at the start; ``free_slots``: room for new workers; from clock time
    ``capacity_from`` on (or once step ``capacity_after_step`` is done), ``capacity_replicas``
    more replicas' worth of workers are free for growth; ``warm_polls``: how many
    ``growth_ready`` polls answer False before the workers started for growth are ready. ``whole_nodes``: a node found gone takes every rank on it, as
    ``actors.recovery.Recovery.assess`` finds on Ray (off: only the rank that reported it).
    ``replenish``: after a recovery the warm spares are made whole at once, as on a cluster with
    room for them once their warm-up is done (off: spares seated are gone). ``job``: whose
    ``crash_restoring`` faults strike the reforms."""

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
        # The job's crash_restoring faults, each taken by the first reform it strikes.
        self.restoring = FaultPlan(list(job.chaos.faults) if job is not None else [])

    def assess(self, failure: StepResult) -> list[RankOutcome]:
        if not self.whole_nodes:
            return list(failure.outcomes)
        per_node = self.group.ranks_per_node
        gone = {o.rank // per_node for o in failure.outcomes if o.outcome is Outcome.DIED and not o.node_alive}
        return [
            dataclasses.replace(o, outcome=Outcome.DIED, node_alive=False, error=o.error or "node lost")
            if o.rank // per_node in gone else o
            for o in failure.outcomes
        ]

    def capacity(self, lost: tuple[int, ...], *, reuse_slots: bool = True) -> Capacity:
        return Capacity(self.spares, self.free_slots)

    def reform(self, request: Reform) -> Reformed:
        lost, new_dp, spares, last_step, fired = request.lost, request.new_dp, request.spares, request.last_step, request.fired
        g = self.group
        step = g.restore_to(last_step)
        seats = reseat(dp=g.dp, cp=g.cp, lost=lost, new_dp=new_dp)
        # A bad device leaves with its worker; one that keeps a seat moves with it.
        g.bad_ranks = {new for new, old in enumerate(seats) if old in g.bad_ranks}
        # A new world's job drops the faults due by the failed step (``actors.recovery.world_job``).
        g.straggles = tuple(s for s in g.straggles if s.steps.start > fired)
        g.dp = new_dp
        self.spares -= spares
        g.clock.advance(g.durations.recover_s)
        crashes = self.restoring.restoring_due(fired) if step > 0 else []  # they wait for a snapshot to restore
        g.phases = {"warm_s": 0.0, "join_s": 0.0}  # a world formed to its restore
        if crashes:
            self.restoring.faults = [f for f in self.restoring.faults if all(f is not c for c in crashes)]
            raise WorkerError(crashes[0].rank, "h", "worker process died (ActorDiedError)", kind="died")
        g.phases = {**g.phases, "restore_s": 0.0}
        return Reformed(step, {"plan_s": 0.5}, tuple(seats))

    def cordon(self, ranks: tuple[int, ...]) -> None:
        pass

    def rollback(self, *, last_step: int, rejoin: bool, fired_through: Optional[int] = None) -> int:
        step = self.group.restore_to(last_step)
        self.group.clock.advance(self.group.durations.recover_s)
        return step

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
        g = self.group
        seats = reseat(dp=g.dp, cp=g.cp, lost=frozenset(), new_dp=new_dp)
        g.dp = new_dp
        self.preparing = 0
        g.clock.advance(g.durations.grow_s)
        return Reformed(last_step, {}, tuple(seats))

    def layout(self) -> dict[str, Any]:
        return {"dp": self.group.dp, "ranks": list(range(self.group.dp * self.group.cp))}
