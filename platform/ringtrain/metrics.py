"""Metric names, labels and help text: the one source for emitters, run files and dashboards.

Names are written without Ray's ``ray_`` prefix; ``ray.util.metrics`` adds it on export (and
``_total`` to counters). Every series carries the ``job`` and ``run_id`` labels, because series
of finished runs stay exported and must not blend with the live one. Counters are created at
zero when a run starts, so "no incident yet" is a series with value 0, not a missing series.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ringtrain.incidents import INCIDENT_KINDS

Kind = Literal["gauge", "counter"]
LABELS = ("job", "run_id")
RAY_PREFIX = "ray_"


@dataclass(frozen=True)
class Metric:
    name: str
    kind: Kind
    help: str
    labels: tuple[str, ...] = LABELS

    @property
    def exported(self) -> str:
        """The series name Prometheus sees."""
        return RAY_PREFIX + self.name + ("_total" if self.kind == "counter" else "")


# Training
STEP = Metric("ringtrain_step", "gauge", "Last completed optimizer step")
LOSS = Metric("ringtrain_loss", "gauge", "Global mean token loss of the last step")
TOKENS_PER_SECOND = Metric("ringtrain_tokens_per_second", "gauge", "Training throughput over the last step; 0 once the run ends")
MFU = Metric("ringtrain_mfu", "gauge", "Model FLOPs utilisation of the last step against the device table's peak")
STEP_TIME = Metric("ringtrain_step_time_seconds", "gauge", "Time of the last step on each rank", LABELS + ("rank",))
DP_SIZE = Metric("ringtrain_dp_size", "gauge", "Data-parallel replicas")
CP_SIZE = Metric("ringtrain_cp_size", "gauge", "Context-parallel degree per replica")
MEMORY_BYTES = Metric("ringtrain_memory_bytes", "gauge", "Peak device memory of each rank during the last step", LABELS + ("rank",))

# Checkpoints
SNAPSHOT_SECONDS = Metric("ringtrain_snapshot_seconds", "gauge", "Latency of the last in-memory snapshot (off the critical path)")
SNAPSHOT_BYTES = Metric("ringtrain_snapshot_bytes", "gauge", "Bytes of the last in-memory snapshot, all ranks")
PERSIST_SECONDS = Metric("ringtrain_persist_seconds", "gauge", "Latency of the last durable checkpoint write")
LAST_DURABLE_STEP = Metric("ringtrain_last_durable_step", "gauge", "Newest step committed to the durable store")

# Reliability
INCIDENTS = Metric("ringtrain_incidents", "counter", f"Incidents by kind ({', '.join(INCIDENT_KINDS)})", LABELS + ("kind",))
RECOVERIES = Metric("ringtrain_recoveries", "counter", "Recoveries completed")
RECOVERY_SECONDS = Metric("ringtrain_recovery_seconds", "gauge", "Time from detection to the next completed step, last incident")
LOST_STEPS = Metric("ringtrain_lost_steps", "counter", "Completed steps redone after incidents")
GOODPUT = Metric("ringtrain_goodput_ratio", "gauge", "Fraction of wall time spent on steps that were kept")
SDC_PROBES = Metric("ringtrain_sdc_probes", "counter", "Silent-data-corruption probe rounds run")
SDC_FAILURES = Metric("ringtrain_sdc_failures", "counter", "Probe rounds that found a mismatch")
HANG_VERDICTS = Metric("ringtrain_hang_verdicts", "counter", "Hang diagnoses issued")
RANK_SLOWDOWN = Metric(
    "ringtrain_rank_slowdown", "gauge", "Each rank's compute time in the last step over its peers' median (stragglers > 1)",
    LABELS + ("rank",),
)

ALL = (
    STEP,
    LOSS,
    TOKENS_PER_SECOND,
    MFU,
    STEP_TIME,
    DP_SIZE,
    CP_SIZE,
    MEMORY_BYTES,
    SNAPSHOT_SECONDS,
    SNAPSHOT_BYTES,
    PERSIST_SECONDS,
    LAST_DURABLE_STEP,
    INCIDENTS,
    RECOVERIES,
    RECOVERY_SECONDS,
    LOST_STEPS,
    GOODPUT,
    SDC_PROBES,
    SDC_FAILURES,
    HANG_VERDICTS,
    RANK_SLOWDOWN,
)
BY_EXPORTED_NAME = {m.exported: m for m in ALL}
