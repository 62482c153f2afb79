"""Scripted stand-ins for the Controller's collaborators, shared by the Controller's tests
(test_controller_*.py, test_stragglers.py, test_recovery_retry.py): a two-rank group, a recording
persister, and a dp x cp world on the real data order with an Elastic that carries out the
decisions on it; helpers to build a job, run it and read what it wrote. No Ray, no torch.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from ringtrain import config
from ringtrain.actors.controller import Controller
from ringtrain.policies.elastic import reseat
from ringtrain.policies.faults import Capacity, Outcome, RankOutcome
from ringtrain.errors import WorkerError
from ringtrain.status import StepReport, WorkerInfo
from ringtrain.checkpoint.retention import retained
from ringtrain.telemetry.rundir import RunDir
from ringtrain.topology import Topology


class ScriptedGroup:
    """Two ranks whose step ``fail_at`` goes wrong in the scripted way."""

    # What the Group protocol asks beyond the steps: no phases, one world, no holders.
    startup: dict[str, float] = {}
    phases: dict[str, float] = {}
    generation = 1
    holders: dict[str, Any] = {}

    def __init__(self, *, fail_at: Optional[int] = None, failure: str = "nan") -> None:
        self.num_params = 123
        self.infos = [WorkerInfo(rank=r, host="h", pid=r, device="cpu") for r in range(2)]
        self.topology = Topology(dp=2, cp=1)  # the world of job()'s mesh.dp=2
        self.fail_at = fail_at
        self.failure = failure
        self.step = 0
        self.shut_down = False
        self.snapshot_requests: list[int] = []

    def start(self) -> None:
        pass

    def train_step(self, probe: bool = False, on_safe: Optional[Callable[[int], None]] = None) -> list[StepReport]:
        self.step += 1
        if self.step == self.fail_at and self.failure == "died":
            raise WorkerError(1, "h", "worker process died", kind="died")
        bad = self.step == self.fail_at and self.failure == "nan"
        loss = math.nan if bad else 5.0 / self.step
        return [
            StepReport(step=self.step, rank=r, loss=loss, local_loss=math.nan if bad and r == 1 else 5.0,
                       lr=1e-3, grad_norm=1.0, num_tokens=64, step_time_s=0.01, samples=(self.step,) if r == 0 else (),
                       probes={"gemm": "good"} if probe else None)
            for r in range(2)
        ]

    def safe_through(self, wait_s: float = 0.0) -> int:
        return self.step

    def snapshot_refs(self, step: int) -> list[Any]:
        self.snapshot_requests.append(step)
        return [f"ref-{step}-{r}" for r in range(2)]

    def pin_snapshots(self, step: int) -> None:
        pass

    def restore(self, blobs: list[bytes]) -> int:
        raise AssertionError("not resumed in these tests")

    def shutdown(self) -> None:
        self.shut_down = True


class RecordingPersister:
    last_durable_step = 0

    def __init__(self) -> None:
        self.errors: list[str] = []
        self.stopped: Optional[str] = None
        self.submitted: list[int] = []
        self.requested = self.submitted
        self.discarded: list[int] = []
        self.closed = False

    def submit(self, step: int, snapshot_refs: list[Any], *, timeout_s: Optional[float] = None) -> None:
        self.submitted.append(step)

    def poll(self) -> list[Any]:
        return []

    def flush(self, timeout_s: Optional[float] = None) -> list[Any]:
        return []

    def discard_after(self, step: int) -> list[int]:
        self.discarded.append(step)
        gone = [s for s in self.submitted if s > step]
        self.submitted = [s for s in self.submitted if s <= step]
        return gone

    def close(self, timeout_s: Optional[float] = None) -> bool:
        self.closed = True
        return True


def job(*overrides: str) -> config.JobConfig:
    return config.load(None, ["mesh.dp=2", "train.steps=6", "checkpoint.persist_every=2", *overrides])



# --- a dp x cp world against a scripted fake Elastic ---------------------------------------
#
# The fake world keeps the real data semantics: the group has a data cursor; a step trains the
# global samples [cursor * G, (cursor + 1) * G) and advances it; replica d of dp reports the
# contiguous G / dp of them from its ring_pos-0 rank. Snapshots hold the cursor; a rollback or a
# reform restores the newest snapshot at or before the step asked for (every
# ``snapshot_every`` steps, so it may be older than the last completed step), and a skip moves
# the cursor one batch on. Time is a fake clock that only the fakes move.

STEP_S = 1.0  # one step
DETECT_S = 0.25  # from a failed step's start to the failure being seen
RECOVER_S = 2.0  # a reform or a rollback
GROW_S = 0.5  # adding replicas at a step boundary
UNIX0 = 1.7e9  # the fake's wall clock at clock time 0


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class FakeStepFailed(Exception):
    def __init__(self, outcomes: list[RankOutcome], seen_at: float, seen_unix: float) -> None:
        super().__init__("step failed")
        self.outcomes = outcomes
        self.seen_at = seen_at
        self.seen_unix = seen_unix


@dataclass(frozen=True)
class Corruption:
    """From the probe round after ``step`` on, ``ranks``' probe digests differ from the rest
    (``once``: only in that round)."""

    step: int
    ranks: tuple[int, ...]
    once: bool = False


@dataclass(frozen=True)
class Fault:
    # crash | node_lost | hang | error (the step fails) | nan (the step's loss is NaN);
    # crash_in_transit: a crash before the last step's snapshots left the rank (with
    # ``transit``), whose newest snapshot is then lost; crash_in_transit_rebuilt: the same, the
    # shard written again from a replica (ZeRO-0), so that snapshot stays whole.
    kind: str
    rank: int


IN_TRANSIT = ("crash_in_transit", "crash_in_transit_rebuilt")


PEER = "RuntimeError: [gloo] Connection closed by peer"
ERROR_FRAME = "ringtrain/train/trainer.py:210 in train_step"  # where a scripted "error" fault raises


class ElasticGroup:
    """dp x cp ranks on the real data order; ``faults`` strike once, on the step's next attempt;
    a ``poisoned`` batch (a data cursor) gives a NaN loss on rank 1 every time it is trained.
    With ``transit``, a step's snapshots reach the holders during the next step (or when waited
    for), as the workers' do: only then is the step safe (``safe_through``)."""

    # What the Group protocol asks beyond the steps: one world, no holders.
    startup: dict[str, float] = {}
    phases: dict[str, float] = {}
    generation = 1
    holders: dict[str, Any] = {}

    def __init__(self, job: config.JobConfig, clock: Clock, faults: Optional[dict[int, list[Fault]]] = None,
                 poisoned: frozenset[int] = frozenset(), snapshot_every: int = 1,
                 corrupt: Optional[Corruption] = None, keep: Optional[int] = None, transit: bool = False) -> None:
        self.num_params = 7
        self.G, self.dp, self.cp = job.train.global_batch, job.mesh.dp, job.mesh.cp
        self.clock = clock
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

    @property
    def topology(self) -> Topology:
        return Topology(self.dp, self.cp)  # dp follows the FakeElastic's reforms and grows

    @property
    def infos(self) -> list[WorkerInfo]:
        # One node per replica.
        return [WorkerInfo(rank=r, host="h", pid=100 + r, device="cpu", node_id=f"node-{r // self.cp}")
                for r in range(self.dp * self.cp)]

    def _probe_round(self) -> dict[int, dict[str, str]]:
        self.scanned.append(self.step)
        c = self.corrupt
        struck = c is not None and self.step >= c.step
        if struck:  # the devices stay bad (they leave with their workers), unless it was ``once``
            self.bad_ranks |= set(c.ranks)
            self.corrupt = None
        found = {r: {"gemm": "bad" if r in self.bad_ranks else "good"} for r in range(self.dp * self.cp)}
        if struck and c.once:
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

    def start(self) -> None:
        pass

    def safe_through(self, wait_s: float = 0.0) -> int:
        if not self.transit or wait_s > 0:  # a wait lets the copy in flight land
            self.safe = self.step
        return self.safe

    def train_step(self, probe: bool = False, on_safe: Optional[Callable[[int], None]] = None) -> list[StepReport]:
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
            self.clock.advance(DETECT_S)
            first_hand = {
                "crash": RankOutcome(fault.rank, Outcome.DIED),
                "crash_in_transit": RankOutcome(fault.rank, Outcome.DIED),
                "crash_in_transit_rebuilt": RankOutcome(fault.rank, Outcome.DIED),
                "node_lost": RankOutcome(fault.rank, Outcome.DIED, node_alive=False),
                "hang": RankOutcome(fault.rank, Outcome.LOST),
                "error": RankOutcome(fault.rank, Outcome.ERROR, error="ValueError: bad batch", where=ERROR_FRAME),
            }[fault.kind]
            outcomes = [first_hand if r == fault.rank else RankOutcome(r, Outcome.ERROR, error=PEER) for r in range(world)]
            raise FakeStepFailed(outcomes, self.clock(), UNIX0 + self.clock())
        self.clock.advance(STEP_S)
        while self.cursor in self.skipped:
            self.cursor += 1
        nan_rank = fault.rank if fault is not None else 1 if self.cursor in self.poisoned else None
        loss = math.nan if nan_rank is not None else 4.0 / step
        batch = range(self.cursor * self.G, (self.cursor + 1) * self.G)
        per = self.G // self.dp
        reports = []
        for rank in range(world):
            replica, ring_pos = divmod(rank, self.cp)
            reports.append(StepReport(
                step=step, rank=rank, loss=loss, local_loss=math.nan if rank == nan_rank else 4.0 / step, lr=1e-3,
                grad_norm=1.0, num_tokens=32, step_time_s=STEP_S, batch=self.cursor,
                samples=tuple(batch[replica * per:(replica + 1) * per]) if ring_pos == 0 else (),
                snapshot_taken=step % self.snapshot_every == 0,
            ))
        self.step, self.cursor = step, self.cursor + 1
        if step % self.snapshot_every == 0:
            self.snapshots[step] = self.cursor
            self._trim()
        if probe:
            found = self._probe_round()
            reports = [dataclasses.replace(r, probes=found[r.rank]) for r in reports]
        return reports

    def restore_to(self, newest: int) -> int:
        step = max(s for s in self.snapshots if s <= newest)
        self.step, self.cursor = step, self.snapshots[step]
        self.safe = step  # the new world's holders get the restored state
        self.snapshots = {s: c for s, c in self.snapshots.items() if s <= step}  # a future rolled back
        return step

    def snapshot_refs(self, step: int) -> list[Any]:
        return []

    def restore(self, blobs: list[bytes]) -> int:
        raise AssertionError("not resumed in these tests")

    def shutdown(self) -> None:
        self.shut_down = True


