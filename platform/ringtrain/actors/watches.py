"""Watches: what the Controller watches between steps, the one owner of what is being watched.

Stragglers (``policies.stragglers``: each rank's compute time against its peers'), silent data
corruption (``policies.sdc``: each probe round's digests against the golden values and the
peers', and the last clean scan, the rollback point a failed one goes back to), errors that come
back on the same step (``policies.repeats``), and capacity for growth (``policies.elastic``'s
GrowGate and the replicas being prepared). Each verdict becomes an incident or the recovery it
starts (a ``Recovering`` state); a world formed again starts the watches over.
"""

from __future__ import annotations

import time
from typing import Callable, Optional, Sequence

from ringtrain import metrics
from ringtrain.actors.observers import Observers
from ringtrain.actors.protocols import Elastic, Group
from ringtrain.actors.runbook import RunBook
from ringtrain.actors.states import Recovering
from ringtrain.config import JobConfig
from ringtrain.errors import RingtrainError
from ringtrain.incidents import Kind
from ringtrain.policies.elastic import GrowGate, target_dp
from ringtrain.policies.faults import Failure
from ringtrain.policies.repeats import ErrorSignature, RepeatTracker, repeated_reason
from ringtrain.policies.sdc import SdcScanner, scan_due, sdc_failure
from ringtrain.policies.stragglers import StragglerWatch, slowdowns
from ringtrain.status import StepReport


