"""The run directory: resolved config, one JSON line per step, and a summary at the end.

Files are written so that a reader never sees half a record: metrics lines are flushed whole,
and ``summary.json`` is written to a temporary name and renamed into place.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Optional

from ringtrain.config import RUN_CONFIG, JobConfig, to_yaml
from ringtrain.config.destinations import mask_credentials


def default_run_dir(job: JobConfig, now: Optional[float] = None) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    return Path("runs") / f"{job.name}-{stamp}"


class RunDir:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.path.mkdir(parents=True, exist_ok=True)
        self._metrics = open(self.path / "metrics.jsonl", "a", encoding="utf-8")

    def write_config(self, job: JobConfig) -> None:
        # Credentials written into a URI stay out of a folder others may read (and the report).
        _atomic_write(self.path / RUN_CONFIG, mask_credentials(to_yaml(job)))

    def append_metrics(self, record: dict[str, Any]) -> None:
        self._metrics.write(json.dumps(record, sort_keys=True) + "\n")
        self._metrics.flush()

    def num_incidents(self) -> int:
        """Incidents already recorded here (a resumed run continues the numbering)."""
        folder = self.path / "incidents"
        return len(list(folder.glob("*.json"))) if folder.is_dir() else 0

    def incident_path(self, incident: dict[str, Any]) -> Path:
        """Where ``write_incident`` keeps ``incident``: one file per incident, by id and kind."""
        return self.path / "incidents" / f"{incident['id']:04d}-{incident['kind']}.json"

    def write_incident(self, incident: dict[str, Any]) -> Path:
        path = self.incident_path(incident)
        path.parent.mkdir(exist_ok=True)
        _atomic_write(path, json.dumps(incident, indent=2, sort_keys=True) + "\n")
        return path

    def write_workers(self, layout: dict[str, Any]) -> None:
        """Who runs each rank now (pids, hosts, replica and ring position); rewritten on every
        change of the world, so `kill` and `py-spy` always find the right process."""
        _atomic_write(self.path / "workers.json", json.dumps(layout, indent=2, sort_keys=True) + "\n")

    def write_summary(self, summary: dict[str, Any]) -> None:
        _atomic_write(self.path / "summary.json", json.dumps(summary, indent=2, sort_keys=True) + "\n")

    def close(self) -> None:
        self._metrics.close()


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
