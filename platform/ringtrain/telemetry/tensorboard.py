"""TensorBoard event files of a run: each step's scalars and each incident, under ``<run_dir>/tensorboard/``.

The Controller calls ``step`` with each metrics.jsonl record, ``incident`` with each incident
record and ``close`` at the end; ``tensorboard --logdir runs/`` then shows every run side by
side. Values a record lacks (no persister, no MFU on an unknown device) are left out rather
than written as zero, so a chart never claims a measurement that was not taken.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any, Optional, TypeGuard

# TensorBoard's own event writer and records, not torch's SummaryWriter: the driver writes the
# events, and it has no other use for torch, whose import costs seconds of CPU.
from tensorboard.compat.proto.event_pb2 import Event
from tensorboard.compat.proto.summary_pb2 import Summary
from tensorboard.plugins.text.summary_v2 import text_pb
from tensorboard.summary.writer.event_file_writer import EventFileWriter

from ringtrain.status import PREFERENCE_METRICS

# metrics.jsonl key -> TensorBoard tag. The prefix before "/" is the section TensorBoard groups by.
SCALAR_TAGS: dict[str, str] = {
    "loss": "train/loss",
    "lr": "train/lr",
    "grad_norm": "train/grad_norm",
    "tokens_per_s": "throughput/tokens_per_s",
    "mfu": "throughput/mfu",
    "tokens": "throughput/tokens",
    "step_time_s": "step_time/wall",
    "data_wait_s": "step_time/data_wait",
    "dp": "mesh/dp",
    "cp": "mesh/cp",
    "snapshot_s": "checkpoint/snapshot_s",
    "snapshot_bytes": "checkpoint/snapshot_bytes",
    "persist_s": "checkpoint/persist_s",
    "last_durable_step": "checkpoint/last_durable_step",
    "goodput": "run/goodput",
    # A preference objective's: TRL's names, already sectioned (rewards/..., logps/...).
    **{name: name for name in PREFERENCE_METRICS},
}
# Per-rank lists: key -> tag prefix; rank r of the list is written as f"{prefix}/rank_{r}".
RANK_TAGS: dict[str, str] = {
    "rank_step_time_s": "step_time",
    "rank_memory_bytes": "memory_bytes",
}
INCIDENT_COUNT_TAG = "incidents/count"
INCIDENT_TEXT_TAG = "incidents"
# Seconds between writes of queued events: short enough to watch a run live in TensorBoard.
FLUSH_S = 10
# Lines of a verdict's stack kept in the text summary: the innermost frames name the culprit.
STACK_LINES = 12


def is_number(value: Any) -> TypeGuard[float]:
    """A JSON number (bools are ints to Python but not measurements). NaN counts: it is the news."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class TensorBoardSink:
    """Writes one event file per attempt of a run; calls after ``close`` do nothing."""

    def __init__(self, run_dir: Path) -> None:
        self.log_dir = run_dir / "tensorboard"
        self._writer: Optional[EventFileWriter] = None
        self._num_incidents = 0
        self._closed = False

    def step(self, record: dict[str, Any]) -> None:
        writer = self._open(record.get("step"))
        if writer is None:
            return
        writer.add_event(_event(int(record["step"]), _scalars(record_scalars(record))))

    def incident(self, incident: dict[str, Any]) -> None:
        writer = self._open(incident.get("detected_at_step"))
        if writer is None:
            return
        step = int(incident["detected_at_step"])
        wall_time = incident.get("detected_at") if is_number(incident.get("detected_at")) else None
        self._num_incidents += 1
        # Cumulative, so the chart is a staircase whose risers sit at the incidents' steps.
        writer.add_event(_event(step, _scalars({INCIDENT_COUNT_TAG: float(self._num_incidents)}), wall_time))
        writer.add_event(_event(step, text_pb(INCIDENT_TEXT_TAG, incident_markdown(incident)), wall_time))
        # Incidents are rare and are what someone opens TensorBoard for: do not leave them queued.
        writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
        self._closed = True

    def _open(self, step: Any) -> Optional[EventFileWriter]:
        if self._closed or not is_number(step) or not math.isfinite(step):
            return None
        if self._writer is None:
            # Opened on first use, so a run that fails before its first step leaves no empty
            # event file. No purge event on a resumed run: TensorBoard would then drop the earlier
            # attempt's incidents at the replayed steps, and those are why the run was resumed.
            self.log_dir.mkdir(parents=True, exist_ok=True)
            self._writer = EventFileWriter(str(self.log_dir), flush_secs=FLUSH_S)
        return self._writer


