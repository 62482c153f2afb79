"""Controller: the job's state machine, driving the WorkerGroup step by step.

States: starting -> running -> finished | failed | stopped. Every transition is logged with
the reason behind it, and the run directory records each step and the outcome whatever
happens: a failed or interrupted run still leaves a summary saying how far it got and why.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import math
import time
from typing import Any, Callable, Optional, Protocol, Sequence

from ringtrain.checkpoint import LoadedCheckpoint
from ringtrain.config import JobConfig
from ringtrain.controllers.snapshots import persist_due
from ringtrain import metrics
from ringtrain.errors import NonFiniteLoss, RingtrainError, WorkerError
from ringtrain.planner.devices import peak_flops
from ringtrain.status import Incident, StepReport, WorkerInfo
from ringtrain.telemetry.progress import Progress
from ringtrain.telemetry.prometheus import RunMetrics
from ringtrain.telemetry.rundir import RunDir

log = logging.getLogger(__name__)


class RunState(enum.Enum):
    STARTING = "starting"
    RUNNING = "running"
    FINISHED = "finished"
    FAILED = "failed"
    STOPPED = "stopped"


_ALLOWED = {
    RunState.STARTING: {RunState.RUNNING, RunState.FAILED, RunState.STOPPED},
    RunState.RUNNING: {RunState.FINISHED, RunState.FAILED, RunState.STOPPED},
}


class Group(Protocol):
    num_params: int
    infos: list[WorkerInfo]

    def start(self) -> None: ...
    def train_step(self) -> list[StepReport]: ...
    def snapshot_refs(self, step: int) -> list[Any]: ...
    def restore(self, blobs: list[bytes]) -> int: ...
    def shutdown(self) -> None: ...


class Durable(Protocol):
    """What the Controller needs of a Persister."""

    last_durable_step: int
    errors: list[str]

    def submit(self, step: int, snapshot_refs: list[Any]) -> None: ...
    def poll(self) -> list[Any]: ...
    def flush(self) -> list[Any]: ...
    def close(self) -> None: ...


class Sink(Protocol):
    """Something that follows the run: TensorBoard, for one."""

    def step(self, record: dict[str, Any]) -> None: ...
    def incident(self, incident: dict[str, Any]) -> None: ...
    def close(self) -> None: ...


# What each kind of worker failure is called in incidents.
_WORKER_FAILURE_KINDS = {"died": "crash", "error": "crash", "timeout": "hang"}


def step_record(reports: list[StepReport], *, dp: int, cp: int, wall_s: float) -> dict[str, Any]:
    """One line of metrics.jsonl from every rank's report of a step."""
    tokens = sum(r.num_tokens for r in reports)
    by_rank = sorted(reports, key=lambda r: r.rank)
    return {
        "step": by_rank[0].step,
        "loss": by_rank[0].loss,
        "lr": by_rank[0].lr,
        "grad_norm": by_rank[0].grad_norm,
        "tokens": tokens,
        "step_time_s": wall_s,
        "rank_step_time_s": [round(r.step_time_s, 6) for r in by_rank],
        "tokens_per_s": tokens / wall_s if wall_s > 0 else 0.0,
        "dp": dp,
        "cp": cp,
        "snapshot_step": min(r.snapshot_step for r in by_rank),
        "snapshot_s": max(r.snapshot_s for r in by_rank),
        "snapshot_bytes": sum(r.snapshot_bytes for r in by_rank),
        "rank_memory_bytes": [r.memory_bytes for r in by_rank],
    }


