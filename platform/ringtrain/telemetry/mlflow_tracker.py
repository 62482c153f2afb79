"""The MLflow client of a run's tracker sink (``telemetry.mlflow``): runs, points, incident tags, files.

Points go as metric batches at their steps; a redone step's new values are one more point at the
same step, which MLflow keeps beside the first (its charts show both; the latest is the run's).
Incidents are tags ``incident.NNNN`` whose text is the incident's line. Parameters are immutable
in MLflow: a continued run logs only the ones it lacks, and a value that changed since is kept
as the tag ``param_changed.<key>``. On a local sqlite store the run's files go beside the
database (``artifact_root``), never into the folder the run was started from, and MLflow's INFO
lines stay off the run's console.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional
from urllib.parse import unquote

from ringtrain.config.destinations import mask_credentials
from ringtrain.config.schema import MlflowConfig
from ringtrain.telemetry.tracker_items import Event, Point, Status, incident_text, is_key

# MLflow's own limits on one request and on a parameter's or tag's value.
MAX_METRICS_PER_BATCH = 1000
MAX_PARAMS_PER_BATCH = 100
MAX_PARAM_CHARS = 6000
MAX_TAG_CHARS = 5000
# The client's own retries would hold the sink's thread for minutes on a lost server; the sink
# retries a bounded number of times itself, each request bounded by this timeout.
REQUEST_TIMEOUT_S = "10"
KEY_TAG = "ringtrain.run_key"  # the tag that finds a run's MLflow run from its tracker key
SUMMARY_STATUS = {"finished": "FINISHED", "failed": "FAILED", "stopped": "KILLED"}
SQLITE_PREFIX = "sqlite:///"
ARTIFACT_FOLDER = "mlflow-artifacts"


def artifact_root(tracking_uri: str) -> Optional[str]:
    """Where a new experiment's files go on a local sqlite store: beside the database, in
    ``mlflow-artifacts/`` (MLflow's own default is ``./mlruns`` of whatever folder the run was
    started from). None for a server (it chooses) and a file store (its own folder)."""
    if not tracking_uri.startswith(SQLITE_PREFIX):
        return None
    database = Path(unquote(tracking_uri[len(SQLITE_PREFIX) :]))  # relative, or absolute after a 4th slash
    return (database.absolute().parent / ARTIFACT_FOLDER).as_uri()


class MlflowTracker:
    name = "mlflow"

    def __init__(self, settings: MlflowConfig, *, default_name: str) -> None:
        self.settings = settings
        self.where = mask_credentials(settings.tracking_uri)
        self.run_name = settings.run_name or default_name
        self.client: Any = None
        self.run_id = ""

    def open(self, run_id: Optional[str], key: str, params: dict[str, str]) -> str:
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", REQUEST_TIMEOUT_S)
        # The run's console is ringtrain's: no "View run at ..." lines in the middle of it.
        os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")
        # Nor its INFO lines (a new sqlite store announces its migrations): MLflow sets its
        # loggers' level from this variable when it is imported, and again here if it already was.
        os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")
        from mlflow.entities import Param, RunTag
        from mlflow.tracking import MlflowClient

        logging.getLogger("mlflow").setLevel(logging.WARNING)
        self.client = MlflowClient(tracking_uri=self.settings.tracking_uri)
        experiment = self.client.get_experiment_by_name(self.settings.experiment)
        experiment_id = (
            experiment.experiment_id
            if experiment is not None
            else self.client.create_experiment(self.settings.experiment, artifact_location=artifact_root(self.settings.tracking_uri))
        )
        run = self.client.get_run(run_id) if run_id is not None else self._run_with_key(experiment_id, key)
        if run is not None:
            self.run_id = run.info.run_id
            self.client.update_run(self.run_id, status="RUNNING")
            logged = dict(run.data.params)
        else:
            tags = {KEY_TAG: key, "ringtrain.job": self.run_name, **self.settings.tags}
            self.run_id = self.client.create_run(experiment_id, run_name=self.run_name, tags=tags).info.run_id
            logged = {}
        values = {key: value[:MAX_PARAM_CHARS] for key, value in params.items()}
        new = [Param(key, value) for key, value in values.items() if key not in logged]
        changed = [RunTag(f"param_changed.{key}", value[:MAX_TAG_CHARS]) for key, value in values.items() if key in logged and logged[key] != value]
        for start in range(0, len(new), MAX_PARAMS_PER_BATCH):
            self.client.log_batch(self.run_id, params=new[start : start + MAX_PARAMS_PER_BATCH])
        if changed:
            self.client.log_batch(self.run_id, tags=changed)
        return self.run_id

    def _run_with_key(self, experiment_id: str, key: str) -> Any:
        # Checked again where it becomes query text: a key is hex digits, never a quote.
        if not is_key(key):
            raise ValueError(f"{key!r} is not a ringtrain tracker key")
        found = self.client.search_runs([experiment_id], filter_string=f"tags.`{KEY_TAG}` = '{key}'", max_results=1)
        return found[0] if found else None

    def log(self, points: Sequence[Point]) -> None:
        from mlflow.entities import Metric

        now_ms = int(time.time() * 1000)
        metrics = [Metric(key, value, now_ms, p.step) for p in points for key, value in p.scalars.items()]
        for start in range(0, len(metrics), MAX_METRICS_PER_BATCH):
            self.client.log_batch(self.run_id, metrics=metrics[start : start + MAX_METRICS_PER_BATCH])

    def event(self, event: Event) -> None:
        incident = event.incident
        ident = incident.get("id", 0)
        self.client.set_tag(self.run_id, f"incident.{int(ident):04d}", incident_text(incident, event.step)[:MAX_TAG_CHARS])

    def finish(self, status: Status, files: Sequence[Path]) -> None:
        for path in files:
            self.client.log_artifact(self.run_id, str(path))
        self.client.set_terminated(self.run_id, status=SUMMARY_STATUS.get(status, "FAILED"))

