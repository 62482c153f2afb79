"""The Weights & Biases client of a run's tracker sink (``telemetry.wandb``): runs, points, alerts, files.

W&B drops a point logged at a step lower than one it has seen, so the sink never sends a step
twice unless its values changed; such a redone step (a rollback after corruption redid it
differently) cannot be a point any more, and goes into the ``redone_steps`` table at the end
instead of being dropped without a word. Incidents are W&B alerts and rows of the
``incidents`` table. Finishing the run also stops W&B's service process. In ``offline`` mode everything stays under ``<run_dir>/wandb/``, for
``wandb sync`` to upload later; the run id in trackers.json makes a resumed run the same run.
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

from ringtrain.config.schema import WandbConfig
from ringtrain.telemetry.tracker_items import Event, Point, Status, incident_text

# Seconds wandb.init may take to reach its service (or a server in online mode) before the sink
# counts it as unreachable; far less than W&B's own default of 90.
INIT_TIMEOUT_S = 30.0
INCIDENT_COLUMNS = ["id", "step", "kind", "action", "ranks", "reason"]
REDONE_COLUMNS = ["step", "key", "value"]


class WandbTracker:
    name = "wandb"

    def __init__(self, settings: WandbConfig, *, run_dir: Path, default_name: str) -> None:
        self.settings = settings
        self.where = f"{settings.entity + '/' if settings.entity else ''}{settings.project} ({settings.mode})"
        self.run_dir = run_dir
        self.run_name = default_name
        self.run: Any = None
        self.incidents: list[list[Any]] = []
        self.redone: list[list[Any]] = []
        self.last_step = 0

    def open(self, run_id: Optional[str], key: str, params: dict[str, str]) -> str:
        import wandb

        s = self.settings
        self.run = wandb.init(
            project=s.project,
            entity=s.entity or None,
            mode=s.mode,  # type: ignore[arg-type]
            group=s.group or None,
            tags=list(s.tags) or None,
            name=self.run_name,
            id=run_id or key,  # the key is the W&B run's id: a run resumed elsewhere finds it
            resume="allow",
            dir=str(self.run_dir),
            config=params,
            allow_val_change=True,
            reinit="create_new",
            settings=wandb.Settings(silent=True, console="off", init_timeout=INIT_TIMEOUT_S, x_disable_stats=True),
        )
        return str(self.run.id)

    def log(self, points: Sequence[Point]) -> None:
        for point in points:
            if point.redone:
                self.redone += [[point.step, key, value] for key, value in point.scalars.items()]
                continue
            self.run.log(dict(point.scalars), step=point.step)
            self.last_step = max(self.last_step, point.step)

    def event(self, event: Event) -> None:
        import wandb

        incident = event.incident
        text = incident_text(incident, event.step)
        self.incidents.append(
            [incident.get("id"), event.step, incident.get("kind"), incident.get("action"), str(list(incident.get("ranks") or [])), str(incident.get("reason", ""))]
        )
        self.run.alert(title=f"ringtrain incident {incident.get('id')}: {incident.get('kind')}", text=text, level=wandb.AlertLevel.WARN)

    def finish(self, status: Status, files: Sequence[Path]) -> None:
        import wandb

        tables = {}
        if self.incidents:
            tables["incidents"] = wandb.Table(columns=INCIDENT_COLUMNS, data=self.incidents)
        if self.redone:
            tables["redone_steps"] = wandb.Table(columns=REDONE_COLUMNS, data=self.redone)
        if tables:
            self.run.log(tables, step=self.last_step)
        for path in files:
            # Copied into the run's own files folder first: saving a file from outside it links
            # it there, and W&B prints a warning about that.
            copy = Path(self.run.dir) / path.name
            shutil.copyfile(path, copy)
            self.run.save(str(copy), base_path=self.run.dir, policy="now")
        exit_code = 0 if status == "finished" else 1
        self.run.finish(exit_code=exit_code)
        # W&B's service (wandb-core, a process this one started) outlives a finished run until
        # the process exits; ended here, while the run ends, it is not left for the cluster's
        # cleanup to kill, and W&B's own exit hook has no service to lose the connection to.
        wandb.teardown(exit_code=exit_code)
