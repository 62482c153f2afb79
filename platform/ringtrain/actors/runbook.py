"""RunBook: what the Controller writes down about a run, and the durable copies it keeps.

The step records (metrics.jsonl), incidents, worker layout and summary, told to the run's
observers (``actors.observers``: the run directory, the console, Prometheus, TensorBoard), the
durable checkpoints handed to the Persister, a resume's restore and the evaluations due on the
step cadence. A mixin of the Controller: the state machine decides, this part keeps the record,
so each stays readable on its own.

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

from ringtrain.actors.evaluation import EvalGroup, EvalPlan, evaluate, model_tokenizer, plan_for
from ringtrain.actors.observers import Observers
from ringtrain.actors.protocols import Durable, Elastic, Group
from ringtrain.actors.records import recovery_entry, step_record
from ringtrain.actors.states import State
from ringtrain.checkpoint import LoadedCheckpoint
from ringtrain.config import JobConfig
from ringtrain.policies.ledger import SampleLedger
from ringtrain.policies.sdc import SdcScanner
from ringtrain.policies.snapshots import persist_due
from ringtrain.status import Incident, StepReport
from ringtrain.telemetry.rundir import RunDir
from ringtrain.topology import Topology
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
    """The Controller's records; the attributes are the Controller's (set in its __init__)."""

    job: JobConfig
    group: Group
    run_dir: RunDir  # read here (incident numbering, its path); written through the observers
    observers: Observers
    persister: Optional[Durable]
    resume_from: Optional[LoadedCheckpoint]
    run_id: str
    elastic: Optional[Elastic]
    incidents: list[Incident]
    clock: Callable[[], float]
    records: list[dict[str, Any]]
    held: list[HeldRecord]  # records not written yet, oldest first
    ledger: SampleLedger
    start_step: int
    persist_s: float
    error: Optional[str]
    error_location: Optional[dict[str, Any]]
    resizes: list[dict[str, Any]]
    _kept_s: float
    last_clean_scan: int
    scans: int
    eval_plan: Optional[EvalPlan]
    last_eval: Optional[dict[str, Any]]
    startup: dict[str, float]
    transit: dict[str, Any]
    state: State  # the Controller's (actors.states)
    sdc: Optional[SdcScanner]

    @property
    def topology(self) -> Topology:
        """The grid of the world training runs in now: the group's, which changes when a
        recovery or a grow forms a new world (a world that broke forming counts: it is the one
        a retry recovers from)."""
        return self.group.topology

    @property
    def dp(self) -> int:
        return self.topology.dp

    def _write_layout(self) -> None:
        if self.elastic is not None:
            self.observers.on_layout(self.elastic.layout())

    def _incident(
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
            dp_before=self.dp,
            verdict=verdict,
        )
        self.incidents.append(incident)
        self.observers.on_incident(dataclasses.asdict(incident))
        return incident

    def _update_incident(self, incident: Incident) -> None:
        self.incidents = [incident if i.id == incident.id else i for i in self.incidents]
        self.observers.on_incident_update(dataclasses.asdict(incident))

    def _resume(self, checkpoint: LoadedCheckpoint) -> int:
        t0 = self.clock()
        names = sorted(checkpoint.shards)
        step = self.group.restore([checkpoint.shards[n] for n in names])
        self.observers.on_message(
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
            self.observers.on_message(
                f"checkpoint step {persisted.step}: {persisted.num_bytes / 1e6:.1f} MB in {persisted.seconds:.2f} s -> {persisted.uri}"
            )

    def _discard_durable_after(self, step: int) -> None:
        """Durable checkpoints written after ``step`` hold state the probes have since rejected."""
        if self.persister is None:
            return
        self._drain(wait=True)
        gone = self.persister.discard_after(step)
        if gone:
            self.observers.on_message(f"deleted durable checkpoints of steps {gone}: written after the last clean scan")

    def _close_durable(self, wait_s: Optional[float] = None) -> None:
        """Wait for the saves in flight (at most ``wait_s``: a stopping run's bound) and close
        the Persister."""
        if self.persister is None:
            return
        try:
            if wait_s is None:
                self._drain(wait=True)
            else:
                self.persister.flush(timeout_s=wait_s)
        finally:
            self.persister.close(timeout_s=wait_s)

    def _maybe_evaluate(self, step: int) -> Optional[dict[str, Any]]:
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

    def _record(
        self, reports: list[StepReport], wall_s: float, started: float, evaluation: Optional[dict[str, Any]] = None
    ) -> None:
        """Make the step's record; it is written once its snapshots are safe (``_commit``)."""
        self.startup.setdefault("first_step_s", self.clock() - started)
        record = step_record(reports, dp=self.dp, cp=self.topology.cp, wall_s=wall_s)
        if evaluation is not None:
            record["eval"] = evaluation
        record["reported_at"] = time.time()  # every rank's report in; "time" is when it is written
        record["generation"] = self.group.generation
        record["persist_s"] = self.persist_s
        record["last_durable_step"] = self.persister.last_durable_step if self.persister else 0
        # Wall time on steps that were kept: a step struck out by a rollback stops counting.
        self._kept_s += wall_s
        record["goodput"] = self._kept_s / max(self.clock() - started, 1e-9)
        record.update(self.observers.step_fields(record))  # MFU, with the telemetry's model FLOPs
        samples = tuple(s for r in reports for s in r.samples)
        origins = tuple(o for r in reports for o in r.origins)
        self.held.append(HeldRecord(record, samples, origins, needs_safety=reports[0].snapshot_taken))
        self._commit(self.group.safe_through())

    def _commit(self, safe_through: int, *, unsafe_too: bool = False) -> None:
        """Write the held records, oldest first, up to the first whose snapshots are not known
        to be safe (past ``safe_through``); with ``unsafe_too``, every one."""
        while self.held and (unsafe_too or not self.held[0].needs_safety or self.held[0].step <= safe_through):
            held = self.held.pop(0)
            record = {**held.record, "time": time.time()}
            self.ledger.record(held.step, held.samples, held.origins)
            self.records.append(record)
            self.observers.on_step(record)

    def _settle_held(self, resumed: int) -> None:
        """After a recovery to ``resumed``: the held records of the steps it restored are
        written (their state was just read back whole); the later ones are dropped, to be redone."""
        self.held = [h for h in self.held if h.step <= resumed]
        self._commit(resumed, unsafe_too=True)

    def _commit_all(self, wait_s: float) -> None:
        """At the end of the run: wait up to ``wait_s`` for the last snapshots to be safe, then
        write every held record (a run that stops has no recovery left to protect)."""
        if self.held:
            self._commit(self.group.safe_through(wait_s))
            if self.held:
                log.warning("steps %s recorded before their snapshots were known to be safe", [h.step for h in self.held])
            self._commit(0, unsafe_too=True)

    def _summary(self, *, wall_s: float) -> dict[str, Any]:
        last = self.records[-1] if self.records else None
        tokens = sum(r["tokens"] for r in self.records)
        train_s = self._kept_s
        ledger = self.ledger.totals()
        return {
            "status": self.state.name,
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
            "dp": self.dp,
            "cp": self.topology.cp,
            "resumed_from": self.resume_from.uri if self.resume_from else None,
            "last_durable_step": self.persister.last_durable_step if self.persister else 0,
            "checkpoint_errors": list(self.persister.errors) if self.persister else [],
            "incidents": [{"id": i.id, "kind": i.kind, "ranks": list(i.ranks), "step": i.detected_at_step} for i in self.incidents],
            "recoveries": [recovery_entry(i) for i in self.incidents if i.action not in ("abort", "report")],
            "resizes": self.resizes,
            "sdc": {"scans": self.scans, "last_clean_scan": self.last_clean_scan} if self.sdc is not None else None,
            "error": self.error,
            "error_location": self.error_location,
            # From the controller's start: each phase of the workers' start, and the first step done.
            "startup": self.startup,
            # Step record -> snapshot readable at the node's holder and the buddy's, in ms.
            "snapshot_transit": self.transit,
            "eval": self.last_eval,
            # A chat dataset's conversations packed into rows, dropped or truncated (None: no chat data).
            "chat": chat_packing_counts(self.job),
            "run_dir": str(self.run_dir.path),
        }



def _or_dash(value: Optional[float], spec: str) -> str:
    return "-" if value is None else format(value, spec)
