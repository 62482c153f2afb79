"""Grafana dashboard JSON from panels and rows: the building blocks ringtrain's dashboards use.

A ``Panel`` is a stat or a time series of PromQL ``Query``s; ``layout`` places rows of panels on
Grafana's 24-column grid; ``dashboard`` wraps them with the data source, job and run variables
(Grafana schema 39). Queries read ``job=~"$job", run_id=~"$run_id"`` (template variables fed by
``label_values``) and collapse Ray's per-process labels with ``max by``: each run's series come
from one Controller, so the maximum is the run's value and a duplicated series never doubles it.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, Optional

from ringtrain import metrics as m
from ringtrain.metrics import Metric

Json = dict[str, Any]


SCHEMA_VERSION = 39
GRID_COLUMNS = 24
TAG = "ringtrain"
RUN_MATCHERS = 'job=~"$job", run_id=~"$run_id"'
PANEL_DATASOURCE: Json = {"type": "prometheus", "uid": "${datasource}"}


def series(metric: Metric) -> str:
    """``metric{job=~"$job", run_id=~"$run_id"}``: the selector every panel query starts from."""
    return f"{metric.exported}{{{RUN_MATCHERS}}}"


def per_run(metric: Metric, *extra_labels: str) -> str:
    """One series per run (and per ``extra_labels`` value, e.g. rank)."""
    return f"max by ({', '.join(('job', 'run_id') + extra_labels)}) ({series(metric)})"


@dataclass(frozen=True)
class Query:
    expr: str
    legend: str = "{{job}} {{run_id}}"


@dataclass(frozen=True)
class Panel:
    title: str
    kind: Literal["timeseries", "stat"]
    queries: tuple[Query, ...]
    description: str
    unit: str = "short"
    width: int = 12
    decimals: Optional[int] = None
    min: Optional[float] = None
    max: Optional[float] = None
    # Stat colouring: (value from which the colour applies, colour); the first entry is the base.
    thresholds: tuple[tuple[Optional[float], str], ...] = ((None, "green"),)
    # Step-shaped lines for values that change in jumps (counts, sizes, steps).
    stepped: bool = False


@dataclass(frozen=True)
class Row:
    height: int
    panels: tuple[Panel, ...]


def stat(title: str, expr: str, description: str, **options: Any) -> Panel:
    return Panel(title, "stat", (Query(expr),), description, width=4, **options)


def graph(title: str, queries: Sequence[Query], description: str, **options: Any) -> Panel:
    return Panel(title, "timeseries", tuple(queries), description, **options)


def _field_config(panel: Panel) -> Json:
    defaults: Json = {"unit": panel.unit}
    if panel.decimals is not None:
        defaults["decimals"] = panel.decimals
    if panel.min is not None:
        defaults["min"] = panel.min
    if panel.max is not None:
        defaults["max"] = panel.max
    if panel.kind == "stat":
        defaults["color"] = {"mode": "thresholds"}
        defaults["thresholds"] = {
            "mode": "absolute",
            "steps": [{"color": color, "value": value} for value, color in panel.thresholds],
        }
    else:
        defaults["color"] = {"mode": "palette-classic"}
        defaults["custom"] = {
            "drawStyle": "line",
            "lineInterpolation": "stepAfter" if panel.stepped else "linear",
            "lineWidth": 1,
            "fillOpacity": 10,
            "showPoints": "never",
            "spanNulls": False,
        }
    return {"defaults": defaults, "overrides": []}


def _options(panel: Panel) -> Json:
    if panel.kind == "stat":
        return {
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            "colorMode": "value",
            "graphMode": "area",
            "justifyMode": "auto",
            "orientation": "auto",
            "textMode": "auto",
        }
    return {
        "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
        "tooltip": {"mode": "multi", "sort": "desc"},
    }


def _panel_json(panel: Panel, panel_id: int, x: int, y: int, height: int) -> Json:
    targets = [
        {
            "refId": chr(ord("A") + i),
            "datasource": PANEL_DATASOURCE,
            "expr": query.expr,
            "legendFormat": query.legend,
            "range": True,
            "instant": False,
        }
        for i, query in enumerate(panel.queries)
    ]
    return {
        "id": panel_id,
        "type": panel.kind,
        "title": panel.title,
        "description": panel.description,
        "datasource": PANEL_DATASOURCE,
        "gridPos": {"x": x, "y": y, "w": panel.width, "h": height},
        "targets": targets,
        "fieldConfig": _field_config(panel),
        "options": _options(panel),
    }


def layout(rows: Sequence[Row]) -> list[Json]:
    """Panels placed row by row, left to right, on Grafana's 24-column grid."""
    panels: list[Json] = []
    y = 0
    for row in rows:
        x = 0
        for panel in row.panels:
            if x + panel.width > GRID_COLUMNS:
                raise ValueError(f"row at y={y} is wider than {GRID_COLUMNS} columns at {panel.title!r}")
            panels.append(_panel_json(panel, len(panels) + 1, x, y, row.height))
            x += panel.width
        y += row.height
    return panels


