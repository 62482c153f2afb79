"""Goodput of a long job under failures: where a cluster's GPU-hours go.

One simulated run is a timeline of failures, drawn from a failure profile
(``planner.failures``: a Poisson process per kind, at its rate per GPU-hour over the GPUs
training), and of the repairs that bring lost GPUs back ``Costs.repair_s`` later. Between
events the job trains at the speed of the replicas it has; each failure is recovered from in
one of two ways:

- ``ringtrain``: as ringtrain's Controller decides, asked through a ``Decider`` (the command
  line hands it one that runs the Controller itself on a simulated cluster): a warm spare takes
  the lost seat, the job shrinks to the replicas it has left, or it rolls back in place; it
  loses the step in flight and the steps since its last in-memory snapshot, pays for those
  snapshots on every step that takes one, and grows back when repaired GPUs return.
- ``restart``: as trainers without in-job recovery do: the job is restarted by the scheduler
  from its last durable checkpoint (the scheduler swaps the failed hardware out), losing what
  was trained since, and pays for each blocking durable save.

Time is accounted in the job's GPU-seconds, by cause (CAUSES): ETTR is the share of wall time
spent on training that is kept, at the job's full speed; goodput counts warm spares' GPUs too.
Failures that strike while the job is already down are not drawn (their GPUs are idle).
"""

from __future__ import annotations

import bisect
import heapq
import math
import random
from dataclasses import dataclass, field
from typing import Optional, Protocol

from ringtrain.planner.failures import KINDS, FailureProfile

MODES = ("ringtrain", "restart")
# Where the job's GPU-seconds go that are not kept training.
CAUSES = ("detection", "recovery", "recomputation", "shrunk", "snapshots", "checkpoints", "resizes", "aborted")
SECONDS_PER_DAY = 86_400.0
GPUS_LOST = {"device": 1, "sdc": 1, "software": 0}  # a node loses gpus_per_node


@dataclass(frozen=True)
class Job:
    """The job as the simulation sees it: ``dp`` replicas of ``gpus_per_replica`` GPUs (the
    ring), a step of ``step_s`` at full size, and its recovery settings."""

    dp: int
    gpus_per_replica: int
    step_s: float
    gpus_per_node: int = 8
    min_dp: int = 1
    spares: int = 0  # warm spare GPUs
    snapshot_every: int = 1  # steps between in-memory snapshots (ringtrain)
    persist_every_s: float = 1800.0  # between durable checkpoints
    sdc_every_steps: int = 100  # steps between SDC probe rounds (ringtrain)

    @property
    def gpus(self) -> int:
        return self.dp * self.gpus_per_replica


@dataclass(frozen=True)
class Costs:
    """Seconds each part of a recovery takes at the job's scale, and what snapshots cost."""

    detect_s: float = 10.0  # a dead rank's step failed (controllers.heartbeat_timeout_s)
    reform_s: float = 120.0  # a new world: its members join and restore from their peers' snapshots
    rollback_s: float = 30.0  # the same world back at a snapshot
    grow_s: float = 120.0  # replicas added at a step boundary
    restart_s: float = 600.0  # a job restarted by the scheduler and loaded from the durable store
    save_s: float = 30.0  # a blocking durable checkpoint (restart mode)
    snapshot_overhead: float = 0.02  # a step that takes an in-memory snapshot is this much longer
    repair_s: float = 4 * 3600.0  # a lost GPU or node back in the pool
    source: str = "assumed"


@dataclass(frozen=True)
class Recovery:
    """What the Controller did about a failure: its action, the replicas after it, the warm
    spares it seated, and the completed steps it redoes."""

    action: str
    dp_after: int
    spares_used: int
    lost_steps: int


class Decider(Protocol):
    """ringtrain's recovery decisions for the simulation: ``recover`` from a failure of ``kind``
    with ``spares`` warm spares and ``free_gpus`` idle ones, and the replicas to ``grow_to``."""

    def recover(self, kind: str, *, dp: int, spares: int, free_gpus: int) -> Recovery: ...
    def grow_to(self, *, dp: int, free_gpus: int) -> int: ...