@dataclass(frozen=True)
class Reformed:
    step: int
    phases: dict[str, float]
    seats: tuple[Optional[int], ...] = ()


class FakeElastic:
    """Carries out decisions on an ElasticGroup and records every call.

    ``capacity_from``: clock time from which ``capacity_replicas`` more replicas' worth of
    workers are free for growth; ``warm_polls``: how many growth_ready polls answer False before the prepared
    workers are ready."""

    failure_type = FakeStepFailed

    def __init__(self, group: ElasticGroup, run_dir: Path, *, spares: int = 0, free_slots: int = 0,
                 capacity_from: Optional[float] = None, capacity_replicas: int = 1, warm_polls: int = 0) -> None:
        self.group, self.run_dir = group, run_dir
        self.spares, self.free_slots = spares, free_slots
        self.capacity_from, self.capacity_replicas, self.warm_polls = capacity_from, capacity_replicas, warm_polls
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.incidents_at_reform: list[dict[str, Any]] = []
        self.preparing = 0

    def named(self, method: str) -> list[dict[str, Any]]:
        return [kwargs for name, kwargs in self.calls if name == method]

    def assess(self, failure: FakeStepFailed) -> list[RankOutcome]:
        self.calls.append(("assess", {}))
        return list(failure.outcomes)

    def capacity(self, lost: tuple[int, ...], *, reuse_slots: bool = True) -> Capacity:
        self.calls.append(("capacity", {"lost": lost, "reuse_slots": reuse_slots}))
        return Capacity(self.spares, self.free_slots)

    def reform(self, *, lost: frozenset[int], new_dp: int, spares: int, last_step: int,
               fired_through: Optional[int] = None, quarantine: bool = False) -> Reformed:
        self.calls.append(("reform", {"lost": lost, "new_dp": new_dp, "spares": spares, "last_step": last_step,
                                      "fired_through": fired_through, "quarantine": quarantine}))
        # What the run directory says while the recovery is under way.
        self.incidents_at_reform += [json.loads(p.read_text()) for p in sorted((self.run_dir / "incidents").glob("*.json"))]
        g = self.group
        step = g.restore_to(last_step)
        seats = reseat(dp=g.dp, cp=g.cp, lost=lost, new_dp=new_dp)
        # A bad device leaves with its worker; one that keeps a seat moves with it.
        g.bad_ranks = {new for new, old in enumerate(seats) if old in g.bad_ranks}
        g.dp = new_dp
        self.spares -= spares
        g.clock.advance(RECOVER_S)
        return Reformed(step, {"plan_s": 0.5}, tuple(seats))

    def cordon(self, ranks: tuple[int, ...]) -> None:
        self.calls.append(("cordon", {"ranks": ranks}))

    def rollback(self, *, last_step: int, rejoin: bool, fired_through: Optional[int] = None) -> int:
        self.calls.append(("rollback", {"last_step": last_step, "rejoin": rejoin, "fired_through": fired_through}))
        step = self.group.restore_to(last_step)
        self.group.clock.advance(RECOVER_S)
        return step

    def skip_batch(self, batch: int) -> range:
        self.calls.append(("skip_batch", {"batch": batch}))
        g = self.group
        g.skipped.add(batch)
        return range(batch * g.G, (batch + 1) * g.G)

    def replenish_spares(self, target: int) -> None:
        self.calls.append(("replenish_spares", {"target": target}))

    def spares_changed(self) -> bool:
        return False

    def growth_capacity(self) -> int:
        self.calls.append(("growth_capacity", {}))
        now = self.group.clock()
        free = self.capacity_from is not None and now >= self.capacity_from
        return self.capacity_replicas * self.group.cp if free else 0

    def prepare_growth(self, replicas: int) -> None:
        self.calls.append(("prepare_growth", {"replicas": replicas}))
        self.preparing = replicas

    def growth_ready(self) -> bool:
        self.calls.append(("growth_ready", {}))
        if self.warm_polls:
            self.warm_polls -= 1
            return False
        return self.preparing > 0

    def grow(self, *, new_dp: int, last_step: int) -> Reformed:
        self.calls.append(("grow", {"new_dp": new_dp, "last_step": last_step}))
        seats = reseat(dp=self.group.dp, cp=self.group.cp, lost=frozenset(), new_dp=new_dp)
        self.group.dp = new_dp
        self.preparing = 0
        self.group.clock.advance(GROW_S)
        return Reformed(last_step, {}, tuple(seats))

    def layout(self) -> dict[str, Any]:
        return {"dp": self.group.dp, "ranks": list(range(self.group.dp * self.group.cp))}


