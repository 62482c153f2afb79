"""Controller: the job's state machine, driving the WorkerGroup step by step.

States: starting -> running -> finished | failed | stopped. Every transition is logged with
the reason behind it, and the run directory records each step and the outcome whatever
happens: a failed or interrupted run still leaves a summary saying how far it got and why.
"""

from __future__ import annotations

import enum
import logging
import time
from typing import Any, Callable, Optional, Protocol

from ringtrain.config import JobConfig
from ringtrain.errors import RingtrainError
from ringtrain.status import StepReport
from ringtrain.telemetry.progress import Progress
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

    def start(self) -> None: ...
    def train_step(self) -> list[StepReport]: ...
    def shutdown(self) -> None: ...


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
    }


class Controller:
    def __init__(
        self,
        job: JobConfig,
        group: Group,
        run_dir: RunDir,
        progress: Optional[Progress] = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.job = job
        self.group = group
        self.run_dir = run_dir
        self.progress = progress or Progress(job.train.steps, enabled=False)
        self.clock = clock
        self.state = RunState.STARTING
        self.records: list[dict[str, Any]] = []
        self.samples: set[int] = set()
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
            self._transition(
                RunState.RUNNING, f"{self.job.world_size} workers up (mesh.dp={self.job.mesh.dp}, mesh.cp={self.job.mesh.cp})"
            )
            for _ in range(self.job.train.steps):
                t0 = self.clock()
                reports = self.group.train_step()
                wall = self.clock() - t0
                train_s += wall
                self._record(reports, wall)
            self._transition(RunState.FINISHED, f"train.steps={self.job.train.steps} reached")
        except RingtrainError as exc:
            self.error = str(exc)
            self._transition(RunState.FAILED, self.error)
        except KeyboardInterrupt:
            self.error = "interrupted"
            self._transition(RunState.STOPPED, "interrupted by the user")
        finally:
            self.group.shutdown()
        summary = self._summary(wall_s=self.clock() - started, train_s=train_s)
        self.run_dir.write_summary(summary)
        return summary

    def _record(self, reports: list[StepReport], wall_s: float) -> None:
        record = step_record(reports, dp=self.job.mesh.dp, cp=self.job.mesh.cp, wall_s=wall_s)
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
            "final_step": last["step"] if last else 0,
            "initial_loss": self.records[0]["loss"] if self.records else None,
            "final_loss": last["loss"] if last else None,
            "tokens": tokens,
            "tokens_per_s": tokens / train_s if train_s > 0 else 0.0,
            "wall_time_s": wall_s,
            "train_time_s": train_s,
            "num_params": self.group.num_params,
            "num_samples": len(self.samples),
            "dp": self.job.mesh.dp,
            "cp": self.job.mesh.cp,
            "error": self.error,
            "run_dir": str(self.run_dir.path),
        }