@dataclass
class Outcome:
    """One simulated run: wall time, time kept training (at full speed), lost time by cause
    (seconds of the whole job), failures by kind and recoveries by action."""

    wall_s: float
    kept_s: float
    lost_s: dict[str, float]
    gpus: int
    spares: int
    failures: dict[str, int] = field(default_factory=dict)
    actions: dict[str, int] = field(default_factory=dict)

    @property
    def ettr(self) -> float:
        return self.kept_s / self.wall_s

    @property
    def goodput(self) -> float:
        """Kept GPU-hours over every GPU-hour held, warm spares' included."""
        return self.kept_s * self.gpus / (self.wall_s * (self.gpus + self.spares))

    def lost_gpu_hours(self) -> dict[str, float]:
        return {cause: seconds * self.gpus / 3600.0 for cause, seconds in self.lost_s.items()}


def simulate(
    job: Job,
    profile: FailureProfile,
    costs: Costs,
    *,
    mode: str,
    days: float,
    seed: int,
    decider: Optional[Decider] = None,
) -> Outcome:
    """One run of ``days`` days; ``decider`` is required in ``ringtrain`` mode."""
    if mode not in MODES:
        raise ValueError(f"mode {mode!r}: one of {', '.join(MODES)}")
    if mode == "ringtrain" and decider is None:
        raise ValueError("ringtrain mode needs the Controller's decisions (a Decider)")
    return _Run(job, profile, costs, mode, days * SECONDS_PER_DAY, random.Random(seed), decider).go()


