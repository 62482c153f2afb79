"""Watches: the Controller's checks between steps, each a policy's verdict turned into an
incident or a recovery. Stragglers (``policies.stragglers``: each rank's compute time against its
peers') and silent-data-corruption probe rounds (``policies.sdc``: each rank's digests against
its golden values and its peers'). A mixin of the Controller, beside its RunBook.
"""

from __future__ import annotations

import time
from typing import Optional

from ringtrain import metrics
from ringtrain.actors.runbook import RunBook
from ringtrain.actors.states import Recovering
from ringtrain.errors import RingtrainError
from ringtrain.incidents import Kind
from ringtrain.policies.faults import Failure
from ringtrain.policies.sdc import scan_due, sdc_failure
from ringtrain.policies.stragglers import StragglerWatch, slowdowns
from ringtrain.status import StepReport


class Watches(RunBook):
    """The between-step checks; the attributes are the Controller's (set in its __init__)."""

    stragglers: StragglerWatch

    def _watch_stragglers(self, step: int, t0: float, reports: list[StepReport]) -> Optional[Recovering]:
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
        at = self.topology.coord(found.rank)
        where = {"replica": at.replica, "ring_pos": at.ring_pos, "host": infos[found.rank].host if found.rank < len(infos) else "?"}
        reason = (
            f"rank {found.rank} (replica {where['replica']}, ring position {where['ring_pos']}, host {where['host']}) computed "
            f"{found.slowdown:.2f}x its peers' median on steps {list(found.steps)} (controllers.straggler_factor="
            f"{c.straggler_factor:g}, controllers.straggler_steps={c.straggler_steps})"
        )
        evidence = {"straggler": found.to_dict(**where)}
        if c.on_straggler == "report" or self.elastic is None:
            self._incident("straggler", (found.rank,), step, t0, reason=reason, action="report", verdict=evidence)
            return None
        failure = Failure(Kind.STRAGGLER, (found.rank,), reason)
        return Recovering(reason, failure, step, t0, self.clock(), time.time(), verdict=evidence, restore_to=step)

    # --- silent data corruption ---------------------------------------------------------

    def _scan_due(self, step: int) -> bool:
        """Whether ``step`` ends with an SDC probe round: the run's first step (its round sets
        every rank's golden values), then on the cadence and after the last step."""
        if self.sdc is None:
            return False
        every = self.job.controllers.sdc_every_steps
        return step == self.start_step + 1 or scan_due(step, every=every, last_step=self.job.last_step)

    def _judge(self, step: int, t0: float, digests: dict[int, dict[str, str]]) -> Optional[Recovering]:
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
            self._incident("sdc", failure.ranks, step, t0, reason=failure.reason, verdict=evidence)
            raise RingtrainError(f"silent data corruption: {failure.reason}")
        return Recovering(
            failure.reason, failure, step, t0, self.clock(), time.time(), verdict=evidence, restore_to=self.last_clean_scan
        )

    def _repin(self, last_clean: int) -> None:
        """After a world changed: workers that joined hold no pin yet, and a rollback past the
        last clean scan moves it back (the holders would otherwise pin a re-trained step)."""
        self.last_clean_scan = last_clean
        if self.sdc is not None:
            self.group.pin_snapshots(last_clean)
