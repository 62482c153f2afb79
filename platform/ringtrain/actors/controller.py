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
from ringtrain.actors.durable_copies import DurableCopies
from ringtrain.actors.evaluation import EvalPlan
from ringtrain.actors.observers import Observer, run_observers
from ringtrain.actors.protocols import Durable, Elastic, Group, Reform, Reformed, Sink
from ringtrain.actors.runbook import RunBook
from ringtrain.actors.states import (
    ALLOWED, Failed, Finished, Recovering, Resizing, Restoring, Starting, State, Stopped, Stopping, Training, check_handlers,
)  # fmt: skip
from ringtrain.actors.steps import StepResult
from ringtrain.actors.transit import gather_arrivals, transit_window
from ringtrain.actors.watches import Watches
from ringtrain.checkpoint import LoadedCheckpoint
from ringtrain.config import JobConfig
from ringtrain.errors import NonFiniteLoss, RingtrainError, WorkerError
from ringtrain.policies.elastic import allowed_dps
from ringtrain.policies.faults import Action, Capacity, Decision, Failure, Kind, classify, decide, non_finite
from ringtrain.policies.retries import RecoveryFault, phase_of, retry_recovery
from ringtrain.telemetry.progress import Progress
from ringtrain.telemetry.prometheus import RunMetrics
from ringtrain.telemetry.rundir import RunDir

log = logging.getLogger(__name__)


# What each kind of worker failure is called in incidents.
_WORKER_FAILURE_KINDS = {"died": "crash", "error": "crash", "timeout": "hang"}
# A failed step's kind as the WorkerError that ends a run without recovery.
_FAILURE_ERROR_KINDS = {Kind.CRASH: "died", Kind.NODE_LOST: "died", Kind.HANG: "timeout", Kind.ERROR: "error"}


