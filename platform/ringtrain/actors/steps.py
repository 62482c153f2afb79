"""One training step on every rank of the group's world, watched until each rank's call ends.

``policies.stepwatch`` says when a rank of the step is lost (no heartbeat, past the step
timeout) or the step stalled; ``run_step`` carries its decisions out: on a stall it asks every
rank for its collective records and stacks, names the culprit (``policies.hangs``), evicts it
and aborts the survivors' collectives. The step's end comes back as a value, a ``StepResult``:
every rank's report, or how each rank's call ended when one did not finish it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
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


@dataclass(frozen=True)
class StepResult:
    """How one step ended on the world's ranks: every rank's report when each finished it;
    otherwise how each rank's call ended (``outcomes``), when the first failure was seen, and,
    for a stall, who stopped the step and why (``verdict``)."""

    reports: tuple[StepReport, ...] = ()
    outcomes: tuple[RankOutcome, ...] = ()
    seen_at: float = 0.0  # the group's clock (monotonic on Ray) when the first failure was seen
    seen_unix: float = 0.0
    verdict: Optional[dict[str, Any]] = None

    @property
    def failed(self) -> bool:
        return bool(self.outcomes)

    def why(self) -> str:
        """The ranks that did not finish, and how."""
        return ", ".join(f"rank {o.rank}: {o.outcome.value} {o.error}".strip() for o in self.outcomes if o.outcome is not Outcome.OK)

    def reports_or_raise(self) -> tuple[StepReport, ...]:
        """The reports, for a caller with no recovery (benches, tests): a failed step raises."""
        if self.failed:
            raise RuntimeError(f"the step failed: {self.why()}")
        return self.reports


def run_step(g: Stepping, probe: bool = False, on_safe: Optional[Callable[[int], None]] = None) -> StepResult:
    """As ``WorkerGroup.train_step``: how one step ended on every rank (``StepResult``). The
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
        return StepResult(
            outcomes=tuple(outcomes), seen_at=watch.failed_at, seen_unix=seen_unix,
            verdict=verdict.to_dict() if verdict is not None else None,
        )
    return StepResult(reports=tuple(results[rank] for rank in range(len(g.members))))  # type: ignore[misc]


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