class _Run:
    def __init__(
        self, job: Job, profile: FailureProfile, costs: Costs, mode: str, end_s: float, rng: random.Random, decider: Optional[Decider]
    ) -> None:
        self.job, self.profile, self.costs, self.mode, self.end_s, self.rng, self.decider = (
            job, profile, costs, mode, end_s, rng, decider,
        )  # fmt: skip
        self.t = 0.0
        self.dp = job.dp
        self.spares = job.spares
        self.free_gpus = 0  # repaired GPUs not yet training or standing by
        self.repairs: list[tuple[float, int]] = []  # (time back, GPUs), a heap
        self.kept = 0.0
        self.lost = dict.fromkeys(CAUSES, 0.0)
        self.failures = dict.fromkeys(KINDS, 0)
        self.actions: dict[str, int] = {}
        self.since_save = 0.0  # restart mode: training time since the last durable checkpoint
        kinds = [k for k in KINDS if profile.per_gpu_hour.get(k, 0.0) > 0]
        self.kinds = kinds
        self.cumulative = [sum(profile.per_gpu_hour[k] for k in kinds[: i + 1]) for i in range(len(kinds))]

    # --- the timeline --------------------------------------------------------------------

    def go(self) -> Outcome:
        next_failure = self._draw_failure()
        while self.t < self.end_s:
            repair_at = self.repairs[0][0] if self.repairs else math.inf
            until = min(next_failure, repair_at, self.end_s)
            self._train(until - self.t)
            self.t = until
            if self.t >= self.end_s:
                break
            if until == repair_at:
                self._repaired(heapq.heappop(self.repairs)[1])
            elif not self._failed(self._kind()):
                self.lost["aborted"] += self.end_s - self.t
                self.t = self.end_s
                break
            # Drawn again after every event, from the job's GPUs at work now (the draw is
            # memoryless): a grow or a shrink changes the rate, and a failure needs GPUs at work,
            # so none strikes while the job is down.
            next_failure = self._draw_failure()
        return Outcome(self.end_s, self.kept, self.lost, self.job.gpus, self.job.spares, self.failures, self.actions)

    def _draw_failure(self) -> float:
        rate_per_s = self.profile.total_per_gpu_hour * self.dp * self.job.gpus_per_replica / 3600.0
        return self.t + self.rng.expovariate(rate_per_s) if rate_per_s > 0 else math.inf

    def _kind(self) -> str:
        return self.kinds[bisect.bisect_right(self.cumulative, self.rng.random() * self.cumulative[-1])]

    def _train(self, seconds: float) -> None:
        """Train for ``seconds`` of wall time at the current size, paying for snapshots or saves."""
        j, c = self.job, self.costs
        if seconds <= 0:
            return
        if self.mode == "restart":
            # Every persist_every_s of training, a blocking save of save_s.
            cycle = j.persist_every_s + c.save_s
            saves = self._saves_within(seconds, cycle)
            saving = saves * c.save_s
            self.kept += seconds - saving
            self.lost["checkpoints"] += saving
            return
        speed = self.dp / j.dp
        overhead = c.snapshot_overhead / (j.snapshot_every + c.snapshot_overhead)  # of each step's time
        self.kept += seconds * speed * (1 - overhead)
        self.lost["snapshots"] += seconds * speed * overhead
        self.lost["shrunk"] += seconds * (1 - speed)

    def _saves_within(self, seconds: float, cycle: float) -> float:
        """Restart mode: how much saving ``seconds`` of wall time hold (a fraction of a save at
        either end), keeping ``since_save`` as the training done since the last save ended."""
        j = self.job
        done = 0.0
        left = seconds
        while left > 0:
            to_save = j.persist_every_s - self.since_save
            if left < to_save:
                self.since_save += left
                break
            left -= to_save
            done += min(1.0, left / self.costs.save_s)
            left -= self.costs.save_s
            self.since_save = 0.0 if left >= 0 else j.persist_every_s  # a save cut short saved nothing yet
        return done

    def _down(self, cause: str, seconds: float) -> None:
        """``seconds`` of wall time in which the whole job does nothing kept."""
        seconds = min(seconds, self.end_s - self.t)
        self.lost[cause] += seconds
        self.t += seconds

    # --- events --------------------------------------------------------------------------

    def _failed(self, kind: str) -> bool:
        """Recover from a failure of ``kind``; False when the job cannot go on."""
        j, c = self.job, self.costs
        self.failures[kind] += 1
        step_s = j.step_s * j.dp / self.dp  # the same global batch on fewer replicas
        in_flight = self.rng.random() * step_s
        if self.mode == "restart":
            self._count("restart")
            self._down("detection", c.detect_s)
            self._down("recovery", c.restart_s)
            self._down("recomputation", in_flight + self.since_save)
            self.since_save = 0.0
            return True
        assert self.decider is not None
        gone = j.gpus_per_node if kind == "node" else GPUS_LOST[kind]
        decided = self.decider.recover(kind, dp=self.dp, spares=self.spares, free_gpus=self.free_gpus)
        self._count(decided.action)
        if decided.action == "abort":
            return False
        if kind == "sdc":  # found at the next probe round, then back to the last clean one
            redone = self.rng.randint(1, j.sdc_every_steps)  # the replay probed every step; the job does not
        else:  # back to the newest snapshot: the replay's world took one every step
            redone = decided.lost_steps + self.rng.randrange(j.snapshot_every)
        self._down("detection", c.detect_s)
        self._down("recovery", c.rollback_s if decided.action == "rollback" else c.reform_s)
        self._down("recomputation", in_flight + redone * step_s)
        # The healthy GPUs of replicas that left are idle now; the failed ones are out until repaired.
        left_training = (self.dp - decided.dp_after) * j.gpus_per_replica + decided.spares_used
        self.free_gpus += max(0, left_training - gone)
        self.spares -= decided.spares_used
        self.dp = decided.dp_after
        if gone:
            heapq.heappush(self.repairs, (self.t + c.repair_s, gone))
        self._use_free()
        return True

    def _repaired(self, gpus: int) -> None:
        self.free_gpus += gpus
        if self.mode == "ringtrain":
            self._use_free()

    def _use_free(self) -> None:
        """Idle GPUs make the warm spares whole first (as the Controller replenishes them after
        a recovery), then grow the job back."""
        j = self.job
        refill = min(self.free_gpus, j.spares - self.spares)
        self.spares += refill
        self.free_gpus -= refill
        assert self.decider is not None
        if self.dp < j.dp:
            grown = self.decider.grow_to(dp=self.dp, free_gpus=self.free_gpus)
            if grown > self.dp:
                self.free_gpus -= (grown - self.dp) * j.gpus_per_replica
                self.dp = grown
                self._count("grow")
                self._down("resizes", self.costs.grow_s)

    def _count(self, action: str) -> None:
        self.actions[action] = self.actions.get(action, 0) + 1