class Controller:
    def __init__(
        self,
        job: JobConfig,
        group: Group,
        run_dir: RunDir,
        progress: Optional[Progress] = None,
        persister: Optional[Durable] = None,
        resume_from: Optional[LoadedCheckpoint] = None,
        telemetry: Optional[RunMetrics] = None,
        sinks: Sequence[Sink] = (),
        run_id: str = "",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.job = job
        self.group = group
        self.run_dir = run_dir
        self.progress = progress or Progress(job.train.steps, enabled=False)
        self.persister = persister
        self.resume_from = resume_from
        self.telemetry = telemetry
        self.sinks = list(sinks)
        self.run_id = run_id
        self.incidents: list[Incident] = []
        self.clock = clock
        self.state = RunState.STARTING
        self.records: list[dict[str, Any]] = []
        self.samples: set[int] = set()
        self.start_step = 0
        self.persist_s = 0.0
        self.error: Optional[str] = None

    def _transition(self, new: RunState, reason: str) -> None:
        if new not in _ALLOWED.get(self.state, set()):
            raise RuntimeError(f"illegal transition {self.state.value} -> {new.value}")
        log.info("state %s -> %s: %s", self.state.value, new.value, reason)
        self.state = new

    def run(self) -> dict[str, Any]:
        started = self.clock()
        train_s = 0.0
        try:
            self.group.start()
            if self.telemetry is not None and self.group.infos:
                self.telemetry.peak_flops_per_worker = peak_flops(
                    self.group.infos[0].device_name, cpu_cores=self.job.cluster.cpus_per_worker
                )
            if self.resume_from is not None:
                self.start_step = self._resume(self.resume_from)
            self._transition(
                RunState.RUNNING,
                f"{self.job.world_size} workers up (mesh.dp={self.job.mesh.dp}, mesh.cp={self.job.mesh.cp}), "
                f"from step {self.start_step}",
            )
            for step in range(self.start_step + 1, self.job.last_step + 1):
                t0 = self.clock()
                try:
                    reports = self.group.train_step()
                except WorkerError as exc:
                    kind = _WORKER_FAILURE_KINDS.get(exc.kind, "crash")
                    self._incident(kind, (exc.rank,), step, t0, reason=str(exc))
                    raise
                wall = self.clock() - t0
                self._check_finite(reports, step, t0)
                train_s += wall
                self._maybe_persist(step)
                self._record(reports, wall, goodput=train_s / max(self.clock() - started, 1e-9))
            self._drain(wait=True)
            reason = (
                f"train.stop_at_step={self.job.last_step} reached"
                if self.job.train.stop_at_step
                else f"train.steps={self.job.train.steps} reached"
            )
            self._transition(RunState.FINISHED, reason)
        except RingtrainError as exc:
            self.error = str(exc)
            self._transition(RunState.FAILED, self.error)
        except KeyboardInterrupt:
            self.error = "interrupted"
            self._transition(RunState.STOPPED, "interrupted by the user")
        finally:
            self._close_durable()
            self.group.shutdown()
            if self.telemetry is not None:
                self.telemetry.finish()
            for sink in self.sinks:
                sink.close()
        summary = self._summary(wall_s=self.clock() - started, train_s=train_s)
        self.run_dir.write_summary(summary)
        return summary

    def _check_finite(self, reports: list[StepReport], step: int, t0: float) -> None:
        if math.isfinite(reports[0].loss):
            return
        culprits = tuple(sorted(r.rank for r in reports if not math.isfinite(r.local_loss)))
        reason = f"non-finite loss {reports[0].loss} at step {step}, first on ranks {list(culprits)}"
        # Recovery by rollback belongs to the elastic controller; until then the run stops here
        # rather than train on poisoned weights.
        self._incident("nan", culprits, step, t0, reason=reason)
        raise NonFiniteLoss(reason)

    def _incident(self, kind: str, ranks: tuple[int, ...], step: int, t0: float, *, reason: str) -> Incident:
        incident = Incident(
            id=self.run_dir.num_incidents() + 1,
            kind=kind,
            ranks=ranks,
            detected_at_step=step,
            detected_at=time.time(),
            detect_s=self.clock() - t0,
            action="abort",
            reason=reason,
            dp_before=self.job.mesh.dp,
        )
        self.incidents.append(incident)
        record = dataclasses.asdict(incident)
        path = self.run_dir.write_incident(record)
        self.progress.message(f"incident {incident.id}: {kind} on ranks {list(ranks)} at step {step}: {reason} ({path})")
        if self.telemetry is not None:
            self.telemetry.add(metrics.INCIDENTS, 1, kind=kind)
        for sink in self.sinks:
            sink.incident(record)
        return incident

    def _resume(self, checkpoint: LoadedCheckpoint) -> int:
        t0 = self.clock()
        names = sorted(checkpoint.shards)
        step = self.group.restore([checkpoint.shards[n] for n in names])
        self.progress.message(
            f"resumed from {checkpoint.uri} (step {step}, written at dp {checkpoint.meta.get('dp')}) "
            f"in {self.clock() - t0:.2f} s"
        )
        return step

    def _maybe_persist(self, step: int) -> None:
        if self.persister is None:
            return
        if persist_due(step, persist_every=self.job.checkpoint.persist_every, final_step=self.job.last_step):
            # Pending results: the workers serve them while they train the next step.
            self.persister.submit(step, self.group.snapshot_refs(step))
        self._drain(wait=False)

    def _drain(self, *, wait: bool) -> None:
        if self.persister is None:
            return
        for persisted in self.persister.flush() if wait else self.persister.poll():
            self.persist_s = persisted.seconds
            self.progress.message(
                f"checkpoint step {persisted.step}: {persisted.num_bytes / 1e6:.1f} MB in {persisted.seconds:.2f} s -> {persisted.uri}"
            )

    def _close_durable(self) -> None:
        if self.persister is None:
            return
        try:
            self._drain(wait=True)
        finally:
            self.persister.close()

    def _record(self, reports: list[StepReport], wall_s: float, *, goodput: float) -> None:
        record = step_record(reports, dp=self.job.mesh.dp, cp=self.job.mesh.cp, wall_s=wall_s)
        record["persist_s"] = self.persist_s
        record["last_durable_step"] = self.persister.last_durable_step if self.persister else 0
        record["goodput"] = goodput
        if self.telemetry is not None:
            record["mfu"] = self.telemetry.mfu(record["tokens_per_s"], self.job.world_size)
            self.telemetry.step(record)
            self.telemetry.goodput(goodput)
        for sink in self.sinks:
            sink.step(record)
        for r in reports:
            self.samples.update(r.samples)
        self.records.append(record)
        self.run_dir.append_metrics(record)
        self.progress.step(record)

    def _summary(self, *, wall_s: float, train_s: float) -> dict[str, Any]:
        last = self.records[-1] if self.records else None
        tokens = sum(r["tokens"] for r in self.records)
        return {
            "status": self.state.value,
            "steps": self.job.train.steps,
            "start_step": self.start_step,
            "final_step": last["step"] if last else self.start_step,
            "initial_loss": self.records[0]["loss"] if self.records else None,
            "final_loss": last["loss"] if last else None,
            "tokens": tokens,
            "tokens_per_s": tokens / train_s if train_s > 0 else 0.0,
            "wall_time_s": wall_s,
            "train_time_s": train_s,
            # Wall time spent on steps that were kept, start-up and checkpoint waits included.
            "goodput": train_s / wall_s if wall_s > 0 else 0.0,
            "run_id": self.run_id,
            "num_params": self.group.num_params,
            "num_samples": len(self.samples),
            "dp": self.job.mesh.dp,
            "cp": self.job.mesh.cp,
            "resumed_from": self.resume_from.uri if self.resume_from else None,
            "last_durable_step": self.persister.last_durable_step if self.persister else 0,
            "checkpoint_errors": list(self.persister.errors) if self.persister else [],
            "incidents": [{"id": i.id, "kind": i.kind, "ranks": list(i.ranks), "step": i.detected_at_step} for i in self.incidents],
            # Incidents the run recovered from; recovery arrives with the elastic controller.
            "recoveries": [],
            "error": self.error,
            "run_dir": str(self.run_dir.path),
        }