def _variables() -> list[Json]:
    job_query = f"label_values({m.STEP.exported}, job)"
    run_query = f'label_values({m.STEP.exported}{{job=~"$job"}}, run_id)'
    common: Json = {"current": {}, "hide": 0, "options": [], "skipUrlSync": False}
    return [
        {
            **common,
            "name": "datasource",
            "label": "Data source",
            "type": "datasource",
            "query": "prometheus",
            "regex": "",
            "refresh": 1,
            "includeAll": False,
            "multi": False,
        },
        {
            **common,
            "name": "job",
            "label": "Job",
            "type": "query",
            "datasource": PANEL_DATASOURCE,
            "query": job_query,
            "definition": job_query,
            "regex": "",
            # Refresh on time-range change, so jobs that ran in the shown window are listed.
            "refresh": 2,
            "sort": 1,
            "includeAll": True,
            "multi": True,
            "allValue": ".*",
        },
        {
            **common,
            "name": "run_id",
            "label": "Run",
            "type": "query",
            "datasource": PANEL_DATASOURCE,
            "query": run_query,
            "definition": run_query,
            "regex": "",
            "refresh": 2,
            # Run ids start with their start time: descending order lists the newest first.
            "sort": 2,
            "includeAll": True,
            "multi": True,
            "allValue": ".*",
        },
    ]


def dashboard(uid: str, title: str, description: str, rows: Sequence[Row]) -> Json:
    return {
        "id": None,
        "uid": uid,
        "title": title,
        "description": description,
        "tags": [TAG],
        "editable": True,
        "fiscalYearStartMonth": 0,
        "graphTooltip": 1,
        "liveNow": False,
        "refresh": "30s",
        "schemaVersion": SCHEMA_VERSION,
        "time": {"from": "now-6h", "to": "now"},
        "timepicker": {},
        "timezone": "browser",
        "version": 1,
        "weekStart": "",
        "annotations": {"list": []},
        # Every ringtrain dashboard links to the others, keeping the chosen job, run and time.
        "links": [
            {
                "title": "ringtrain",
                "type": "dashboards",
                "tags": [TAG],
                "asDropdown": False,
                "includeVars": True,
                "keepTime": True,
                "icon": "external link",
                "targetBlank": False,
                "tooltip": "",
                "url": "",
            }
        ],
        "templating": {"list": _variables()},
        "panels": layout(rows),
    }


def render(board: Json) -> str:
    """The checked-in text of a dashboard: stable key order, two-space indent, final newline."""
    return json.dumps(board, indent=2, ensure_ascii=False) + "\n"


def with_datasource(board: Json, uid: str, name: str) -> Json:
    """A copy of ``board`` whose data source variable starts on the given data source."""
    pinned = copy.deepcopy(board)
    for variable in pinned["templating"]["list"]:
        if variable["type"] == "datasource":
            variable["current"] = {"selected": True, "text": name, "value": uid}
    return pinned
