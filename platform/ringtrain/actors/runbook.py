"""RunBook: what has run and been recorded, the one owner of the run's record.

The step records (metrics.jsonl) with the samples each trained (the ledger) and the wall time
kept, the incidents (the open ones: recovered from, their next step not recorded yet), the
resizes, the evaluations, the start's phases, the error that ended the run, and the summary
made of all of it, told to the run's observers (``actors.observers``: the run directory, the
console, Prometheus, TensorBoard). The Controller decides; the RunBook keeps the record, so each
stays readable on its own.

A step's record says the step is done and survives a failure: a step that took snapshots is
held back until the holders have them (``actors.safekeeping``), in step order, which the group
says while the next step runs. A recovery writes the held records of the steps it restored and
drops the others: those steps were never recorded, and are trained again.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, cast

from ringtrain import metrics
from ringtrain.actors.evaluation import EvalGroup, EvalPlan, evaluate, model_tokenizer, plan_for
from ringtrain.actors.observers import Observers
from ringtrain.actors.protocols import Group
from ringtrain.actors.records import recovery_entry, step_record
from ringtrain.checkpoint import LoadedCheckpoint
from ringtrain.config import JobConfig
from ringtrain.policies.ledger import SampleLedger
from ringtrain.status import Incident, StepReport
from ringtrain.telemetry.rundir import RunDir
from ringtrain.train.mixture import chat_packing_counts

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HeldRecord:
    """A step's record waiting for its snapshots to be safe, with the samples it trained on."""

    record: dict[str, Any]
    samples: tuple[int, ...]
    origins: tuple[tuple[int, int], ...]
    needs_safety: bool  # the step took snapshots (else nothing of it can be made safer)

    @property
    def step(self) -> int:
        return int(self.record["step"])