def elastic_job(*, mesh: Optional[dict[str, Any]] = None, train: Optional[dict[str, Any]] = None,
                **controllers: Any) -> config.JobConfig:
    """dp=2 x cp=2, global batch 4 (2 samples per replica), 8 steps, with the given changes.
    Built in code and validated (config.load's OmegaConf merge alone takes longer than a test may)."""
    job = config.JobConfig(
        mesh=config.MeshConfig(**{"dp": 2, "cp": 2, **(mesh or {})}),
        train=config.TrainConfig(**{"global_batch": 4, "steps": 8, **(train or {})}),
        controllers=config.ControllersConfig(**controllers),
    )
    config.validate(job)
    return job


def elastic_run(
    tmp_path: Path, job: config.JobConfig, *, faults: Optional[dict[int, list[Fault]]] = None,
    poisoned: frozenset[int] = frozenset(), snapshot_every: int = 1, corrupt: Optional[Corruption] = None,
    keep: Optional[int] = None, transit: bool = False, **elastic: Any,
) -> tuple[dict[str, Any], ElasticGroup, FakeElastic]:
    clock = Clock()
    group = ElasticGroup(job, clock, faults, poisoned, snapshot_every, corrupt, keep, transit)
    fake = FakeElastic(group, tmp_path, **elastic)
    summary = Controller(job, group, RunDir(tmp_path), elastic=fake, clock=clock).run()
    return summary, group, fake


def reform_call(lost: set[int], *, new_dp: int, spares: int, last_step: int, fired_through: Optional[int] = None,
                quarantine: bool = False) -> dict[str, Any]:
    """A reform as FakeElastic records it; a failed step's by default (seen in the step after
    ``last_step``, slots reused)."""
    return {"lost": frozenset(lost), "new_dp": new_dp, "spares": spares, "last_step": last_step,
            "fired_through": last_step + 1 if fired_through is None else fired_through, "quarantine": quarantine}


def incident_files(run_dir: Path) -> dict[str, dict[str, Any]]:
    return {p.name: json.loads(p.read_text()) for p in sorted((run_dir / "incidents").glob("*.json"))}


def whole(steps: int, *, global_batch: int = 4, skipped: int = 0) -> dict[str, int]:
    """The ledger of a finished run: every sample of every kept step exactly once."""
    return {"steps": steps, "samples": steps * global_batch, "duplicates": 0, "skipped": skipped, "missing": 0}
