"""What a tracker is sent: a step's point, an incident's event, and how the run ended.

Below ``trackers`` (the sinks that send them) and the tracker modules (``mlflow_tracker``,
``wandb_tracker``, which the sinks load only when a job turns them on): both import these, and
neither imports the other back.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

# A run's tracker key as ``TrackerState.key`` makes it (uuid4's hex). One read from a checkpoint
# or a run folder from elsewhere is checked against it before it goes anywhere near a tracker's
# query (MLflow's search filter is text).
KEY_PATTERN = re.compile(r"[0-9a-f]{32}")


def is_key(value: Any) -> bool:
    return isinstance(value, str) and KEY_PATTERN.fullmatch(value) is not None

Status = str  # "finished" | "failed" | "stopped", as summary.json says


@dataclass(frozen=True)
class Point:
    step: int
    scalars: dict[str, float]
    redone: bool = False  # the tracker holds this step already, with other training values


@dataclass(frozen=True)
class Event:
    step: int
    incident: dict[str, Any]


def incident_text(incident: dict[str, Any], step: int) -> str:
    """One line of an incident, as a tracker's event shows it."""
    ranks = list(incident.get("ranks") or [])
    where = f" on ranks {ranks}" if ranks else ""
    return f"{incident.get('kind', '?')} at step {step}{where}: {incident.get('action', '?')}; {incident.get('reason', '')}"
