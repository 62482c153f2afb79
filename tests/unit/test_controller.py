"""The Controller's state machine against a scripted worker group: no Ray, no torch."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import pytest

from ringtrain import config
from ringtrain.actors.controller import Controller
from ringtrain.controllers.elastic import reseat
from ringtrain.controllers.faults import Capacity, Outcome, RankOutcome
from ringtrain.errors import WorkerError
from ringtrain.status import StepReport, WorkerInfo
from ringtrain.checkpoint.retention import retained
from ringtrain.telemetry.rundir import RunDir


class ScriptedGroup:
    """Two ranks whose step ``fail_at`` goes wrong in the scripted way."""

    def __init__(self, *, fail_at: Optional[int] = None, failure: str = "nan") -> None:
        self.num_params = 123
        self.infos = [WorkerInfo(rank=r, host="h", pid=r, device="cpu") for r in range(2)]
        self.fail_at = fail_at
        self.failure = failure
        self.step = 0
        self.shut_down = False
        self.snapshot_requests: list[int] = []

    def start(self) -> None:
        pass

    def train_step(self, probe: bool = False) -> list[StepReport]:
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
        self.submitted: list[int] = []
        self.discarded: list[int] = []
        self.closed = False

    def submit(self, step: int, snapshot_refs: list[Any]) -> None:
        self.submitted.append(step)

    def poll(self) -> list[Any]:
        return []

    def flush(self) -> list[Any]:
        return []

    def discard_after(self, step: int) -> list[int]:
        self.discarded.append(step)
        gone = [s for s in self.submitted if s > step]
        self.submitted = [s for s in self.submitted if s <= step]
        return gone

    def close(self) -> None:
        self.closed = True


def job(*overrides: str) -> config.JobConfig:
    return config.load(None, ["mesh.dp=2", "train.steps=6", "checkpoint.persist_every=2", *overrides])


def test_a_clean_run_finishes_and_persists_on_cadence(tmp_path: Path) -> None:
    group, persister = ScriptedGroup(), RecordingPersister()
    summary = Controller(job(), group, RunDir(tmp_path), persister=persister).run()

    assert summary["status"] == "finished" and summary["final_step"] == 6
    assert persister.submitted == [2, 4, 6] == group.snapshot_requests
    assert persister.closed and group.shut_down
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3, 4, 5, 6]
    assert json.loads((tmp_path / "summary.json").read_text())["num_samples"] == 6
    assert not (tmp_path / "incidents").exists()


def test_stop_at_step_ends_early_and_persists_that_step(tmp_path: Path) -> None:
    group, persister = ScriptedGroup(), RecordingPersister()
    summary = Controller(job("train.stop_at_step=3"), group, RunDir(tmp_path), persister=persister).run()
    assert (summary["status"], summary["final_step"]) == ("finished", 3)
    assert persister.submitted == [2, 3]


@pytest.mark.parametrize(
    ("failure", "kind", "ranks"),
    [("nan", "nan", [1]), ("died", "crash", [1])],
)
def test_a_failed_step_records_an_incident_and_fails_the_run(tmp_path: Path, failure: str, kind: str, ranks: list[int]) -> None:
    group = ScriptedGroup(fail_at=3, failure=failure)
    summary = Controller(job(), group, RunDir(tmp_path)).run()

    assert summary["status"] == "failed" and summary["final_step"] == 2
    (path,) = sorted((tmp_path / "incidents").glob("*.json"))
    assert path.name == f"0001-{kind}.json"
    incident = json.loads(path.read_text())
    assert (incident["kind"], incident["ranks"], incident["detected_at_step"], incident["action"]) == (kind, ranks, 3, "abort")
    assert summary["incidents"] == [{"id": 1, "kind": kind, "ranks": ranks, "step": 3}]
    assert group.shut_down
    # The poisoned step is not in the metrics: nothing after step 2 was kept.
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 2


# --- recovery and elasticity against a scripted fake Elastic ------------------------------
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
    kind: str  # crash | node_lost | hang | error (the step fails) | nan (the step's loss is NaN)
    rank: int


PEER = "RuntimeError: [gloo] Connection closed by peer"
ERROR_FRAME = "ringtrain/train/trainer.py:210 in train_step"  # where a scripted "error" fault raises


class ElasticGroup:
    """dp x cp ranks on the real data order; ``faults`` strike once, on the step's next attempt;
    a ``poisoned`` batch (a data cursor) gives a NaN loss on rank 1 every time it is trained."""

    def __init__(self, job: config.JobConfig, clock: Clock, faults: Optional[dict[int, list[Fault]]] = None,
                 poisoned: frozenset[int] = frozenset(), snapshot_every: int = 1,
                 corrupt: Optional[Corruption] = None, keep: Optional[int] = None) -> None:
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

    def train_step(self, probe: bool = False) -> list[StepReport]:
        step = self.step + 1
        self.attempts.append(step)
        world = self.dp * self.cp
        pending = self.faults.get(step, [])
        fault = pending.pop(0) if pending else None
        if fault is not None and fault.kind != "nan":
            self.clock.advance(DETECT_S)
            first_hand = {
                "crash": RankOutcome(fault.rank, Outcome.DIED),
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
    keep: Optional[int] = None, **elastic: Any,
) -> tuple[dict[str, Any], ElasticGroup, FakeElastic]:
    clock = Clock()
    group = ElasticGroup(job, clock, faults, poisoned, snapshot_every, corrupt, keep)
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


@pytest.mark.parametrize(
    "snapshot_every, resumed",
    # The crash is in step 6, so the last completed step is 5; its newest snapshot is step 5
    # (every step) or step 3 (every third), which loses steps 4 and 5.
    [(1, 5), (3, 3)],
    ids=["restore-last-step", "restore-older-step"],
)
def test_a_crash_with_a_warm_spare_replaces_the_rank_and_the_run_finishes(
    tmp_path: Path, snapshot_every: int, resumed: int
) -> None:
    job = elastic_job(mesh={"spares": 1})
    summary, group, fake = elastic_run(
        tmp_path, job, faults={6: [Fault("crash", 3)]}, snapshot_every=snapshot_every, spares=1
    )

    assert (summary["status"], summary["final_step"], summary["dp"]) == ("finished", 8, 2)
    assert fake.named("reform") == [reform_call({3}, new_dp=2, spares=1, last_step=5)]
    assert fake.named("replenish_spares") == [{"target": 1}]
    # Steps 1-6 were attempted, then training went on after the restore point.
    assert group.attempts == [1, 2, 3, 4, 5, 6, *range(resumed + 1, 9)]
    # The struck steps were trained again on the same samples: each sample exactly once.
    assert summary["ledger"] == whole(8)
    (recovery,) = summary["recoveries"]
    assert (recovery["kind"], recovery["action"], recovery["ranks"], recovery["detected_at_step"]) == ("crash", "replace", [3], 6)
    assert (recovery["dp_before"], recovery["dp_after"], recovery["lost_steps"]) == (2, 2, 5 - resumed)
    # Every step took STEP_S on the fake clock; the crashed attempt DETECT_S, the reform RECOVER_S.
    steps_run = 5 + (8 - resumed)
    wall = steps_run * STEP_S + DETECT_S + RECOVER_S
    assert summary["wall_time_s"] == pytest.approx(wall)
    assert summary["train_time_s"] == pytest.approx(8 * STEP_S)
    assert summary["goodput"] == pytest.approx(8 * STEP_S / wall)


@pytest.mark.parametrize("kind", ["crash", "hang", "node_lost"])
def test_a_lost_rank_without_a_spare_shrinks_the_job(tmp_path: Path, kind: str) -> None:
    job = elastic_job(mesh={"min_dp": 1})
    summary, group, fake = elastic_run(tmp_path, job, faults={3: [Fault(kind, 2)]})

    # Rank 2 is ring_pos 0 of replica 1 (cp=2): that replica goes, dp 2 -> 1.
    assert fake.named("capacity") == [{"lost": (2,), "reuse_slots": True}]
    assert fake.named("reform") == [reform_call({2}, new_dp=1, spares=0, last_step=2)]
    assert (summary["status"], summary["final_step"], summary["dp"]) == ("finished", 8, 1)
    (recovery,) = summary["recoveries"]
    assert (recovery["kind"], recovery["action"], recovery["dp_before"], recovery["dp_after"]) == (kind, "shrink", 2, 1)
    # The global batch is unchanged: replica 0 now trains all 4 samples of each step.
    assert summary["ledger"] == whole(8)
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["dp"]) for r in lines] == [(1, 2), (2, 2), *((s, 1) for s in range(3, 9))]
    assert summary["resizes"] == []  # no capacity came back
    assert json.loads((tmp_path / "workers.json").read_text()) == {"dp": 1, "ranks": [0, 1]}


@pytest.mark.parametrize(
    "spares, free_slots, action, status",
    [(0, 2, "replace", "finished"), (1, 0, "replace", "finished"), (0, 0, "abort", "failed")],
    ids=["new-worker", "spare", "nothing"],
)
def test_at_min_dp_a_lost_rank_is_replaced_or_the_run_fails(
    tmp_path: Path, spares: int, free_slots: int, action: str, status: str
) -> None:
    job = elastic_job(mesh={"min_dp": 2})
    summary, _, fake = elastic_run(tmp_path, job, faults={4: [Fault("crash", 1)]}, spares=spares, free_slots=free_slots)

    assert summary["status"] == status
    (incident,) = incident_files(tmp_path).values()
    assert (incident["kind"], incident["action"], incident["dp_before"]) == ("crash", action, 2)
    if status == "finished":
        assert fake.named("reform") == [reform_call({1}, new_dp=2, spares=spares, last_step=3)]
        assert summary["ledger"] == whole(8)
    else:
        assert fake.named("reform") == [] and summary["recoveries"] == []
        assert summary["final_step"] == 3 and "mesh.min_dp=2" in summary["error"]
        assert summary["ledger"] == whole(3)


def test_an_exception_in_a_rank_s_own_code_rolls_back_in_place_and_rejoins(tmp_path: Path) -> None:
    summary, group, fake = elastic_run(tmp_path, elastic_job(), faults={3: [Fault("error", 1)]})

    assert summary["status"] == "finished" and summary["dp"] == 2
    assert fake.named("capacity") == [] and fake.named("reform") == []  # no seat to fill
    assert fake.named("rollback") == [{"last_step": 2, "rejoin": True, "fired_through": 3}]
    (recovery,) = summary["recoveries"]
    assert (recovery["kind"], recovery["ranks"], recovery["action"]) == ("error", [1], "rollback")
    assert group.attempts == [1, 2, 3, 3, 4, 5, 6, 7, 8]
    assert summary["ledger"] == whole(8)


@pytest.mark.parametrize("on_nan", ["skip", "retry"])
def test_a_nan_rolls_back_then_skips_or_retries_the_batch(tmp_path: Path, on_nan: str) -> None:
    summary, group, fake = elastic_run(tmp_path, elastic_job(on_nan=on_nan), faults={3: [Fault("nan", 1)]})

    assert summary["status"] == "finished" and summary["final_step"] == 8
    assert fake.named("rollback") == [{"last_step": 2, "rejoin": False, "fired_through": 3}]
    (recovery,) = summary["recoveries"]
    assert (recovery["kind"], recovery["ranks"], recovery["action"], recovery["lost_steps"]) == ("nan", [1], "rollback", 0)
    assert group.attempts == [1, 2, 3, 3, 4, 5, 6, 7, 8]
    if on_nan == "skip":
        # Step 3's batch (cursor 2, samples 8-11) is dropped; steps 3-8 train cursors 3-8.
        assert len(fake.named("skip_batch")) == 1
        assert summary["ledger"] == whole(8, skipped=4)
        lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in lines] == [1, 2, 3, 4, 5, 6, 7, 8]  # the NaN step is not kept
    else:
        assert fake.named("skip_batch") == []
        assert summary["ledger"] == whole(8)


def test_a_skipped_poisoned_batch_is_not_met_again(tmp_path: Path) -> None:
    # Batch 4 (step 5's) gives NaN every time it is trained: skipping it is the way through.
    summary, _, fake = elastic_run(tmp_path, elastic_job(on_nan="skip"), poisoned=frozenset({4}))

    assert summary["status"] == "finished"
    assert len(summary["recoveries"]) == 1
    assert summary["ledger"] == whole(8, skipped=4)
    # Step 5 NaN'd, rolled back to step 4, then went on with batch 5.
    assert fake.group.attempts == [1, 2, 3, 4, 5, 5, 6, 7, 8]


def test_on_nan_abort_fails_the_run_without_a_rollback(tmp_path: Path) -> None:
    summary, _, fake = elastic_run(tmp_path, elastic_job(on_nan="abort"), faults={3: [Fault("nan", 0)]})

    assert (summary["status"], summary["final_step"]) == ("failed", 2)
    assert "controllers.on_nan=abort" in summary["error"]
    assert fake.named("rollback") == [] and fake.named("skip_batch") == []
    assert summary["recoveries"] == []
    ((name, incident),) = incident_files(tmp_path).items()
    assert name == "0001-nan.json" and (incident["action"], incident["ranks"]) == ("abort", [0])


@pytest.mark.parametrize("max_recoveries", [0, 1, 2])
def test_more_failures_than_max_recoveries_fail_the_run(tmp_path: Path, max_recoveries: int) -> None:
    # A poisoned batch retried comes back every time: recovery after recovery, until the cap.
    job = elastic_job(on_nan="retry", max_recoveries=max_recoveries)
    summary, group, fake = elastic_run(tmp_path, job, poisoned=frozenset({2}))

    assert summary["status"] == "failed"
    assert f"controllers.max_recoveries={max_recoveries}" in summary["error"]
    assert len(fake.named("rollback")) == len(summary["recoveries"]) == max_recoveries
    actions = [i["action"] for i in incident_files(tmp_path).values()]
    assert actions == ["rollback"] * max_recoveries + ["abort"]
    assert group.attempts == [1, 2] + [3] * (max_recoveries + 1)
    assert summary["ledger"] == whole(2)


def test_an_incident_is_written_when_seen_and_again_with_recover_s_after_the_next_step(tmp_path: Path) -> None:
    summary, _, fake = elastic_run(tmp_path, elastic_job(mesh={"spares": 1}), faults={4: [Fault("crash", 3)]}, spares=1)

    # While the reform ran, the incident was already on disk, recovery still open.
    (at_detection,) = fake.incidents_at_reform
    assert (at_detection["kind"], at_detection["action"], at_detection["recover_s"], at_detection["dp_after"]) == (
        "crash", "replace", None, None,
    )
    ((name, done),) = incident_files(tmp_path).items()
    assert name == "0001-crash.json"
    # Step 4 started at 3.0 and failed at 3.25 (DETECT_S): the reform took RECOVER_S, then the
    # retried step 4 STEP_S, so training was back 2.0 + 1.0 after the failure was seen.
    assert done["detect_s"] == pytest.approx(DETECT_S)
    assert done["detected_at"] == pytest.approx(UNIX0 + 3 * STEP_S + DETECT_S)
    assert done["recover_s"] == pytest.approx(RECOVER_S + STEP_S)
    assert (done["dp_after"], done["lost_steps"], done["phases"]) == (2, 0, {"plan_s": 0.5})
    assert [o["outcome"] for o in done["verdict"]["outcomes"]] == ["error", "error", "error", "died"]
    assert summary["recoveries"][0]["recover_s"] == pytest.approx(RECOVER_S + STEP_S)


def test_workers_json_follows_the_layout_after_each_change(tmp_path: Path) -> None:
    clock = Clock()
    job = elastic_job(mesh={"min_dp": 1})
    group = ElasticGroup(job, clock, {3: [Fault("crash", 3)]})
    fake = FakeElastic(group, tmp_path)
    controller = Controller(job, group, RunDir(tmp_path), elastic=fake, clock=clock)
    layouts: list[dict[str, Any]] = []
    write_workers = controller.run_dir.write_workers

    def spy(layout: dict[str, Any]) -> None:
        layouts.append(layout)
        write_workers(layout)

    controller.run_dir.write_workers = spy  # type: ignore[method-assign]
    controller.run()

    # Once at the start (dp 2, ranks 0-3), once after the shrink to dp 1.
    assert layouts == [{"dp": 2, "ranks": [0, 1, 2, 3]}, {"dp": 1, "ranks": [0, 1]}]
    assert json.loads((tmp_path / "workers.json").read_text()) == layouts[-1]


@pytest.mark.parametrize(
    "heartbeat_s, warm_polls, polls, grown_after",
    [
        # The shrink resumes after step 2; capacity is free from t=5.0. Checks every step
        # (heartbeat 1 s = one step): seen after step 3 (t=5.25), the gate opens 3 s later after
        # step 6, workers are prepared, ready at the next poll: grown after step 7.
        (1.0, 0, 4, 7),
        # Ready only at the third poll: after step 9.
        (1.0, 2, 4, 9),
        # Checks every 2 s: after steps 3, 5, 7 (t=5.25, 7.25, 9.25); the gate opens after step 7.
        (2.0, 0, 3, 8),
    ],
    ids=["every-step", "slow-warmup", "every-other-step"],
)
def test_after_a_shrink_the_job_grows_back_when_capacity_has_stayed(
    tmp_path: Path, heartbeat_s: float, warm_polls: int, polls: int, grown_after: int
) -> None:
    job = elastic_job(train={"steps": 10}, mesh={"min_dp": 1}, grow_after_s=3.0, heartbeat_s=heartbeat_s)
    summary, _, fake = elastic_run(
        tmp_path, job, faults={3: [Fault("crash", 2)]}, capacity_from=5.0, warm_polls=warm_polls
    )

    assert (summary["status"], summary["final_step"], summary["dp"]) == ("finished", 10, 2)
    # Capacity is only looked for while dp < max_dp (= mesh.dp = 2), never once grown back.
    assert len(fake.named("growth_capacity")) == polls
    assert fake.named("prepare_growth") == [{"replicas": 1}]
    assert fake.named("grow") == [{"new_dp": 2, "last_step": grown_after}]
    (resize,) = summary["resizes"]
    assert (resize["step"], resize["dp_before"], resize["dp_after"]) == (grown_after, 1, 2)
    assert resize["seconds"] == pytest.approx(GROW_S)
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    dps = [2, 2] + [1] * (grown_after - 2) + [2] * (10 - grown_after)
    assert [r["dp"] for r in lines] == dps
    assert summary["ledger"] == whole(10)
    assert json.loads((tmp_path / "workers.json").read_text())["dp"] == 2


def test_no_growth_when_capacity_never_returns(tmp_path: Path) -> None:
    job = elastic_job(mesh={"min_dp": 1}, grow_after_s=0.0)
    summary, _, fake = elastic_run(tmp_path, job, faults={3: [Fault("crash", 2)]})

    assert summary["dp"] == 1 and summary["resizes"] == []
    assert fake.named("prepare_growth") == [] and fake.named("grow") == []


@pytest.mark.parametrize(
    "capacity_replicas, grown",
    # Global batch 8 allows dp 1, 2, 4 (not 3): one replica's worth of capacity more than dp 2
    # cannot be used; two replicas' worth grows the job to 4. grow_after_s=0: the first check,
    # after step 1, opens the gate; the prepared workers are ready at the poll after step 2.
    [(1, []), (2, [{"new_dp": 4, "last_step": 2}])],
    ids=["dp-3-not-allowed", "dp-4"],
)
def test_a_job_below_max_dp_grows_only_to_an_allowed_dp(tmp_path: Path, capacity_replicas: int, grown: list[dict[str, int]]) -> None:
    job = elastic_job(mesh={"max_dp": 4}, train={"global_batch": 8}, grow_after_s=0.0)
    summary, _, fake = elastic_run(tmp_path, job, capacity_from=0.0, capacity_replicas=capacity_replicas)

    assert fake.named("grow") == grown
    assert summary["dp"] == (4 if grown else 2)
    assert fake.named("prepare_growth") == ([{"replicas": 2}] if grown else [])
    assert summary["ledger"] == whole(8, global_batch=8)


# --- edge cases: shrink onto an allowed dp, skips behind the restore point, back-to-back failures ---


def test_a_shrink_lands_on_a_dp_that_divides_the_global_batch(tmp_path: Path) -> None:
    # Global batch 8, micro-batch 1: allowed dps are 1, 2, 4. Losing replica 3 of 4 leaves 3
    # replicas' worth; the largest allowed dp that fits is 2.
    job = elastic_job(mesh={"dp": 4, "cp": 1, "min_dp": 1}, train={"global_batch": 8})
    summary, _, fake = elastic_run(tmp_path, job, faults={2: [Fault("crash", 3)]})

    assert [call["new_dp"] for call in fake.named("reform")] == [2]
    assert summary["dp"] == 2
    assert summary["ledger"] == whole(8, global_batch=8)


def test_on_nan_skip_drops_the_poisoned_batch_even_when_the_restore_point_is_older(tmp_path: Path) -> None:
    # Snapshots every 3 steps; batch 4 (step 5's) is poisoned. The rollback after step 5 goes back
    # to step 3 (cursor 3); steps 4.. must then train batches 3, 5, 6, ... with 4 dropped.
    job = elastic_job(on_nan="skip", max_recoveries=3)
    summary, _, _ = elastic_run(tmp_path, job, poisoned=frozenset({4}), snapshot_every=3)

    assert summary["status"] == "finished"
    assert len(summary["recoveries"]) == 1
    assert summary["ledger"] == whole(8, skipped=4)


def test_back_to_back_failures_both_get_recover_s(tmp_path: Path) -> None:
    summary, _, _ = elastic_run(
        tmp_path, elastic_job(mesh={"spares": 2}), faults={3: [Fault("crash", 3), Fault("crash", 1)]}, spares=2
    )

    assert summary["status"] == "finished"
    first, second = incident_files(tmp_path).values()
    # Step 3 starts at 2.0 and fails at 2.25; reform to 4.25; the retry fails at 4.5; reform to
    # 6.5; the second retry completes at 7.5: training is back 5.25 after the first failure.
    assert second["recover_s"] == pytest.approx(7.5 - 4.5)
    assert first["recover_s"] == pytest.approx(7.5 - 2.25)


class BrokenGroup(ElasticGroup):
    def train_step(self, probe: bool = False) -> list[StepReport]:
        if self.step == 2:
            raise RuntimeError("a bug in the group")
        return super().train_step()


def test_an_unexpected_exception_still_leaves_a_summary(tmp_path: Path) -> None:
    job = elastic_job()
    clock = Clock()
    group = BrokenGroup(job, clock)
    try:
        Controller(job, group, RunDir(tmp_path), elastic=FakeElastic(group, tmp_path), clock=clock).run()
    except RuntimeError:
        pass

    assert group.shut_down
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert (summary["status"], summary["final_step"]) == ("failed", 2)


# --- silent data corruption -------------------------------------------------------------


def test_a_clean_run_scans_on_the_cadence_and_pins_each_clean_scan(tmp_path: Path) -> None:
    job = elastic_job(sdc_every_steps=3)
    summary, group, _ = elastic_run(tmp_path, job, keep=2)

    # The first step's round sets the golden values; the last step is always scanned.
    assert group.scanned == [1, 3, 6, 8] and group.pins == [1, 3, 6, 8]
    assert summary["sdc"] == {"scans": 4, "last_clean_scan": 8}
    assert summary["incidents"] == [] and summary["ledger"] == whole(8)


@pytest.mark.parametrize("spares, action, dp_after", [(1, "replace", 2), (0, "shrink", 1)])
def test_a_corrupting_rank_is_evicted_and_training_rolls_back_to_the_last_clean_scan(
    tmp_path: Path, spares: int, action: str, dp_after: int
) -> None:
    job = elastic_job(sdc_every_steps=3, mesh={"spares": spares})
    # Rank 2's device goes bad in step 4; workers keep 2 snapshots plus the pinned one, so
    # step 3's snapshot is still there when the scan after step 6 finds the damage.
    summary, group, fake = elastic_run(tmp_path, job, corrupt=Corruption(4, (2,)), keep=2, spares=spares)

    assert fake.named("capacity") == [{"lost": (2,), "reuse_slots": False}]  # its slot is not used again
    assert fake.named("reform") == [
        reform_call({2}, new_dp=dp_after, spares=spares, last_step=3, fired_through=6, quarantine=True)
    ]
    (incident,) = incident_files(tmp_path).values()
    assert (incident["kind"], incident["ranks"], incident["detected_at_step"], incident["action"]) == ("sdc", [2], 6, action)
    assert incident["lost_steps"] == 3 and incident["recover_s"] is not None
    sdc = incident["verdict"]["sdc"]
    assert (sdc["kind"], sdc["ranks"], sdc["probes"]) == ("outlier", [2], ["gemm"])
    assert incident["verdict"]["last_clean_scan"] == 3
    # Steps 4-6 trained on the bad device are redone from step 3's state.
    assert group.attempts == [1, 2, 3, 4, 5, 6, 4, 5, 6, 7, 8]
    assert (summary["status"], summary["final_step"], summary["dp"]) == ("finished", 8, dp_after)
    assert summary["ledger"] == whole(8)
    assert summary["sdc"]["last_clean_scan"] == 8 and not group.bad_ranks


def test_evicting_the_node_takes_every_rank_on_it(tmp_path: Path) -> None:
    job = elastic_job(sdc_every_steps=3, sdc_evict_node=True)
    summary, _, fake = elastic_run(tmp_path, job, corrupt=Corruption(4, (3,)))

    # Ranks 2 and 3 share replica 1's node: both go, and the node is cordoned before the
    # capacity to replace them is counted.
    assert [name for name, _ in fake.calls if name in ("cordon", "capacity", "reform")] == ["cordon", "capacity", "reform"]
    assert fake.named("cordon") == [{"ranks": (2, 3)}]
    assert fake.named("reform") == [reform_call({2, 3}, new_dp=1, spares=0, last_step=3, fired_through=6, quarantine=True)]
    (incident,) = summary["incidents"]
    assert (incident["kind"], incident["ranks"]) == ("sdc", [2, 3])
    assert summary["status"] == "finished"


def test_a_rank_bad_from_the_start_is_evicted_at_the_first_round(tmp_path: Path) -> None:
    job = elastic_job(sdc_every_steps=3, mesh={"spares": 1})
    summary, group, fake = elastic_run(tmp_path, job, corrupt=Corruption(0, (1,)), spares=1)

    # The first step's round finds it; the run starts over from the initial state.
    assert fake.named("reform") == [reform_call({1}, new_dp=2, spares=1, last_step=0, fired_through=1, quarantine=True)]
    assert summary["incidents"] == [{"id": 1, "kind": "sdc", "ranks": [1], "step": 1}]
    assert group.attempts == [1, *range(1, 9)] and summary["ledger"] == whole(8)


def test_a_scan_that_names_no_rank_rolls_back_in_place_to_the_last_clean_scan(tmp_path: Path) -> None:
    job = elastic_job(sdc_every_steps=3)
    # Every rank's digest changes alike, in one round only (a transient in what they share).
    summary, group, fake = elastic_run(tmp_path, job, corrupt=Corruption(6, (0, 1, 2, 3), once=True), keep=1)

    assert fake.named("reform") == []
    assert fake.named("rollback") == [{"last_step": 3, "rejoin": False, "fired_through": 6}]
    (incident,) = incident_files(tmp_path).values()
    assert (incident["kind"], incident["ranks"], incident["action"]) == ("sdc", [], "rollback")
    assert incident["verdict"]["sdc"]["kind"] == "shared"
    assert group.attempts == [1, 2, 3, 4, 5, 6, 4, 5, 6, 7, 8]
    assert (summary["status"], summary["dp"], summary["ledger"]) == ("finished", 2, whole(8))


def test_without_recovery_a_failed_scan_fails_the_run_naming_the_rank(tmp_path: Path) -> None:
    job = elastic_job(sdc_every_steps=3)
    clock = Clock()
    group = ElasticGroup(job, clock, corrupt=Corruption(4, (2,)))
    summary = Controller(job, group, RunDir(tmp_path), clock=clock).run()

    assert summary["status"] == "failed" and summary["final_step"] == 6
    assert "silent data corruption" in summary["error"] and "rank 2" in summary["error"]
    assert summary["incidents"] == [{"id": 1, "kind": "sdc", "ranks": [2], "step": 6}]


def test_scans_off_run_no_probe_round(tmp_path: Path) -> None:
    summary, group, _ = elastic_run(tmp_path, elastic_job(sdc_every_steps=0))
    assert group.scanned == [] and summary["sdc"] is None


def test_durable_checkpoints_written_after_the_last_clean_scan_are_deleted(tmp_path: Path) -> None:
    job = elastic_job(sdc_every_steps=3, mesh={"spares": 1})
    job = dataclasses.replace(job, checkpoint=dataclasses.replace(job.checkpoint, persist_every=2))
    clock = Clock()
    group = ElasticGroup(job, clock, corrupt=Corruption(4, (2,)))
    persister = RecordingPersister()
    summary = Controller(job, group, RunDir(tmp_path), persister=persister, elastic=FakeElastic(group, tmp_path, spares=1),
                         clock=clock).run()

    # Step 4's checkpoint held the corrupt state: gone. Step 6's round failed before it was
    # written. The redone steps 4, 6 and 8 were written afresh.
    assert summary["status"] == "finished" and persister.discarded == [3]
    assert persister.submitted == [2, 4, 6, 8]


def test_the_same_error_on_the_same_step_twice_stops_the_run_naming_the_frame(tmp_path: Path) -> None:
    # A deterministic error comes back on the step's retry: one rollback, then the run stops,
    # well before controllers.max_recoveries (20) runs out.
    summary, group, fake = elastic_run(tmp_path, elastic_job(), faults={3: [Fault("error", 1)] * 3})

    assert summary["status"] == "failed" and summary["final_step"] == 2
    assert group.attempts == [1, 2, 3, 3]
    assert len(fake.named("rollback")) == 1
    location = summary["error_location"]
    assert (location["type"], location["message"], location["step"], location["ranks"]) == ("ValueError", "bad batch", 3, [1])
    assert location["frame"] == ERROR_FRAME and ERROR_FRAME in summary["error"]
    first, second = incident_files(tmp_path).values()
    assert (first["action"], second["action"]) == ("rollback", "abort")
    assert second["verdict"]["error"]["frame"] == ERROR_FRAME and "came back on step 3" in second["reason"]
