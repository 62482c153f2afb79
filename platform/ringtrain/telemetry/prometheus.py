"""Prometheus export of a run's metrics through Ray's per-node metrics agent.

The Controller feeds one record per step (and the reliability counts) to a ``RunMetrics``; it
sets Ray gauges, which Ray's agent serves on the node's metrics export port (8080 by
convention on KubeRay) with the ``ray_`` prefix. Every metric of ``ringtrain.metrics`` is
created when the run starts, counters at zero: Ray's own Counter cannot be created at zero and
a missing series reads as "no data" rather than "no incident", so counter-kind metrics are
exported as running totals under their ``_total`` name. They only grow within a run, and every
series carries ``run_id``, so ``rate`` and ``increase`` read them as counters.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Callable, Optional

from ringtrain import metrics as m
from ringtrain.config import JobConfig
from ringtrain.incidents import INCIDENT_KINDS


def new_run_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S") + "-" + uuid.uuid4().hex[:6]


class RunMetrics:
    """One run's series. ``gauge_factory`` makes a ``ray.util.metrics.Gauge`` (injectable for tests)."""

    def __init__(
        self,
        job: JobConfig,
        run_id: str,
        *,
        model_flops_per_token: float,
        peak_flops_per_worker: float,
        gauge_factory: Optional[Callable[..., Any]] = None,
    ) -> None:
        if gauge_factory is None:
            from ray.util.metrics import Gauge

            gauge_factory = Gauge
        self.tags = {"job": job.name, "run_id": run_id}
        self.model_flops_per_token = model_flops_per_token
        self.peak_flops_per_worker = peak_flops_per_worker
        self._gauges = {
            metric: gauge_factory(
                metric.exported.removeprefix(m.RAY_PREFIX), description=metric.help, tag_keys=metric.labels
            )
            for metric in m.ALL
        }
        self._totals: dict[tuple[m.Metric, str], float] = {}
        for metric in (m.RECOVERIES, m.LOST_STEPS, m.SDC_PROBES, m.SDC_FAILURES, m.HANG_VERDICTS):
            self.add(metric, 0)
        for kind in INCIDENT_KINDS:
            self.add(m.INCIDENTS, 0, kind=kind)
        self.set(m.GOODPUT, 1.0)
        self.set(m.RECOVERY_SECONDS, 0.0)

    def set(self, metric: m.Metric, value: float, **labels: str) -> None:
        self._gauges[metric].set(float(value), tags={**self.tags, **labels})

    def add(self, metric: m.Metric, amount: float, **labels: str) -> None:
        """Grow a counter-kind metric's running total."""
        key = (metric, labels.get("kind", ""))
        self._totals[key] = self._totals.get(key, 0.0) + amount
        self.set(metric, self._totals[key], **labels)

    def mfu(self, tokens_per_s: float, world_size: int) -> float:
        peak = self.peak_flops_per_worker * world_size
        return self.model_flops_per_token * tokens_per_s / peak if peak > 0 else 0.0

    def step(self, record: dict[str, Any]) -> None:
        world = record["dp"] * record["cp"]
        self.set(m.STEP, record["step"])
        self.set(m.LOSS, record["loss"])
        self.set(m.TOKENS_PER_SECOND, record["tokens_per_s"])
        self.set(m.MFU, self.mfu(record["tokens_per_s"], world))
        self.set(m.DP_SIZE, record["dp"])
        self.set(m.CP_SIZE, record["cp"])
        for rank, seconds in enumerate(record["rank_step_time_s"]):
            self.set(m.STEP_TIME, seconds, rank=str(rank))
        for rank, num_bytes in enumerate(record.get("rank_memory_bytes", [])):
            self.set(m.MEMORY_BYTES, num_bytes, rank=str(rank))
        self.set(m.SNAPSHOT_SECONDS, record.get("snapshot_s", 0.0))
        self.set(m.SNAPSHOT_BYTES, record.get("snapshot_bytes", 0))
        self.set(m.PERSIST_SECONDS, record.get("persist_s", 0.0))
        self.set(m.LAST_DURABLE_STEP, record.get("last_durable_step", 0))

    def goodput(self, ratio: float) -> None:
        self.set(m.GOODPUT, ratio)

    def finish(self) -> None:
        # A finished run trains nothing: alerts on stalled throughput must not fire for it.
        self.set(m.TOKENS_PER_SECOND, 0.0)
