"""Controller: the job's state machine, driving the WorkerGroup step by step.

``run()`` moves from state to state (``actors.states``: starting, training, recovering,
restoring, resizing, stopping; finished, failed or stopped at the end), each state a value
carrying what its handler needs and each handler returning the next. Every transition is
checked and logged with the reason behind it, and the run directory records each step and the
outcome whatever happens: a failed or interrupted run still leaves a summary saying how far it
got and why. When a step fails, the fault policy (``policies.faults``) decides and the Recovery
carries it out; between steps the elastic policy (``policies.elastic``) grows the job back
when capacity returns, and every ``controllers.sdc_every_steps`` the ranks run the SDC probes
(``policies.sdc``): a rank that fails them is evicted and training rolls back to the last
clean scan. Each incident is written to ``incidents/`` when it is seen and again when training
has recovered from it. A stop (SIGINT, SIGTERM: KeyboardInterrupt here) writes the newest
in-memory snapshot to the durable store within ``checkpoint.stop_persist_timeout_s`` and says
what it saved; a run that lost its store's writer lease trains on without durable checkpoints,
with an incident that says so. Everything the run shows goes through one list of observers
(``actors.observers``): the run directory, the console, Prometheus and the sinks (TensorBoard).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from typing import Any, Callable, Optional, Sequence

from ringtrain import metrics
from ringtrain.actors.evaluation import EvalPlan
from ringtrain.actors.observers import Observer, run_observers
from ringtrain.actors.protocols import Durable, Elastic, Group, Sink
from ringtrain.actors.runbook import HeldRecord
from ringtrain.actors.steps import StepResult
from ringtrain.actors.states import (
    ALLOWED, Failed, Finished, Recovering, Resizing, Restoring, Starting, State, Stopped, Stopping, Training,
)
from ringtrain.actors.watches import Watches
from ringtrain.actors.transit import gather_arrivals, transit_window
from ringtrain.checkpoint import LoadedCheckpoint
from ringtrain.config import JobConfig
from ringtrain.policies.elastic import GrowGate, allowed_dps, target_dp
from ringtrain.policies.faults import Action, Capacity, Decision, Failure, Kind, classify, decide, non_finite
from ringtrain.policies.ledger import SampleLedger
from ringtrain.policies.retries import RecoveryFault, phase_of, retry_recovery
from ringtrain.policies.repeats import ErrorSignature, RepeatTracker, repeated_reason
from ringtrain.policies.sdc import SdcScanner
from ringtrain.policies.stragglers import StragglerWatch
from ringtrain.errors import NonFiniteLoss, RingtrainError, WorkerError
from ringtrain.status import Incident
from ringtrain.telemetry.progress import Progress
from ringtrain.telemetry.prometheus import RunMetrics
from ringtrain.telemetry.rundir import RunDir

log = logging.getLogger(__name__)


# What each kind of worker failure is called in incidents.
_WORKER_FAILURE_KINDS = {"died": "crash", "error": "crash", "timeout": "hang"}
# A failed step's kind as the WorkerError that ends a run without recovery.
_FAILURE_ERROR_KINDS = {Kind.CRASH: "died", Kind.NODE_LOST: "died", Kind.HANG: "timeout", Kind.ERROR: "error"}
# The kind of the incident a lost writer lease raises: not a fault of the training, which the
# policies never see; training goes on without durable checkpoints.
DURABLE_INCIDENT = "checkpoint"


class Controller(Watches):
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
        elastic: Optional[Elastic] = None,
        clock: Callable[[], float] = time.monotonic,
        eval_plan: Optional[EvalPlan] = None,
        startup: Optional[dict[str, float]] = None,
        observers: Sequence[Observer] = (),
    ) -> None:
        """``run_dir``, ``progress``, ``telemetry``, ``sinks`` and ``observers``: what follows the
        run, told in that order (``actors.observers``)."""
        self.job = job
        self.group = group
        self.run_dir = run_dir
        self.observers = run_observers(
            run_dir, progress or Progress(job.train.steps, enabled=False), telemetry, sinks, observers, job=job
        )
        self.persister = persister
        self.resume_from = resume_from
        self.run_id = run_id
        self.elastic = elastic  # None: any failure ends the run
        self.incidents: list[Incident] = []
        self.clock = clock
        self.state: State = Starting("the controller was made")
        self._started = 0.0  # clock time run() began
        self.records: list[dict[str, Any]] = []
        self.held: list[HeldRecord] = []  # records waiting for their snapshots (actors.runbook)
        self.ledger = SampleLedger()
        self.start_step = 0
        self.persist_s = 0.0
        self.error: Optional[str] = None
        self.error_location: Optional[dict[str, Any]] = None  # a repeating error's type, message, frame, step
        self.repeats = RepeatTracker()
        self.stragglers = StragglerWatch(job.controllers.straggler_factor, job.controllers.straggler_steps)
        self.resizes: list[dict[str, Any]] = []
        self._kept_s = 0.0  # wall time of the steps kept so far (goodput's numerator)
        self._recovering: list[tuple[Incident, float]] = []  # incidents awaiting their next completed step
        self._grow_gate = GrowGate(job.controllers.grow_after_s)
        self._growing_to: Optional[int] = None
        self._next_capacity_check = 0.0
        c = job.controllers
        self.sdc = SdcScanner(cross_rank=c.sdc_cross_rank) if c.sdc_every_steps > 0 else None
        self.last_clean_scan = 0  # the newest step the SDC probes vouched for
        self.scans = 0
        # What eval.every scores (read from eval.data on the first evaluation unless given).
        self.eval_plan = eval_plan
        self.last_eval: Optional[dict[str, Any]] = None
        # Seconds by start phase, for summary.json; ``startup``: phases before the controller (ray.init).
        self.startup: dict[str, float] = dict(startup or {})
        self.transit: dict[str, Any] = {}  # snapshot transit window by holder role (actors.transit)
        # The newest recorded step whose snapshot the workers hold: what a stop makes durable.
        self.newest_snapshot: Optional[int] = None
        self.durable_stopped: Optional[str] = None  # why durable checkpointing stopped (lease lost)
        self._failures_seen = 0  # the Persister's failed saves already raised as incidents

    def run(self) -> dict[str, Any]:
        """Move from state to state (``actors.states``) until a terminal one; returns the
        run's summary, whatever the outcome."""
        self._started = started = self.clock()
        try:
            while not self.state.terminal:
                self._enter(self._next_state(self.state))
        finally:
            self._commit_all(wait_s=0.0)
            # A stopping run waits for no save beyond its stop's own: one still writing is
            # abandoned (the writer lease is then left to expire, commands/run.py).
            self._close_durable(wait_s=0.0 if isinstance(self.state, (Stopping, Stopped)) else None)
            last = self.records[-1]["step"] if self.records else self.start_step
            self._watch_durable(last)
            self._watch_saves(last, may_stop=False)  # the last saves' failures: incidents, no stop
            if self.group.holders:
                self.transit = transit_window(self.records, gather_arrivals(list(self.group.holders.values())))
            self.group.shutdown()
            self.observers.close()
        summary = self._summary(wall_s=self.clock() - started)
        summary["durable_stopped"] = self.durable_stopped
        self.observers.on_summary(summary)
        return summary

    def _next_state(self, state: State) -> State:
        """The work of ``state``, and the state it leads to. A platform error fails the run, a
        stop (SIGINT, SIGTERM: KeyboardInterrupt here) stops it; a second stop while the first
        one saves leaves at once."""
        try:
            match state:
                case Starting():
                    return self._start()
                case Training():
                    return self._train(state)
                case Recovering():
                    return self._recover(state)
                case Restoring():
                    return self._restore(state)
                case Resizing():
                    return self._resize(state)
                case Stopping():
                    self.observers.on_message(self._persist_at_stop())
                    return Stopped(state.reason)
            raise TypeError(f"the controller has no move from {state!r}")
        except RingtrainError as exc:
            self.error = str(exc)
            return Failed(self.error)
        except KeyboardInterrupt:
            if isinstance(state, Stopping):
                raise
            self.error = "interrupted"
            return Stopping("interrupted by the user")
        except Exception as exc:  # a bug, not a training failure: still leave the run's record
            log.exception("the controller failed")
            self.error = f"{type(exc).__name__}: {exc}"
            return Failed(self.error)

    def _enter(self, new: State) -> None:
        """Take on ``new`` if the transition table allows it from the current state; every
        change of state is logged with its reason."""
        old = self.state
        if type(new) not in ALLOWED.get(type(old), ()):
            raise RuntimeError(f"illegal transition {old.name} -> {new.name}")
        if type(new) is not type(old):
            log.info("state %s -> %s: %s", old.name, new.name, new.reason)
        self.state = new

    def _start(self) -> State:
        started = self.clock()
        spares = f" and {self.job.mesh.spares} warm spares" if self.job.mesh.spares else ""
        self.observers.on_waiting(
            f"{self.job.world_size} workers{spares} to start (each imports torch and DeepSpeed, then together "
            "they build the model, its ZeRO engine and the data)"
        )
        self.group.start()
        self.startup.update({**self.group.startup, "group_start_s": self.clock() - started})
        self.observers.on_start(self.group.infos)
        if self.resume_from is not None:
            self.observers.on_waiting(f"the workers to load step {self.resume_from.step}'s checkpoint")
            self.start_step = self._resume(self.resume_from)
        self._write_layout()
        self.observers.on_waiting(
            f"step {self.start_step + 1}, the workers' first (it also warms their kernels, and reads the first batch)"
        )
        self.last_clean_scan = self.start_step
        return Training(
            f"{self.job.world_size} workers up (mesh.dp={self.job.mesh.dp}, mesh.cp={self.job.mesh.cp}), "
            f"from step {self.start_step}",
            step=self.start_step + 1,
        )

    def _train(self, state: Training) -> State:
        """The step ``state`` names, or past the last one: the run's end (every record written)."""
        if state.step <= self.job.last_step:
            return self._step(state.step)
        self._commit_all(wait_s=self.job.controllers.step_timeout_s)
        self._finish_recovery()
        self._drain(wait=True)
        t = self.job.train
        return Finished(f"train.stop_at_step={self.job.last_step} reached" if t.stop_at_step else f"train.steps={t.steps} reached")

    # --- durable checkpoints --------------------------------------------------------------

    def _watch_durable(self, step: int) -> None:
        """Once the Persister stopped for good (the store's writer lease was lost): one incident,
        a warning, and the reason kept for the summary and the run's exit."""
        stopped = getattr(self.persister, "stopped", None)
        if stopped is None or self.durable_stopped is not None:
            return
        self.durable_stopped = stopped
        assert self.persister is not None
        last = self.persister.last_durable_step
        self._incident(
            DURABLE_INCIDENT, (), step, self.clock(), action="continue",
            reason=f"durable checkpointing stopped (the newest durable step is {last}): {stopped}",
        )  # fmt: skip

    def _watch_saves(self, step: int, *, may_stop: bool = True) -> Optional[State]:
        """Each failed durable save is an incident naming the store and the cause; the next save
        tries again, and after checkpoint.max_failed_saves failures in a row the run stops (its
        newest durable checkpoint kept, the stop's own save tried once more) instead of training
        on with nothing durable."""
        p = self.persister
        if p is None:
            return None
        errors = p.failed_saves[self._failures_seen :]
        self._failures_seen = len(p.failed_saves)
        limit = self.job.checkpoint.max_failed_saves
        in_a_row = p.failed_in_a_row
        stop = may_stop and bool(limit) and in_a_row >= limit
        keep = f"the newest durable step is {p.last_durable_step}"
        for i, error in enumerate(errors):
            last = i == len(errors) - 1
            then = (
                f"stopping after {in_a_row} failed saves in a row (checkpoint.max_failed_saves={limit}); {keep}"
                if stop and last else f"the next save tries again; {keep}"
            )  # fmt: skip
            self._incident(
                DURABLE_INCIDENT, (), step, self.clock(), action="stop" if stop and last else "retry",
                reason=f"durable checkpoint failed: {error}; {then}",
            )  # fmt: skip
        if stop and errors:
            return Stopping(f"{in_a_row} durable saves failed in a row (checkpoint.max_failed_saves={limit})")
        return None

    def _persist_at_stop(self) -> str:
        """On a stop: the newest snapshot the workers hold written to the durable store within
        checkpoint.stop_persist_timeout_s (saves already queued first); the line that says what
        was saved, where and in how long, or why nothing was."""
        if self.persister is None:
            return "stop: nothing saved: this run keeps no durable checkpoints (checkpoint.snapshot_every=0)"
        t0 = self.clock()
        budget = self.job.checkpoint.stop_persist_timeout_s
        step, p = self.newest_snapshot, self.persister
        earlier_errors = len(p.errors)
        try:
            p.poll()
            if p.stopped is not None:
                return f"stop: nothing saved: durable checkpointing had stopped ({p.stopped})"
            if step is None:
                return "stop: nothing saved: no step since the start holds a snapshot yet"
            if step <= p.last_durable_step:
                return f"stop: step {step} was already saved to {self._durable_uri(step)}"
            if budget <= 0:
                return f"stop: step {step} not saved (checkpoint.stop_persist_timeout_s=0); the newest durable step is {p.last_durable_step}"
            if step not in p.requested:
                p.submit(step, self.group.snapshot_refs(step), timeout_s=budget)
            p.flush(timeout_s=budget - (self.clock() - t0))
        except Exception as exc:  # the workers went with the stop, or the store refused
            return f"stop: step {step} not saved: {p.describe(exc)}; the newest durable step is {p.last_durable_step}"
        seconds = self.clock() - t0
        saved = [d for d in p.done if d.step == step]
        if saved:
            self.persist_s = saved[-1].seconds
            return f"stop: saved step {step} to {saved[-1].uri} in {seconds:.2f} s"
        errors = p.errors[earlier_errors:]
        why = p.stopped or (errors[-1] if errors else f"not written within checkpoint.stop_persist_timeout_s={budget:g}")
        return f"stop: step {step} not saved: {why}; the newest durable step is {p.last_durable_step}"

    def _durable_uri(self, step: int) -> str:
        found = [d.uri for d in getattr(self.persister, "done", []) if d.step == step]
        return found[-1] if found else "the store"

    def _step(self, step: int) -> State:
        """Run ``step`` and watch it; the next state: the next step, a recovery from what went
        wrong, or a grow that is ready."""
        t0 = self.clock()
        probe = self._scan_due(step)
        try:
            result = self.group.train_step(probe=probe, on_safe=self._safe)
        except WorkerError as exc:  # a group that cannot tell how each rank ended raises this
            kind = _WORKER_FAILURE_KINDS.get(exc.kind, "crash")
            self._incident(kind, (exc.rank,), step, t0, reason=str(exc))
            raise
        if result.failed:
            return self._step_failed(result, step, t0)
        reports = list(result.reports)
        wall = self.clock() - t0
        nan = non_finite({r.rank: r.local_loss for r in reports}, step) if not math.isfinite(reports[0].loss) else None
        if nan is not None:
            if self.elastic is None:
                self._incident("nan", nan.ranks, step, t0, reason=nan.reason)
                raise NonFiniteLoss(nan.reason)
            return Recovering(nan.reason, nan, step, t0, self.clock(), time.time(), batch=reports[0].batch)
        self._record(reports, wall, self._started, self._maybe_evaluate(step))
        if reports[0].snapshot_taken:
            self.newest_snapshot = step
        if probe:  # judged before persisting: a state the probes reject is not made durable
            # The probed step is recorded first, as any step is (its snapshots safe), so a
            # rejected one counts among the steps the rollback redoes.
            self._commit(self.group.safe_through(wait_s=self.job.controllers.step_timeout_s))
            corrupt = self._judge(step, t0, {r.rank: r.probes or {} for r in reports})
            if corrupt is not None:
                return corrupt
        straggler = self._watch_stragglers(step, t0, reports)
        if straggler is not None:
            return straggler
        self._maybe_persist(step)
        self._watch_durable(step)
        failing = self._watch_saves(step)
        if failing is not None:
            return failing
        self._finish_recovery()
        grow_to = self._maybe_grow(step)
        if self.elastic is not None and self.elastic.spares_changed():
            self._write_layout()
        if grow_to is not None:
            return Resizing(f"capacity for dp {grow_to} is ready", step=step, new_dp=grow_to)
        return Training(f"step {step} done", step=step + 1)

    def _step_failed(self, result: StepResult, step: int, t0: float) -> State:
        """The recovery from a step that did not finish on every rank; without one, the run
        ends naming the rank the failure is on."""
        outcomes = self.elastic.assess(result) if self.elastic is not None else list(result.outcomes)
        failure = classify(outcomes) or Failure(Kind.ERROR, (), result.why())
        if self.elastic is None:
            rank = failure.ranks[0] if failure.ranks else 0
            infos = self.group.infos
            host = infos[rank].host if rank < len(infos) else "an unknown host"
            exc = WorkerError(rank, host, failure.reason, kind=_FAILURE_ERROR_KINDS.get(failure.kind, "error"))
            self._incident(_WORKER_FAILURE_KINDS[exc.kind], failure.ranks, step, t0, reason=str(exc))
            raise exc
        # How each rank's step ended: the evidence behind the classification.
        evidence: dict[str, Any] = {"outcomes": [dataclasses.asdict(o) | {"outcome": o.outcome.value} for o in outcomes]}
        if result.verdict:
            evidence["hang"] = result.verdict
            self.observers.on_count(metrics.HANG_VERDICTS, 1)
        return Recovering(failure.reason, failure, step, t0, result.seen_at, result.seen_unix, verdict=evidence)

    # --- recovery ------------------------------------------------------------------------

    def _recover(self, state: Recovering) -> State:
        """Decide what to do about ``state.failure`` (``policies.faults``) and write its
        incident: abort, only report it, or restore (the next state carries the decision out)."""
        assert self.elastic is not None
        failure, step = state.failure, state.step
        if failure.suspect_devices and self.job.controllers.sdc_evict_node:
            self.elastic.cordon(failure.ranks)  # first: capacity there no longer counts
        reuse = not failure.quarantine
        capacity = self.elastic.capacity(failure.ranks, reuse_slots=reuse) if failure.lost_workers else Capacity(0, 0)
        repeated = self._repeated(failure, step)
        verdict = {**(state.verdict or {}), "error": self.error_location} if repeated else state.verdict
        t = self.job.train
        decision = decide(
            failure,
            dp=self.dp,
            cp=self.topology.cp,
            min_dp=self.job.mesh.min_dp,
            capacity=capacity,
            recoveries=self._recoveries(),
            max_recoveries=self.job.controllers.max_recoveries,
            on_nan=self.job.controllers.on_nan,
            allowed_dps=allowed_dps(global_batch=t.global_batch, micro_batch=t.micro_batch, min_dp=1, max_dp=self.dp),
            repeated=repeated,
        )
        incident = self._incident(
            failure.kind.value,
            failure.ranks,
            step,
            state.t0,
            reason=f"{failure.reason}; {decision.reason}",
            action=decision.action.value,
            detected_at=state.seen_unix,
            detect_s=state.seen_at - state.t0,
            verdict=verdict,
        )
        if decision.action is Action.ABORT:
            raise (NonFiniteLoss if failure.kind is Kind.NAN else RingtrainError)(incident.reason)
        if decision.action is Action.REPORT:
            return Training(decision.reason, step=(step if state.restore_to is None else state.restore_to) + 1)
        last_step = step - 1 if state.restore_to is None else state.restore_to
        return Restoring(decision.reason, recovery=state, decision=decision, incident=incident, last_step=last_step)

    def _recoveries(self) -> int:
        """The recoveries made so far: every incident acted on, retries included."""
        return sum(1 for i in self.incidents if i.action not in ("abort", "report"))

    def _restore(self, state: Restoring) -> State:
        """Carry out the decision; training resumes after the step restored. A worker failing
        while the new world forms starts the recovery over, from the same restore point, as a
        failure of that world (``policies.retries``); the run fails once
        controllers.max_recoveries is spent."""
        recovery, decision = state.recovery, state.decision
        try:
            resumed, phases, plan = self._execute(
                decision, recovery.failure, last_step=state.last_step, fired_through=recovery.step, batch=recovery.batch
            )
        except WorkerError as exc:
            return self._retry(exc, state)
        self._repin(min(self.last_clean_scan, resumed))  # a state from before a clean scan is clean
        if recovery.failure.kind is Kind.SDC:
            self._discard_durable_after(resumed)
        self._growing_to = None
        self._grow_gate.reset()
        self.stragglers.reset()
        self._settle_held(resumed)
        # The new world's snapshots start with its next step: a stop until then saves nothing new.
        self.newest_snapshot = None
        struck = self.ledger.rollback(resumed)
        self.records = [r for r in self.records if r["step"] <= resumed]
        self._kept_s = sum(r["step_time_s"] for r in self.records)
        incident = dataclasses.replace(state.incident, dp_after=self.dp, lost_steps=len(struck), phases=phases, plan=plan)
        self._update_incident(incident)
        self._recovering.append((incident, recovery.seen_at))
        # The recoveries this one retried end with it: same restore point, same steps redone.
        for interrupted, seen_at in reversed(recovery.interrupted):
            done = dataclasses.replace(interrupted, dp_after=self.dp, lost_steps=incident.lost_steps)
            self._update_incident(done)
            self._recovering.append((done, seen_at))
        self._write_layout()
        self.observers.on_message(
            f"incident {incident.id}: {decision.action.value} done, dp {incident.dp_before} -> {self.dp}, "
            f"resuming after step {resumed} ({len(struck)} completed steps redone)"
        )
        return Training(f"resumed after step {resumed}", step=resumed + 1)

    def _retry(self, exc: WorkerError, state: Restoring) -> Recovering:
        """The recovery ``state`` carried out broke: the failure to recover from next."""
        # self.dp is already that of the world that broke: the group took it on as it began forming.
        fault = RecoveryFault(exc.rank, exc.kind, exc.cause, phase_of(self.group.phases))
        max_recoveries = self.job.controllers.max_recoveries
        retry = retry_recovery(
            fault, incident=state.incident.id, restore_to=state.last_step, attempts=self._recoveries(), max_recoveries=max_recoveries
        )
        if retry is None:
            raise RingtrainError(
                f"{exc}: during the recovery of incident {state.incident.id}, with controllers.max_recoveries="
                f"{max_recoveries} recoveries made"
            ) from exc
        recovery = state.recovery
        return Recovering(
            retry.failure.reason,
            retry.failure,
            recovery.step,
            recovery.t0,
            self.clock(),
            time.time(),
            verdict=retry.evidence,
            restore_to=retry.restore_to,
            interrupted=(*recovery.interrupted, (state.incident, recovery.seen_at)),
        )

    def _repeated(self, failure: Failure, step: int) -> str:
        """Why ``failure`` will not be retried: the same exception on the same step again
        (``policies.repeats``); "" for any other failure."""
        if failure.kind is not Kind.ERROR:
            return ""
        signature = ErrorSignature(failure.error or failure.reason, failure.where)
        occurrences = self.repeats.observe(step, signature)
        reason = repeated_reason(signature, step, occurrences)
        if reason is None:
            return ""
        self.error_location = {**signature.to_dict(), "step": step, "ranks": list(failure.ranks), "occurrences": occurrences}
        return reason

    def _execute(
        self, decision: Decision, failure: Failure, *, last_step: int, fired_through: int, batch: Optional[int]
    ) -> tuple[int, Optional[dict[str, float]], Optional[dict[str, Any]]]:
        """Carry out ``decision``; returns the step resumed after, the time of each phase (of a
        new world) and the recovery plan carried out (``policies.recovery``), as incidents hold it.
        ``last_step``: the newest step to restore; ``fired_through``: the step the failure was
        seen in; ``batch``: the data batch the failed step trained on (the one a skip drops)."""
        assert self.elastic is not None
        if decision.action is Action.ROLLBACK:
            back = self.elastic.rollback(last_step=last_step, rejoin=failure.kind is Kind.ERROR, fired_through=fired_through)
            if decision.skip_batch and batch is not None:
                # Dropped when the data reaches it again: the restore point may lie steps before.
                self.ledger.skip(self.elastic.skip_batch(batch))
            return int(back.step), None, _plan_dict(back)
        out = self.elastic.reform(
            lost=frozenset(failure.ranks),
            new_dp=decision.dp_after,
            spares=decision.spares_used,
            last_step=last_step,
            fired_through=fired_through,
            quarantine=failure.quarantine,
        )
        if self.sdc is not None:
            self.sdc.reseat(out.seats)  # golden values stay with their workers
        return int(out.step), dict(out.phases), _plan_dict(out)

    def _safe(self, step: int) -> None:
        """The holders have the snapshots of every step up to ``step`` (heard while a step
        runs): the records held for them are written, which may end a recovery."""
        self._commit(step)
        self._finish_recovery()

    def _finish_recovery(self) -> None:
        """The first step after a recovery, recorded (its snapshots safe), closes its incident's
        clock (and those of any incident that struck while the job was still recovering). Only
        then do replacement spares start, so their warm-up competes with neither the recovery
        nor that step's snapshots."""
        if self.held:  # that step's record is still waiting for its snapshots
            return
        if self._recovering and self.elastic is not None:
            self.elastic.replenish_spares(self.job.mesh.spares)
        for incident, seen_at in self._recovering:
            incident = dataclasses.replace(incident, recover_s=self.clock() - seen_at)
            self._update_incident(incident)
            self.observers.on_count(metrics.RECOVERIES, 1)
            self.observers.on_gauge(metrics.RECOVERY_SECONDS, incident.recover_s or 0.0)
            self.observers.on_count(metrics.LOST_STEPS, incident.lost_steps)
            self.observers.on_gauge(metrics.DP_SIZE, self.dp)
        self._recovering = []

    def _maybe_grow(self, step: int) -> Optional[int]:
        """Between steps: grow back towards max_dp when capacity has returned and stayed.
        Returns the dp to grow to once its replicas are ready."""
        if self.elastic is None or self.dp >= self.job.max_dp or step >= self.job.last_step:
            return None
        if self._growing_to is not None:
            return self._growing_to if self.elastic.growth_ready() else None
        now = self.clock()
        if now < self._next_capacity_check:
            return None
        self._next_capacity_check = now + self.job.controllers.heartbeat_s
        t = self.job.train
        possible = target_dp(
            self.dp + self.elastic.growth_capacity() // self.topology.cp,
            global_batch=t.global_batch,
            micro_batch=t.micro_batch,
            min_dp=self.job.mesh.min_dp,
            max_dp=self.job.max_dp,
        )
        grow_to = self._grow_gate.observe(now, current_dp=self.dp, possible_dp=possible)
        if grow_to is not None:
            self.observers.on_message(
                f"capacity for dp {grow_to} seen for controllers.grow_after_s: starting {grow_to - self.dp} replica(s)"
            )
            self.elastic.prepare_growth(grow_to - self.dp)
            self._growing_to = grow_to
        return None

    def _resize(self, state: Resizing) -> State:
        assert self.elastic is not None
        step, new_dp = state.step, state.new_dp
        t0 = self.clock()
        before = self.dp
        out = self.elastic.grow(new_dp=new_dp, last_step=step)
        if self.sdc is not None:
            self.sdc.reseat(out.seats)
            self._repin(self.last_clean_scan)
        self._growing_to = None
        self._grow_gate.reset()
        self.stragglers.reset()
        self.newest_snapshot = None  # the replicas that joined hold no snapshot of the steps before
        event = {"step": step, "dp_before": before, "dp_after": new_dp, "seconds": self.clock() - t0, "at": time.time()}
        self.resizes.append(event)
        self._write_layout()
        self.observers.on_gauge(metrics.DP_SIZE, new_dp)
        self.observers.on_message(f"grew dp {before} -> {new_dp} after step {step} in {event['seconds']:.2f} s")
        return Training(f"grew to dp {new_dp}", step=step + 1)


def _plan_dict(formed: Any) -> Optional[dict[str, Any]]:
    """The recovery plan a world formed again carried out, as an incident records it."""
    plan = getattr(formed, "plan", None)
    return plan.to_dict() if plan is not None else None