class RunBook:
    def __init__(
        self,
        job: JobConfig,
        group: Group,
        run_dir: RunDir,
        observers: Observers,
        clock: Callable[[], float],
        *,
        run_id: str = "",
        resume_from: Optional[LoadedCheckpoint] = None,
        startup: Optional[dict[str, float]] = None,
        eval_plan: Optional[EvalPlan] = None,
    ) -> None:
        """``run_dir``: read here (incident numbering, its path), written through ``observers``.
        ``startup``: phases before the controller (ray.init); ``eval_plan``: what eval.every
        scores (read from eval.data on the first evaluation unless given)."""
        self.job, self.group, self.run_dir, self.observers, self.clock = job, group, run_dir, observers, clock
        self.run_id = run_id
        self.resume_from = resume_from
        self.started = 0.0  # clock time the run began
        self.records: list[dict[str, Any]] = []
        self.held: list[HeldRecord] = []  # records not written yet, oldest first
        self.ledger = SampleLedger()
        self.kept_s = 0.0  # wall time of the steps kept so far (goodput's numerator)
        self.incidents: list[Incident] = []
        self.open: list[tuple[Incident, float]] = []  # recovered from, awaiting their next recorded step
        self.resizes: list[dict[str, Any]] = []
        self.error: Optional[str] = None
        self.error_location: Optional[dict[str, Any]] = None  # a repeating error's type, message, frame, step
        self.startup: dict[str, float] = dict(startup or {})  # seconds by start phase, for summary.json
        self.transit: dict[str, Any] = {}  # snapshot transit window by holder role (actors.transit)
        self.eval_plan = eval_plan
        self.last_eval: Optional[dict[str, Any]] = None

    # --- incidents -----------------------------------------------------------------------

    def incident(
        self,
        kind: str,
        ranks: tuple[int, ...],
        step: int,
        t0: float,
        *,
        reason: str,
        action: str = "abort",
        detected_at: Optional[float] = None,
        detect_s: Optional[float] = None,
        verdict: Optional[dict[str, Any]] = None,
    ) -> Incident:
        incident = Incident(
            id=self.run_dir.num_incidents() + 1,
            kind=kind,
            ranks=ranks,
            detected_at_step=step,
            detected_at=detected_at if detected_at is not None else time.time(),
            detect_s=detect_s if detect_s is not None else self.clock() - t0,
            action=action,
            reason=reason,
            dp_before=self.group.topology.dp,
            verdict=verdict,
        )
        self.incidents.append(incident)
        self.observers.on_incident(dataclasses.asdict(incident))
        return incident

    def update_incident(self, incident: Incident) -> None:
        self.incidents = [incident if i.id == incident.id else i for i in self.incidents]
        self.observers.on_incident_update(dataclasses.asdict(incident))

    def recoveries(self) -> int:
        """The recoveries made so far: every incident acted on, retries included."""
        return sum(1 for i in self.incidents if i.action not in ("abort", "report"))

    def recovered(self, incident: Incident, seen_at: float) -> None:
        """``incident`` was recovered from: written again, and open until the next step is
        recorded (``close_open``)."""
        self.update_incident(incident)
        self.open.append((incident, seen_at))

    def close_open(self) -> None:
        """The first step after a recovery was recorded: each open incident's clock closes."""
        for incident, seen_at in self.open:
            incident = dataclasses.replace(incident, recover_s=self.clock() - seen_at)
            self.update_incident(incident)
            self.observers.on_count(metrics.RECOVERIES, 1)
            self.observers.on_gauge(metrics.RECOVERY_SECONDS, incident.recover_s or 0.0)
            self.observers.on_count(metrics.LOST_STEPS, incident.lost_steps)
            self.observers.on_gauge(metrics.DP_SIZE, self.group.topology.dp)
        self.open = []

    # --- steps ---------------------------------------------------------------------------

    @property
    def start_step(self) -> int:
        """The step the run began after (the group's: 0, or the step a resume restored)."""
        return self.group.start_step

    def resume(self, checkpoint: LoadedCheckpoint) -> None:
        """Every rank loads ``checkpoint``: the run begins after its step (``start_step``)."""
        t0 = self.clock()
        names = sorted(checkpoint.shards)
        step = self.group.restore([checkpoint.shards[n] for n in names])
        self.observers.on_message(
            f"resumed from {checkpoint.uri} (step {step}, written at dp {checkpoint.meta.get('dp')}) "
            f"in {self.clock() - t0:.2f} s"
        )

    def maybe_evaluate(self, step: int) -> Optional[dict[str, Any]]:
        """Every eval.every steps and after the last: the eval plan scored on the state after
        ``step``, for that step's record. Outside the step's timing; a failure in it fails the
        run (recovery covers training steps only)."""
        every = self.job.eval.every
        if not every or (step % every and step != self.job.last_step):
            return None
        if self.eval_plan is None:
            self.eval_plan = plan_for(self.job, tokenizer=model_tokenizer(self.job))
        t0 = self.clock()
        found = evaluate(cast(EvalGroup, self.group), self.eval_plan).to_dict()
        found["seconds"] = self.clock() - t0
        self.last_eval = {"step": step, **{k: found.get(k) for k in ("loss", "perplexity", "tokens")}}
        passkey, tasks = found.get("passkey"), found.get("tasks")
        scored = (f"loss {_or_dash(found['loss'], '.4f')}, perplexity {_or_dash(found['perplexity'], '.4g')} "
                  f"over {found['tokens']} tokens") if "loss" in found else "no data"
        self.observers.on_message(
            f"eval after step {step}: {scored}" + (f", passkey {passkey['overall']:.0%}" if passkey else "")
            + (f", tasks {', '.join(sorted(tasks))}" if tasks else "") + f" ({found['seconds']:.1f} s)"
        )
        return found

    def record(
        self, reports: list[StepReport], wall_s: float, durable: dict[str, Any], evaluation: Optional[dict[str, Any]] = None
    ) -> None:
        """Make the step's record (``durable``: the durable checkpoints' fields of it); it is
        written once its snapshots are safe (``commit``)."""
        self.startup.setdefault("first_step_s", self.clock() - self.started)
        topology = self.group.topology
        record = step_record(reports, dp=topology.dp, cp=topology.cp, wall_s=wall_s)
        if evaluation is not None:
            record["eval"] = evaluation
        record["reported_at"] = time.time()  # every rank's report in; "time" is when it is written
        record["generation"] = self.group.generation
        record.update(durable)
        # Wall time on steps that were kept: a step struck out by a rollback stops counting.
        self.kept_s += wall_s
        record["goodput"] = self.kept_s / max(self.clock() - self.started, 1e-9)
        record.update(self.observers.step_fields(record))  # MFU, with the telemetry's model FLOPs
        samples = tuple(s for r in reports for s in r.samples)
        origins = tuple(o for r in reports for o in r.origins)
        self.held.append(HeldRecord(record, samples, origins, needs_safety=reports[0].snapshot_taken))
        self.commit(self.group.safe_through())

    def commit(self, safe_through: int, *, unsafe_too: bool = False) -> None:
        """Write the held records, oldest first, up to the first whose snapshots are not known
        to be safe (past ``safe_through``); with ``unsafe_too``, every one."""
        while self.held and (unsafe_too or not self.held[0].needs_safety or self.held[0].step <= safe_through):
            held = self.held.pop(0)
            record = {**held.record, "time": time.time()}
            self.ledger.record(held.step, held.samples, held.origins)
            self.records.append(record)
            self.observers.on_step(record)

    def rewind(self, resumed: int) -> list[int]:
        """After a recovery to ``resumed``: the held records of the steps it restored are
        written (their state was just read back whole), the later ones dropped, to be redone;
        the recorded steps after it are struck out (returned) and their time no longer kept."""
        self.held = [h for h in self.held if h.step <= resumed]
        self.commit(resumed, unsafe_too=True)
        struck = self.ledger.rollback(resumed)
        self.records = [r for r in self.records if r["step"] <= resumed]
        self.kept_s = sum(r["step_time_s"] for r in self.records)
        return struck

    def commit_all(self, wait_s: float) -> None:
        """At the end of the run: wait up to ``wait_s`` for the last snapshots to be safe, then
        write every held record (a run that stops has no recovery left to protect)."""
        if self.held:
            self.commit(self.group.safe_through(wait_s))
            if self.held:
                log.warning("steps %s recorded before their snapshots were known to be safe", [h.step for h in self.held])
            self.commit(0, unsafe_too=True)

    @property
    def last_step(self) -> int:
        """The newest step recorded (the start step before any)."""
        return self.records[-1]["step"] if self.records else self.start_step

    # --- the summary ---------------------------------------------------------------------

    def summary(
        self, *, status: str, wall_s: float, durable: dict[str, Any], sdc: Optional[dict[str, int]]
    ) -> dict[str, Any]:
        """summary.json: ``durable``, the durable checkpoints' fields; ``sdc``, the scans'."""
        last = self.records[-1] if self.records else None
        tokens = sum(r["tokens"] for r in self.records)
        train_s = self.kept_s
        ledger = self.ledger.totals()
        topology = self.group.topology
        return {
            "status": status,
            "steps": self.job.train.steps,
            "start_step": self.start_step,
            "final_step": last["step"] if last else self.start_step,
            "initial_loss": self.records[0]["loss"] if self.records else None,
            "final_loss": last["loss"] if last else None,
            "tokens": tokens,
            "tokens_per_s": tokens / train_s if train_s > 0 else 0.0,
            "wall_time_s": wall_s,
            "train_time_s": train_s,
            # Wall time spent on steps that were kept, start-up, recoveries and checkpoint waits included.
            "goodput": train_s / wall_s if wall_s > 0 else 0.0,
            "run_id": self.run_id,
            "num_params": self.group.num_params,
            # The workers' device as they name it: the report says what peak its MFU is against.
            "device": self.group.infos[0].device_name if self.group.infos else None,
            "num_samples": ledger["samples"],
            "ledger": ledger,
            "dp": topology.dp,
            "cp": topology.cp,
            "resumed_from": self.resume_from.uri if self.resume_from else None,
            "last_durable_step": durable["last_durable_step"],
            "checkpoint_errors": durable["checkpoint_errors"],
            "incidents": [{"id": i.id, "kind": i.kind, "ranks": list(i.ranks), "step": i.detected_at_step} for i in self.incidents],
            "recoveries": [recovery_entry(i) for i in self.incidents if i.action not in ("abort", "report")],
            "resizes": self.resizes,
            "sdc": sdc,
            "error": self.error,
            "error_location": self.error_location,
            # From the controller's start: each phase of the workers' start, and the first step done.
            "startup": self.startup,
            # Step record -> snapshot readable at the node's holder and the buddy's, in ms.
            "snapshot_transit": self.transit,
            "eval": self.last_eval,
            # A chat dataset's conversations, or a preference dataset's pairs, packed into rows, dropped or
            # truncated (None: neither).
            "chat": chat_packing_counts(self.job),
            "run_dir": str(self.run_dir.path),
            "durable_stopped": durable["durable_stopped"],
        }


def _or_dash(value: Optional[float], spec: str) -> str:
    return "-" if value is None else format(value, spec)
