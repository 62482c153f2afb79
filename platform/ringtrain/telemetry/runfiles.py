"""The run-directory reader: what a run wrote (config.yaml, metrics.jsonl, summary.json,
incidents/), read as far as it can be.

It tolerates what a live, crashed or damaged run leaves: a missing file, a half-written last
line, a malformed incident, a number no float holds. Each such gap becomes a warning naming the
file, and everything that could be read is kept. ``telemetry.rundir`` is the writer of the same
files.

The folder may come from elsewhere, so its files are read as untrusted: ``config.yaml`` within
the bounds of a job file (``config.yamlfile``: a few lines of YAML aliases can describe billions
of values, which drawing the config would spell out), and none through a link out of the folder
(``links``), which would put whatever it points at into a page meant to be shared.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, TypeGuard

import yaml

from ringtrain.config import RUN_CONFIG
from ringtrain.config.yamlfile import MAX_FILE_BYTES, check_bounds
from ringtrain.errors import ConfigError, first_line
from ringtrain.jsonfile import JsonFileError, parse_json
from ringtrain.links import check_inside

# The key a file of the run directory that links out of it is refused under.
RUN_DIR_KEY = "RUN_DIR"

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
    """Everything readable in ``run_dir``; each missing or damaged part adds a warning. A file
    that links out of the folder is a ConfigError naming it (``RUN_DIR``): nothing is read."""
    for name in (RUN_CONFIG, "metrics.jsonl", "summary.json", "incidents"):
        check_inside(run_dir, run_dir / name, RUN_DIR_KEY)
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
    size = path.stat().st_size
    if size > MAX_FILE_BYTES:
        run.warnings.append(f"config.yaml is {size:,} bytes, more than a config holds ({MAX_FILE_BYTES:,}): not shown")
        return
    run.config_text = path.read_text(encoding="utf-8", errors="replace")
    try:
        loaded = yaml.safe_load(run.config_text)
        check_bounds(loaded, RUN_CONFIG)
    except yaml.YAMLError as exc:
        run.warnings.append(f"config.yaml is not valid YAML ({first_line(exc)}): shown as text")
        return
    except RecursionError:
        run.warnings.append("config.yaml nests too deeply to be read: shown as text")
        return
    except ConfigError as exc:
        run.warnings.append(f"{exc.reason}: shown as text")
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
    """A metrics record, its numbers all floats' (a larger integer is dropped); None unless a
    JSON object with a finite step."""
    record = _json(line)
    if not isinstance(record, dict):
        return None
    step = record.get("step")
    return record if is_number(step) and math.isfinite(step) else None


# What ``_json`` returns for text that is not JSON, or nests too deeply to read.
NOT_JSON = object()


def _json(text: str) -> Any:
    """The JSON value of ``text`` with every integer too large for a float replaced by None
    (each value is drawn as a float), or NOT_JSON."""
    try:  # the caller read the file within its bounds
        return _floatable(parse_json(text, max_bytes=None))
    except (JsonFileError, RecursionError):  # not JSON, or nested deeper than walking it may go
        return NOT_JSON


def _floatable(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _floatable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_floatable(v) for v in value]
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > sys.float_info.max:
        return None
    return value


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
    summary = _json(path.read_text(encoding="utf-8", errors="replace"))
    if summary is NOT_JSON:
        run.warnings.append("summary.json is not valid JSON: the run's outcome is unknown")
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
        check_inside(run.path, path, RUN_DIR_KEY)
        data = _json(path.read_text(encoding="utf-8", errors="replace"))
        if data is NOT_JSON:
            run.warnings.append(f"{shown} is not valid JSON: not listed")
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


def incident_anchor(incident: IncidentFile) -> str:
    # From the file name, which is unique in the folder; kept to characters safe in an id.
    stem = incident.file.rsplit(".", 1)[0]
    return "incident-" + "".join(c if c.isalnum() or c in "-_" else "_" for c in stem)
