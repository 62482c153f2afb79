"""The run-directory reader: what a run wrote (config.yaml, metrics.jsonl, summary.json,
incidents/), read as far as it can be.

It tolerates what a live, crashed or damaged run leaves: a missing file, a half-written last
line, a malformed incident. Each such gap becomes a warning naming the file, and everything that
could be read is kept. ``telemetry.rundir`` is the writer of the same files.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, TypeGuard

import yaml

from ringtrain.config import RUN_CONFIG

# What a run without a summary.json is: it never wrote one, or has not yet.
NO_SUMMARY = "still running or ended abruptly"
# Keys every incident file should have; one that lacks some is still listed, with a warning.
INCIDENT_KEYS = ("id", "kind", "ranks", "detected_at_step", "action", "reason")


@dataclass
class IncidentFile:
    """One file of incidents/: its name, and whatever keys it holds."""

    file: str
    data: dict[str, Any]

    @property
    def step(self) -> Optional[float]:
        value = self.data.get("detected_at_step")
        return float(value) if is_number(value) else None


@dataclass
class RunFiles:
    """What could be read of one run directory, and what could not (``warnings``)."""

    path: Path
    config_text: Optional[str] = None
    config: dict[str, Any] = field(default_factory=dict)
    records: list[dict[str, Any]] = field(default_factory=list)
    num_replayed: int = 0
    summary: Optional[dict[str, Any]] = None
    incidents: list[IncidentFile] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


def read_run(run_dir: Path) -> RunFiles:
    """Everything readable in ``run_dir``; each missing or damaged part adds a warning."""
    run = RunFiles(path=run_dir)
    _read_config(run)
    _read_metrics(run)
    _read_summary(run)
    _read_incidents(run)
    return run


def _read_config(run: RunFiles) -> None:
    path = run.path / RUN_CONFIG
    if not path.is_file():
        run.warnings.append("config.yaml is missing: the resolved config is not shown")
        return
    run.config_text = path.read_text(encoding="utf-8", errors="replace")
    try:
        loaded = yaml.safe_load(run.config_text)
    except yaml.YAMLError as exc:
        run.warnings.append(f"config.yaml is not valid YAML ({first_line(exc)}): shown as text")
        return
    if isinstance(loaded, dict):
        run.config = loaded
    else:
        run.warnings.append("config.yaml does not hold a mapping: shown as text")


def _read_metrics(run: RunFiles) -> None:
    path = run.path / "metrics.jsonl"
    if not path.is_file():
        run.warnings.append("metrics.jsonl is missing: no step was recorded, so there are no curves")
        return
    lines = path.read_text(encoding="utf-8", errors="replace").split("\n")
    # Every record ends with a newline; text after the last one is a record still being written.
    *whole, tail = lines
    records: list[dict[str, Any]] = []
    bad: list[int] = []
    for number, line in enumerate(whole, start=1):
        if line.strip():
            record = _record(line)
            if record is None:
                bad.append(number)
            else:
                records.append(record)
    if tail.strip():
        record = _record(tail)
        if record is None:
            run.warnings.append(
                f"metrics.jsonl: the last line ({len(whole) + 1}) is incomplete "
                "(still being written, or cut off): ignored"
            )
        else:
            records.append(record)
    if bad:
        shown = ", ".join(str(n) for n in bad[:5]) + (", ..." if len(bad) > 5 else "")
        run.warnings.append(f"metrics.jsonl: {len(bad)} malformed line(s) skipped (line {shown})")
    if not records and not bad and not tail.strip():
        run.warnings.append("metrics.jsonl is empty: no step was recorded yet, so there are no curves")
    run.records, run.num_replayed = _latest_attempt(records)


def _record(line: str) -> Optional[dict[str, Any]]:
    try:
        record = json.loads(line)
    except ValueError:
        return None
    return record if isinstance(record, dict) and is_number(record.get("step")) else None


def _latest_attempt(records: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], int]:
    """A resumed run appends from its checkpoint's step on: the later attempt's records win."""
    kept: list[dict[str, Any]] = []
    replayed = 0
    for record in records:
        while kept and kept[-1]["step"] >= record["step"]:
            kept.pop()
            replayed += 1
        kept.append(record)
    return kept, replayed


def _read_summary(run: RunFiles) -> None:
    path = run.path / "summary.json"
    if not path.is_file():
        run.warnings.append(f"summary.json is missing: the run is {NO_SUMMARY}")
        return
    try:
        summary = json.loads(path.read_text(encoding="utf-8", errors="replace"))
    except ValueError as exc:
        run.warnings.append(f"summary.json is not valid JSON ({exc}): the run's outcome is unknown")
        return
    if isinstance(summary, dict):
        run.summary = summary
    else:
        run.warnings.append("summary.json does not hold a JSON object: the run's outcome is unknown")


def _read_incidents(run: RunFiles) -> None:
    folder = run.path / "incidents"
    if not folder.is_dir():
        return
    for path in sorted(p for p in folder.glob("*.json") if p.is_file()):
        shown = f"incidents/{path.name}"
        try:
            data = json.loads(path.read_text(encoding="utf-8", errors="replace"))
        except ValueError as exc:
            run.warnings.append(f"{shown} is not valid JSON ({exc}): not listed")
            continue
        if not isinstance(data, dict):
            run.warnings.append(f"{shown} does not hold a JSON object: not listed")
            continue
        missing = [key for key in INCIDENT_KEYS if key not in data]
        if missing:
            run.warnings.append(f"{shown} lacks {', '.join(missing)}: listed with what it has")
        run.incidents.append(IncidentFile(path.name, data))
    run.incidents.sort(key=lambda i: (i.data.get("id") if is_number(i.data.get("id")) else math.inf, i.file))


def is_number(value: Any) -> TypeGuard[float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def first_line(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


def incident_anchor(incident: IncidentFile) -> str:
    # From the file name, which is unique in the folder; kept to characters safe in an id.
    stem = incident.file.rsplit(".", 1)[0]
    return "incident-" + "".join(c if c.isalnum() or c in "-_" else "_" for c in stem)
