"""Metric names, labels and help text: the one source for emitters, run files and dashboards.

Names are written without Ray's ``ray_`` prefix; ``ray.util.metrics`` adds it on export (and
``_total`` to counters). Every series carries the ``job`` and ``run_id`` labels, because series
of finished runs stay exported and must not blend with the live one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Kind = Literal["gauge", "counter", "histogram"]
LABELS = ("job", "run_id")


@dataclass(frozen=True)
class Metric:
    name: str
    kind: Kind
    help: str
    labels: tuple[str, ...] = LABELS


STEP = Metric("ringtrain_step", "gauge", "Last completed optimizer step")
LOSS = Metric("ringtrain_loss", "gauge", "Global mean token loss of the last step")
TOKENS_PER_SECOND = Metric("ringtrain_tokens_per_second", "gauge", "Training throughput over the last step")
STEP_TIME = Metric("ringtrain_step_time_seconds", "gauge", "Step time per rank", LABELS + ("rank",))
DP_SIZE = Metric("ringtrain_dp_size", "gauge", "Data-parallel replicas")
CP_SIZE = Metric("ringtrain_cp_size", "gauge", "Context-parallel degree per replica")
SNAPSHOT_SECONDS = Metric("ringtrain_snapshot_seconds", "gauge", "Latency of the last in-memory snapshot (off the critical path)")
SNAPSHOT_BYTES = Metric("ringtrain_snapshot_bytes", "gauge", "Bytes of the last in-memory snapshot, all ranks")
PERSIST_SECONDS = Metric("ringtrain_persist_seconds", "gauge", "Latency of the last durable checkpoint write")
LAST_DURABLE_STEP = Metric("ringtrain_last_durable_step", "gauge", "Newest step committed to the durable store")

ALL = (
    STEP,
    LOSS,
    TOKENS_PER_SECOND,
    STEP_TIME,
    DP_SIZE,
    CP_SIZE,
    SNAPSHOT_SECONDS,
    SNAPSHOT_BYTES,
    PERSIST_SECONDS,
    LAST_DURABLE_STEP,
)
