"""One training step on every rank of the group's world, watched until each rank's call ends.

``policies.stepwatch`` says when a rank of the step is lost (no heartbeat, past the step
timeout) or the step stalled; ``run_step`` carries its decisions out: on a stall it asks every
rank for its collective records and stacks, names the culprit (``policies.hangs``), evicts it
and aborts the survivors' collectives. A step that did not finish on every rank raises
StepFailed with how each rank's call ended.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Optional, Protocol

from ringtrain.actors.calls import answered, host_of, outcome
from ringtrain.actors.roster import Member
from ringtrain.actors.safekeeping import Safekeeping
from ringtrain.config import JobConfig
from ringtrain.policies.faults import Outcome, RankOutcome, abort_survivors
from ringtrain.policies.hangs import RankDiagnostics, Verdict, diagnose
from ringtrain.policies.stepwatch import Action, StepWatch
from ringtrain.status import StepReport
from ringtrain.topology import Topology


class Stepping(Protocol):
    """What a step needs of the worker group (``actors.group``): its world and where the
    snapshots go."""

    job: JobConfig
    device: str
    safekeeping: Safekeeping

    @property
    def members(self) -> list[Member]: ...
    @property
    def workers(self) -> list[Any]: ...
    @property
    def topology(self) -> Topology: ...


class StepFailed(Exception):
    """A step did not finish on every rank; ``outcomes`` says how each rank's call ended, and
    ``verdict`` (a stall only) who stopped it and why."""

    def __init__(
        self, outcomes: list[RankOutcome], seen_at: float, seen_unix: float, verdict: Optional[dict[str, Any]] = None
    ) -> None:
        failed = [f"rank {o.rank}: {o.outcome.value} {o.error}".strip() for o in outcomes if o.outcome is not Outcome.OK]
        super().__init__(", ".join(failed))
        self.outcomes = outcomes
        self.seen_at = seen_at  # monotonic time the first failure was seen
        self.seen_unix = seen_unix
        self.verdict = verdict


def run_step(g: Stepping, probe: bool = False, on_safe: Optional[Callable[[int], None]] = None) -> list[StepReport]:
    """As ``WorkerGroup.train_step``: every rank's report of one step, or StepFailed. The
    holders' answers about an earlier step's snapshots are waited on with the step's calls, so
    ``on_safe`` hears of them as they land (``actors.safekeeping``)."""
    import ray

    c = g.job.controllers
    watch = StepWatch(
        range(len(g.members)),
        time.monotonic(),
        step_timeout_s=c.step_timeout_s,
        heartbeat_s=c.heartbeat_s,
        heartbeat_timeout_s=c.heartbeat_timeout_s,
        hang_timeout_s=c.hang_timeout_s,
    )
    calls = [w.train_step.remote(probe) for w in g.workers]
    rank_of = {ref: rank for rank, ref in enumerate(calls)}
    results: dict[int, RankOutcome | StepReport] = {}
    pings: dict[Any, int] = {}
    verdict: Optional[Verdict] = None
    while watch.pending:
        answers = g.safekeeping.refs()
        waited = [calls[r] for r in watch.pending] + answers
        done, _ = ray.wait(waited, num_returns=1, timeout=watch.wait_s(time.monotonic()))
        if answers and g.safekeeping.poll() and on_safe is not None:
            on_safe(g.safekeeping.safe_through)
        for ref in done:
            if ref not in rank_of:
                continue  # a holder's answer, taken in above
            rank = rank_of[ref]
            results[rank] = outcome(ref, rank)
            watch.finished(rank, isinstance(results[rank], StepReport), time.monotonic())
        now = time.monotonic()
        for ping in ray.wait(list(pings), num_returns=len(pings), timeout=0)[0] if pings else []:
            rank = pings.pop(ping)
            if answered(ping):
                watch.heard(rank, now)
        decision = watch.check(now)
        if decision.action is Action.STALL:
            # Find who stopped the step, and evict it so the others' collectives fail.
            verdict = diagnose_stall(g)
            culprits = verdict.ranks if verdict is not None else decision.ranks
            why = verdict.explanation if verdict is not None else decision.why
            for rank in culprits:  # its seat is freed when the recovery drops the rank
                ray.kill(g.members[rank].handle, no_restart=True)
            survivors = abort_survivors(device=g.device, pending=list(decision.ranks), evicted=culprits)
            for rank in survivors:  # not waited for: answered on the worker's second slot
                g.workers[rank].abort.remote()
            for rank in culprits:
                results[rank] = RankOutcome(rank, Outcome.LOST, why)
            watch.lose(culprits, time.monotonic())
            continue
        if decision.action is Action.LOSE:
            for rank, why in decision.lost:
                results[rank] = RankOutcome(rank, Outcome.LOST, why)
            watch.lose([rank for rank, _ in decision.lost], now)
        waiting = set(pings.values())
        for rank in watch.pending:
            if rank not in waiting:
                pings[g.workers[rank].heartbeat.remote()] = rank
    if watch.failed_at is not None:
        outcomes = [r if isinstance(r, RankOutcome) else RankOutcome(rank, Outcome.OK) for rank, r in sorted(results.items())]
        seen_unix = time.time() - (time.monotonic() - watch.failed_at)
        raise StepFailed(outcomes, watch.failed_at, seen_unix, verdict=verdict.to_dict() if verdict is not None else None)
    return [results[rank] for rank in range(len(g.members))]  # type: ignore[misc]


def diagnose_stall(g: Stepping, timeout_s: float = 5.0) -> Optional[Verdict]:
    """Every rank's collective records and stacks (answered on its second concurrency slot
    while its step is blocked), and the culprit they point at."""
    import ray

    topo = g.topology
    refs = [w.diagnostics.remote() for w in g.workers]
    ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    found = []
    for rank, ref in enumerate(refs):
        c = topo.coord(rank)
        where = {"replica": c.replica, "ring_pos": c.ring_pos, "host": host_of(g.members, rank)}
        try:
            d = ray.get(ref, timeout=0)
            found.append(RankDiagnostics.from_probe(rank, d, busy=bool(d.get("busy", True)), **where))
        except Exception:  # dead, or too stuck to answer: that is a finding too
            found.append(RankDiagnostics.unreachable(rank, **where))
    return diagnose(found)