def record_scalars(record: dict[str, Any]) -> dict[str, float]:
    """A metrics.jsonl record as tagged scalars: what TensorBoard and the experiment trackers show."""
    scalars = {tag: float(record[key]) for key, tag in SCALAR_TAGS.items() if is_number(record.get(key))}
    for key, prefix in RANK_TAGS.items():
        values = record.get(key)
        if isinstance(values, list):
            scalars.update((f"{prefix}/rank_{rank}", float(v)) for rank, v in enumerate(values) if is_number(v))
    evaluation = record.get("eval")
    if isinstance(evaluation, dict):
        scalars.update(eval_scalars(evaluation))
    return scalars


def _scalars(values: dict[str, float]) -> Summary:
    """Scalars as TensorBoard's classic ``simple_value`` summaries, which its Scalars dashboard reads."""
    return Summary(value=[Summary.Value(tag=tag, simple_value=value) for tag, value in values.items()])


def _event(step: int, summary: Summary, wall_time: Optional[float] = None) -> Event:
    return Event(step=step, wall_time=time.time() if wall_time is None else wall_time, summary=summary)


def eval_scalars(evaluation: dict[str, Any]) -> dict[str, float]:
    """A record's ``"eval"`` entry as TensorBoard tags: the totals, one loss per position
    bucket (``eval/loss_by_position/0001024-0002048``), the passkey accuracy per prompt length,
    and each lm-eval task's metrics (``task_metric_tag``)."""
    out = {f"eval/{key}": float(evaluation[key]) for key in ("loss", "perplexity", "tokens") if is_number(evaluation.get(key))}
    buckets = evaluation.get("by_position")
    for entry in buckets if isinstance(buckets, list) else []:
        if isinstance(entry, dict) and is_number(entry.get("loss")) and is_number(entry.get("end")):
            out[f"eval/loss_by_position/{_position(entry.get('start'))}-{_position(entry['end'])}"] = float(entry["loss"])
    passkey = evaluation.get("passkey")
    by_length = passkey.get("by_length") if isinstance(passkey, dict) else None
    for length, accuracy in (by_length or {}).items():
        if is_number(accuracy):
            out[f"eval/passkey/len_{int(length):07d}"] = float(accuracy)
    tasks = evaluation.get("tasks")
    for task, metrics in (tasks if isinstance(tasks, dict) else {}).items():
        for name, value in (metrics if isinstance(metrics, dict) else {}).items():
            tag = task_metric_tag(task, name)
            if tag is not None and is_number(value):
                out[tag] = float(value)
    return out


def task_metric_tag(task: str, metric: str) -> Optional[str]:
    """An lm-eval metric (``acc,none``: the metric, then its filter) as a tag every tracker takes
    (no commas: ``eval/tasks/arc_easy/acc``, ``.../exact_match/strict-match``); None for a
    metric's standard error, which is no curve of its own."""
    name, _, flt = metric.partition(",")
    if name.endswith("_stderr") or name == "alias":
        return None
    return f"eval/tasks/{task}/{name}" + ("" if flt in ("", "none") else f"/{flt}")


def _position(value: Any) -> str:
    """A token position zero-padded, so TensorBoard's sorted tags keep the buckets in order."""
    return f"{int(value) if is_number(value) else 0:07d}"


def incident_markdown(incident: dict[str, Any]) -> str:
    """The incident as TensorBoard's text plugin shows it (Markdown)."""
    ident = incident.get("id")
    kind = incident.get("kind", "?")
    head = f"**incident {ident}: {kind}** at step {incident.get('detected_at_step')}"
    lines = [
        head,
        "",
        f"- ranks: {list(incident.get('ranks') or [])}",
        f"- action: {incident.get('action', '?')}",
        f"- dp: {incident.get('dp_before', '?')} -> {_or_dash(incident.get('dp_after'))}",
        f"- detect: {_seconds(incident.get('detect_s'))}, recover: {_seconds(incident.get('recover_s'))}",
        f"- lost steps: {incident.get('lost_steps', 0)}",
        f"- reason: {incident.get('reason', '')}",
    ]
    verdict = incident.get("verdict")
    if isinstance(verdict, dict):
        facts = ", ".join(f"{k} {verdict[k]}" for k in ("culprit_rank", "host", "op", "seq") if k in verdict)
        if facts:
            lines.append(f"- verdict: {facts}")
        stack = verdict.get("stack")
        if isinstance(stack, str) and stack.strip():
            excerpt = stack.strip().splitlines()[-STACK_LINES:]
            # Indented four spaces: a Markdown code block, so the frames keep their layout.
            lines += ["", *("    " + line for line in excerpt)]
    return "\n".join(lines)


def _or_dash(value: Any) -> str:
    return "-" if value is None else str(value)


def _seconds(value: Any) -> str:
    if not is_number(value) or not math.isfinite(value):
        return "-"
    return f"{value:.2f} s"