class Controller:
    """The state machine; what the run keeps is its collaborators', each with one owner: the
    RunBook (what has run and been recorded), the DurableCopies (the durable checkpoints) and
    the Watches (what is being watched between steps)."""

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
        run, told in that order (``actors.observers``). ``elastic``: None when any failure ends
        the run."""
        self.job, self.group, self.elastic, self.clock = job, group, elastic, clock
        self.state: State = Starting("the controller was made")
        self.observers = run_observers(
            run_dir, progress or Progress(job.train.steps, enabled=False), telemetry, sinks, observers, job=job
        )
        self.book = RunBook(
            job, group, run_dir, self.observers, clock, run_id=run_id, resume_from=resume_from, startup=startup, eval_plan=eval_plan
        )
        self.durable = DurableCopies(job, group, persister, self.book, self.observers)
        self.watches = Watches(job, group, elastic, self.book, self.observers, clock)

    def run(self) -> dict[str, Any]:
        """Move from state to state (``actors.states``) until a terminal one; returns the
        run's summary, whatever the outcome."""
        self.book.started = started = self.clock()
        try:
            while not self.state.terminal:
                self._enter(self._next_state(self.state))
        finally:
            self.book.commit_all(wait_s=0.0)
            # A stopping run waits for no save beyond its stop's own: one still writing is
            # abandoned (the writer lease is then left to expire, commands/run.py).
            self.durable.close(wait_s=0.0 if isinstance(self.state, (Stopping, Stopped)) else None)
            last = self.book.last_step
            self.durable.watch_failures(last, may_stop=False)  # the last failures: incidents, no stop
            if self.group.holders:
                self.book.transit = transit_window(self.book.records, gather_arrivals(list(self.group.holders.values())))
            self.group.shutdown()
            self.observers.close()
        summary = self.book.summary(
            status=self.state.name,
            wall_s=self.clock() - started,
            durable=self.durable.summary_fields(),
            sdc=self.watches.sdc_summary(),
        )
        self.observers.on_summary(summary)
        return summary

    def _next_state(self, state: State) -> State:
        """The work of ``state`` (its handler in ``HANDLERS``), and the state it leads to. A
        platform error fails the run, a stop (SIGINT, SIGTERM: KeyboardInterrupt here) stops it;
        a second stop while the first one saves leaves at once."""
        try:
            return HANDLERS[type(state)](self, state)
        except RingtrainError as exc:
            self.book.error = str(exc)
            return Failed(self.book.error)
        except KeyboardInterrupt:
            if isinstance(state, Stopping):
                raise
            self.book.error = "interrupted"
            return Stopping("interrupted by the user")
        except Exception as exc:  # a bug, not a training failure: still leave the run's record
            log.exception("the controller failed")
            self.book.error = f"{type(exc).__name__}: {exc}"
            return Failed(self.book.error)

    def _enter(self, new: State) -> None:
        """Take on ``new`` if the transition table allows it from the current state; every
        change of state is logged with its reason."""
        old = self.state
        if type(new) not in ALLOWED.get(type(old), ()):
            raise RuntimeError(f"illegal transition {old.name} -> {new.name}")
        if type(new) is not type(old):
            log.info("state %s -> %s: %s", old.name, new.name, new.reason)
        self.state = new

    def _write_layout(self) -> None:
        if self.elastic is not None:
            self.observers.on_layout(self.elastic.layout())

    # --- starting, training, stopping ------------------------------------------------------

    def _start(self, state: Starting) -> State:
        started = self.clock()
        job, book = self.job, self.book
        spares = f" and {job.mesh.spares} warm spares" if job.mesh.spares else ""
        self.observers.on_waiting(
            f"{job.world_size} workers{spares} to start (each imports torch and DeepSpeed, then together "
            "they build the model, its ZeRO engine and the data)"
        )
        self.group.start()
        book.startup.update({**self.group.startup, "group_start_s": self.clock() - started})
        self.observers.on_start(self.group.infos)
        if book.resume_from is not None:
            self.observers.on_waiting(f"the workers to load step {book.resume_from.step}'s checkpoint")
            book.resume(book.resume_from)
        self._write_layout()
        self.observers.on_waiting(
            f"step {book.start_step + 1}, the workers' first (it also warms their kernels, and reads the first batch)"
        )
        self.watches.last_clean_scan = book.start_step
        return Training(
            f"{job.world_size} workers up (mesh.dp={job.mesh.dp}, mesh.cp={job.mesh.cp}), from step {book.start_step}",
            step=book.start_step + 1,
        )

    def _train(self, state: Training) -> State:
        """The step ``state`` names, or past the last one: the run's end (every record written)."""
        if state.step <= self.job.last_step:
            return self._step(state.step)
        self.book.commit_all(wait_s=self.job.controllers.step_timeout_s)
        self._finish_recovery()
        self.durable.drain(wait=True)
        t = self.job.train
        return Finished(f"train.stop_at_step={self.job.last_step} reached" if t.stop_at_step else f"train.steps={t.steps} reached")

    def _stop(self, state: Stopping) -> State:
        self.observers.on_message(self.durable.persist_at_stop())
        return Stopped(state.reason)

    def _step(self, step: int) -> State:
        """Run ``step`` and watch it; the next state: the next step, a recovery from what went
        wrong, or a grow that is ready."""
        t0 = self.clock()
        probe = self.watches.scan_due(step)
        try:
            result = self.group.train_step(probe=probe, on_safe=self._safe)
        except WorkerError as exc:  # a group that cannot tell how each rank ended raises this
            kind = _WORKER_FAILURE_KINDS.get(exc.kind, "crash")
            self.book.incident(kind, (exc.rank,), step, t0, reason=str(exc))
            raise
        if result.failed:
            return self._step_failed(result, step, t0)
        reports = list(result.reports)
        wall = self.clock() - t0
        nan = non_finite({r.rank: r.local_loss for r in reports}, step) if not math.isfinite(reports[0].loss) else None
        if nan is not None:
            if self.elastic is None:
                self.book.incident("nan", nan.ranks, step, t0, reason=nan.reason)
                raise NonFiniteLoss(nan.reason)
            return Recovering(nan.reason, nan, step, t0, self.clock(), time.time(), batch=reports[0].batch)
        evaluation = self.book.maybe_evaluate(step)
        self.book.record(reports, wall, self.durable.step_fields(), evaluation)
        if reports[0].snapshot_taken:
            self.durable.newest_snapshot = step
        if probe:  # judged before persisting: a state the probes reject is not made durable
            # The probed step is recorded first, as any step is (its snapshots safe), so a
            # rejected one counts among the steps the rollback redoes.
            self.book.commit(self.group.safe_through(wait_s=self.job.controllers.step_timeout_s))
            corrupt = self.watches.judge(step, t0, {r.rank: r.probes or {} for r in reports})
            if corrupt is not None:
                return corrupt
        straggler = self.watches.watch_stragglers(step, t0, reports)
        if straggler is not None:
            return straggler
        self.durable.maybe_persist(step)
        failing = self.durable.watch_failures(step)
        if failing is not None:
            return Stopping(failing)
        self._finish_recovery()
        grow_to = self.watches.maybe_grow(step, snapshot_taken=reports[0].snapshot_taken)
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
            self.book.incident(_WORKER_FAILURE_KINDS[exc.kind], failure.ranks, step, t0, reason=str(exc))
            raise exc
        # How each rank's step ended: the evidence behind the classification.
        evidence: dict[str, Any] = {"outcomes": [dataclasses.asdict(o) | {"outcome": o.outcome.value} for o in outcomes]}
        if result.verdict:
            evidence["hang"] = result.verdict
            self.observers.on_count(metrics.HANG_VERDICTS, 1)
        return Recovering(failure.reason, failure, step, t0, result.seen_at, result.seen_unix, verdict=evidence)

    def _safe(self, step: int) -> None:
        """The holders have the snapshots of every step up to ``step`` (heard while a step
        runs): the records held for them are written, which may end a recovery."""
        self.book.commit(step)
        self._finish_recovery()

    def _finish_recovery(self) -> None:
        """The first step after a recovery, recorded (its snapshots safe), closes its incident's
        clock (and those of any incident that struck while the job was still recovering). Only
        then do replacement spares start, so their warm-up competes with neither the recovery
        nor that step's snapshots."""
        if self.book.held:  # that step's record is still waiting for its snapshots
            return
        if self.book.open and self.elastic is not None:
            self.elastic.replenish_spares(self.job.mesh.spares)
        self.book.close_open()

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
        repeated = self.watches.repeated(failure, step)
        verdict = {**(state.verdict or {}), "error": self.book.error_location} if repeated else state.verdict
        t = self.job.train
        topology = self.group.topology
        decision = decide(
            failure,
            dp=topology.dp,
            cp=topology.cp,
            min_dp=self.job.mesh.min_dp,
            capacity=capacity,
            recoveries=self.book.recoveries(),
            max_recoveries=self.job.controllers.max_recoveries,
            on_nan=self.job.controllers.on_nan,
            allowed_dps=allowed_dps(global_batch=t.global_batch, micro_batch=t.micro_batch, min_dp=1, max_dp=topology.dp),
            repeated=repeated,
        )
        incident = self.book.incident(
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

    def _restore(self, state: Restoring) -> State:
        """Carry out the decision; training resumes after the step restored. A worker failing
        while the new world forms starts the recovery over, from the same restore point, as a
        failure of that world (``policies.retries``); the run fails once
        controllers.max_recoveries is spent."""
        recovery, decision = state.recovery, state.decision
        try:
            formed = self._execute(
                decision, recovery.failure, last_step=state.last_step, fired_through=recovery.step, batch=recovery.batch
            )
        except WorkerError as exc:
            return self._retry(exc, state)
        resumed = formed.step
        # A state from before a clean scan is clean.
        self.watches.world_changed(formed.seats, last_clean=min(self.watches.last_clean_scan, resumed))
        if recovery.failure.kind is Kind.SDC:
            self.durable.discard_after(resumed)
        struck = self.book.rewind(resumed)
        # The new world's snapshots start with its next step: a stop until then saves nothing new.
        self.durable.newest_snapshot = None
        dp = self.group.topology.dp
        plan = formed.plan.to_dict() if formed.plan is not None else None
        # A rollback's phases are not a new world's: none are kept.
        phases = dict(formed.phases) if decision.action is not Action.ROLLBACK else None
        incident = dataclasses.replace(state.incident, dp_after=dp, lost_steps=len(struck), phases=phases, plan=plan)
        self.book.recovered(incident, recovery.seen_at)
        # The recoveries this one retried end with it: same restore point, same steps redone.
        for interrupted, seen_at in reversed(recovery.interrupted):
            self.book.recovered(dataclasses.replace(interrupted, dp_after=dp, lost_steps=incident.lost_steps), seen_at)
        self._write_layout()
        self.observers.on_message(
            f"incident {incident.id}: {decision.action.value} done, dp {incident.dp_before} -> {dp}, "
            f"resuming after step {resumed} ({len(struck)} completed steps redone)"
        )
        return Training(f"resumed after step {resumed}", step=resumed + 1)

    def _execute(
        self, decision: Decision, failure: Failure, *, last_step: int, fired_through: int, batch: Optional[int]
    ) -> Reformed:
        """Carry out ``decision``; returns the world formed again (its ``step`` resumed after,
        ``phases``, ``seats`` and ``plan``, ``policies.recovery``). ``last_step``: the newest
        step to restore; ``fired_through``: the step the failure was seen in; ``batch``: the
        data batch the failed step trained on (the one a skip drops)."""
        assert self.elastic is not None
        if decision.action is Action.ROLLBACK:
            formed = self.elastic.rollback(last_step=last_step, rejoin=failure.kind is Kind.ERROR, fired_through=fired_through)
            if decision.skip_batch and batch is not None:
                # Dropped when the data reaches it again: the restore point may lie steps before.
                self.book.ledger.skip(self.elastic.skip_batch(batch))
            return formed
        return self.elastic.reform(Reform(
            lost=frozenset(failure.ranks),
            new_dp=decision.dp_after,
            spares=decision.spares_used,
            last_step=last_step,
            fired_through=fired_through,
            quarantine=failure.quarantine,
        ))

    def _retry(self, exc: WorkerError, state: Restoring) -> Recovering:
        """The recovery ``state`` carried out broke: the failure to recover from next."""
        # The group's dp is already that of the world that broke: it took it on as it began forming.
        fault = RecoveryFault(exc.rank, exc.kind, exc.cause, phase_of(self.group.phases))
        max_recoveries = self.job.controllers.max_recoveries
        retry = retry_recovery(
            fault, incident=state.incident.id, restore_to=state.last_step, attempts=self.book.recoveries(), max_recoveries=max_recoveries
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

    # --- growth --------------------------------------------------------------------------

    def _resize(self, state: Resizing) -> State:
        assert self.elastic is not None
        step, new_dp = state.step, state.new_dp
        t0 = self.clock()
        before = self.group.topology.dp
        formed = self.elastic.grow(new_dp=new_dp, last_step=step)
        self.watches.world_changed(formed.seats, last_clean=self.watches.last_clean_scan)
        self.durable.newest_snapshot = None  # the replicas that joined hold no snapshot of the steps before
        event = {"step": step, "dp_before": before, "dp_after": new_dp, "seconds": self.clock() - t0, "at": time.time()}
        self.book.resizes.append(event)
        self._write_layout()
        self.observers.on_gauge(metrics.DP_SIZE, new_dp)
        self.observers.on_message(f"grew dp {before} -> {new_dp} after step {step} in {event['seconds']:.2f} s")
        return Training(f"grew to dp {new_dp}", step=step + 1)


# What the Controller does in each state that is not terminal: one handler per state, held
# against the transition table (``actors.states.ALLOWED``) as this module is imported.
HANDLERS: dict[type[State], Callable[[Controller, Any], State]] = {
    Starting: Controller._start,
    Training: Controller._train,
    Recovering: Controller._recover,
    Restoring: Controller._restore,
    Resizing: Controller._resize,
    Stopping: Controller._stop,
}
check_handlers(HANDLERS)
