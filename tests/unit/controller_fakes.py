"""Stand-ins for the Controller's collaborators, shared by the Controller's tests
(test_controller_*.py, test_stragglers.py, test_recovery_retry.py): a two-rank scripted group, a
recording persister, and the simulated dp x cp world (``actors.simulated``) with its recovery's
calls recorded; helpers to build a job, run it and read what it wrote. No Ray, no torch.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any, Callable, Optional

from ringtrain import config
from ringtrain.actors.controller import Controller
from ringtrain.actors.protocols import Reform, Reformed
from ringtrain.actors.simulated import (  # noqa: F401  (the tests import these from here)
    ERROR_FRAME, UNIX0, Clock, Corruption, Durations, Fault, SimulatedGroup, SimulatedRecovery,
)
from ringtrain.actors.steps import StepResult
from ringtrain.policies.faults import Capacity, RankOutcome
from ringtrain.errors import WorkerError
from ringtrain.status import StepReport, WorkerInfo
from ringtrain.telemetry.rundir import RunDir
from ringtrain.topology import Topology


class ScriptedGroup:
    """Two ranks whose step ``fail_at`` goes wrong in the scripted way."""

    # What the Group protocol asks beyond the steps: no phases, one world, no holders, from step 0.
    startup: dict[str, float] = {}
    phases: dict[str, float] = {}
    generation = 1
    holders: dict[str, Any] = {}
    start_step = 0

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

    def train_step(self, probe: bool = False, on_safe: Optional[Callable[[int], None]] = None) -> StepResult:
        self.step += 1
        if self.step == self.fail_at and self.failure == "died":
            raise WorkerError(1, "h", "worker process died", kind="died")
        bad = self.step == self.fail_at and self.failure == "nan"
        loss = math.nan if bad else 5.0 / self.step
        return StepResult(reports=tuple(
            StepReport(step=self.step, rank=r, loss=loss, local_loss=math.nan if bad and r == 1 else 5.0,
                       lr=1e-3, grad_norm=1.0, num_tokens=64, step_time_s=0.01, samples=(self.step,) if r == 0 else (),
                       probes={"gemm": "good"} if probe else None)
            for r in range(2)
        ))

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
        self.failed_saves: list[str] = []
        self.failed_in_a_row = 0
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

    def describe(self, exc: BaseException) -> str:
        return f"{type(exc).__name__}: {exc}"


def job(*overrides: str) -> config.JobConfig:
    return config.load(None, ["mesh.dp=2", "train.steps=6", "checkpoint.persist_every=2", *overrides])



# --- a dp x cp world: the product's simulated cluster, its recovery's calls recorded -----
#
# actors.simulated keeps the real data semantics (a data cursor, snapshots holding it, a
# rollback or a reform restoring what the product's recovery plan picks, the newest whole
# snapshot at or before the step asked for, a skip moving the cursor a batch on); time is its
# clock, which only it moves. The tests read its durations
# under the names below, and FakeElastic records every call the Controller makes of the
# recovery, with what the run directory said while a reform ran.

STEP_S, DETECT_S, RECOVER_S, GROW_S = (getattr(Durations(), f.name) for f in dataclasses.fields(Durations))
ElasticGroup = SimulatedGroup


class FakeElastic(SimulatedRecovery):
    """The simulated recovery, every call recorded (``calls``, ``named``)."""

    def __init__(self, group: SimulatedGroup, run_dir: Path, **capacity: Any) -> None:
        # A lost node takes only the rank that reported it: these tests script one rank's loss.
        super().__init__(group, whole_nodes=False, **capacity)
        self.run_dir = run_dir
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.incidents_at_reform: list[dict[str, Any]] = []

    def named(self, method: str) -> list[dict[str, Any]]:
        return [kwargs for name, kwargs in self.calls if name == method]

    def assess(self, failure: StepResult) -> list[RankOutcome]:
        self.calls.append(("assess", {}))
        return super().assess(failure)

    def capacity(self, lost: tuple[int, ...], *, reuse_slots: bool = True) -> Capacity:
        self.calls.append(("capacity", {"lost": lost, "reuse_slots": reuse_slots}))
        return super().capacity(lost, reuse_slots=reuse_slots)

    def reform(self, request: Reform) -> Reformed:
        self.calls.append(("reform", dataclasses.asdict(request)))
        # What the run directory says while the recovery is under way.
        self.incidents_at_reform += [json.loads(p.read_text()) for p in sorted((self.run_dir / "incidents").glob("*.json"))]
        return super().reform(request)

    def cordon(self, ranks: tuple[int, ...]) -> None:
        self.calls.append(("cordon", {"ranks": ranks}))

    def rollback(self, *, last_step: int, rejoin: bool, fired_through: Optional[int] = None) -> Reformed:
        self.calls.append(("rollback", {"last_step": last_step, "rejoin": rejoin, "fired_through": fired_through}))
        return super().rollback(last_step=last_step, rejoin=rejoin, fired_through=fired_through)

    def skip_batch(self, batch: int) -> range:
        self.calls.append(("skip_batch", {"batch": batch}))
        return super().skip_batch(batch)

    def replenish_spares(self, target: int) -> None:
        self.calls.append(("replenish_spares", {"target": target}))

    def growth_capacity(self) -> int:
        self.calls.append(("growth_capacity", {}))
        return super().growth_capacity()

    def prepare_growth(self, replicas: int) -> None:
        self.calls.append(("prepare_growth", {"replicas": replicas}))
        super().prepare_growth(replicas)

    def growth_ready(self) -> bool:
        self.calls.append(("growth_ready", {}))
        return super().growth_ready()

    def grow(self, *, new_dp: int, last_step: int) -> Reformed:
        self.calls.append(("grow", {"new_dp": new_dp, "last_step": last_step}))
        return super().grow(new_dp=new_dp, last_step=last_step)


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