class Watches:
    def __init__(
        self,
        job: JobConfig,
        group: Group,
        elastic: Optional[Elastic],
        book: RunBook,
        observers: Observers,
        clock: Callable[[], float],
    ) -> None:
        """``elastic``: None when any failure ends the run (a verdict is then only reported)."""
        self.job, self.group, self.elastic, self.book, self.observers, self.clock = job, group, elastic, book, observers, clock
        c = job.controllers
        self.stragglers = StragglerWatch(c.straggler_factor, c.straggler_steps)
        self.sdc = SdcScanner(cross_rank=c.sdc_cross_rank) if c.sdc_every_steps > 0 else None
        self.last_clean_scan = 0  # the newest step the SDC probes vouched for
        self.scans = 0
        self.repeats = RepeatTracker()
        self.grow_gate = GrowGate(c.grow_after_s)
        self.growing_to: Optional[int] = None  # the dp the replicas being prepared make
        self._next_capacity_check = 0.0

    def world_changed(self, seats: Sequence[Optional[int]], *, last_clean: int) -> None:
        """A world formed again (``seats``: new rank -> old rank): golden values stay with their
        workers, the rollback point is ``last_clean``, and the growth and straggler watches start
        over."""
        if self.sdc is not None:
            self.sdc.reseat(seats)
        self.repin(last_clean)
        self.growing_to = None
        self.grow_gate.reset()
        self.stragglers.reset()

    # --- stragglers --------------------------------------------------------------------------

    def watch_stragglers(self, step: int, t0: float, reports: list[StepReport]) -> Optional[Recovering]:
        """Export each rank's slowdown; with controllers.on_straggler set, name a persistent
        straggler (policies.stragglers) and, with evict, recover from it as from a lost rank
        whose slot is not reused. Returns the recovery an eviction starts."""
        compute = {r.rank: r.compute_s for r in reports}
        for rank, ratio in slowdowns(compute).items():
            self.observers.on_gauge(metrics.RANK_SLOWDOWN, ratio, rank=str(rank))
        c = self.job.controllers
        found = self.stragglers.observe(step, compute) if c.on_straggler != "off" and len(reports) > 1 else None
        if found is None:
            return None
        infos = self.group.infos
        at = self.group.topology.coord(found.rank)
        where = {"replica": at.replica, "ring_pos": at.ring_pos, "host": infos[found.rank].host if found.rank < len(infos) else "?"}
        reason = (
            f"rank {found.rank} (replica {where['replica']}, ring position {where['ring_pos']}, host {where['host']}) computed "
            f"{found.slowdown:.2f}x its peers' median on steps {list(found.steps)} (controllers.straggler_factor="
            f"{c.straggler_factor:g}, controllers.straggler_steps={c.straggler_steps})"
        )
        evidence = {"straggler": found.to_dict(**where)}
        if c.on_straggler == "report" or self.elastic is None:
            self.book.incident("straggler", (found.rank,), step, t0, reason=reason, action="report", verdict=evidence)
            return None
        failure = Failure(Kind.STRAGGLER, (found.rank,), reason)
        return Recovering(reason, failure, step, t0, self.clock(), time.time(), verdict=evidence, restore_to=step)

    # --- silent data corruption ---------------------------------------------------------

    def scan_due(self, step: int) -> bool:
        """Whether ``step`` ends with an SDC probe round: the run's first step (its round sets
        every rank's golden values), then on the cadence and after the last step."""
        if self.sdc is None:
            return False
        every = self.job.controllers.sdc_every_steps
        return step == self.book.start_step + 1 or scan_due(step, every=every, last_step=self.job.last_step)

    def judge(self, step: int, t0: float, digests: dict[int, dict[str, str]]) -> Optional[Recovering]:
        """Judge the probe round that ended ``step`` (rank -> probe -> digest). Clean: the newest
        snapshot at or before ``step`` becomes the rollback point. A failure is recovered from
        at once: returns that recovery."""
        assert self.sdc is not None
        self.scans += 1
        self.observers.on_count(metrics.SDC_PROBES, 1)
        verdict = self.sdc.check(step, digests)
        if verdict is None:
            self.last_clean_scan = step
            self.group.pin_snapshots(step)
            return None
        self.observers.on_count(metrics.SDC_FAILURES, 1)
        node_of = {i: info.node_id for i, info in enumerate(self.group.infos)}
        failure = sdc_failure(verdict, node_of=node_of, evict_node=self.job.controllers.sdc_evict_node)
        evidence = {"sdc": verdict.to_dict(), "last_clean_scan": self.last_clean_scan}
        if self.elastic is None:
            self.book.incident("sdc", failure.ranks, step, t0, reason=failure.reason, verdict=evidence)
            raise RingtrainError(f"silent data corruption: {failure.reason}")
        return Recovering(
            failure.reason, failure, step, t0, self.clock(), time.time(), verdict=evidence, restore_to=self.last_clean_scan
        )

    def repin(self, last_clean: int) -> None:
        """After a world changed: workers that joined hold no pin yet, and a rollback past the
        last clean scan moves it back (the holders would otherwise pin a re-trained step)."""
        self.last_clean_scan = last_clean
        if self.sdc is not None:
            self.group.pin_snapshots(last_clean)

    def sdc_summary(self) -> Optional[dict[str, int]]:
        return {"scans": self.scans, "last_clean_scan": self.last_clean_scan} if self.sdc is not None else None

    # --- errors that come back ---------------------------------------------------------------

    def repeated(self, failure: Failure, step: int) -> str:
        """Why ``failure`` will not be retried: the same exception on the same step again
        (``policies.repeats``), its place kept as the run's error location; "" for any other
        failure."""
        if failure.kind is not Kind.ERROR:
            return ""
        signature = ErrorSignature(failure.error or failure.reason, failure.where)
        occurrences = self.repeats.observe(step, signature)
        reason = repeated_reason(signature, step, occurrences)
        if reason is None:
            return ""
        self.book.error_location = {**signature.to_dict(), "step": step, "ranks": list(failure.ranks), "occurrences": occurrences}
        return reason

    # --- capacity for growth -------------------------------------------------------------------

    def maybe_grow(self, step: int, *, snapshot_taken: bool) -> Optional[int]:
        """Between steps: grow back towards max_dp when capacity has returned and stayed.
        Returns the dp to grow to once its replicas are ready and ``step`` took a snapshot
        (``snapshot_taken``): the new world restores that very step, so a grow waits for the next
        step boundary with one (every checkpoint.snapshot_every steps; a run without snapshots
        never grows, nor prepares workers for it)."""
        dp = self.group.topology.dp
        if self.elastic is None or dp >= self.job.max_dp or step >= self.job.last_step:
            return None
        if not self.job.checkpoint.snapshot_every:
            return None
        if self.growing_to is not None:
            ready = self.elastic.growth_ready()  # polled every step: it replaces a worker that died warming up
            return self.growing_to if ready and snapshot_taken else None
        now = self.clock()
        if now < self._next_capacity_check:
            return None
        self._next_capacity_check = now + self.job.controllers.heartbeat_s
        t = self.job.train
        possible = target_dp(
            dp + self.elastic.growth_capacity() // self.group.topology.cp,
            global_batch=t.global_batch,
            micro_batch=t.micro_batch,
            min_dp=self.job.mesh.min_dp,
            max_dp=self.job.max_dp,
        )
        grow_to = self.grow_gate.observe(now, current_dp=dp, possible_dp=possible)
        if grow_to is not None:
            self.observers.on_message(
                f"capacity for dp {grow_to} seen for controllers.grow_after_s: starting {grow_to - dp} replica(s)"
            )
            self.elastic.prepare_growth(grow_to - dp)
            self.growing_to = grow_to
        return None
