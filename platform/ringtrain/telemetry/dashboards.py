"""ringtrain's Grafana dashboards, built from the metric registry with fixed uids.

Everything here is data. ``DASHBOARDS`` maps each checked-in file name to the function that
builds its dashboard JSON (Grafana schema 39); the alert rules are ``telemetry.alerts``. Every
expression is written from ``Metric.exported``, so a renamed metric breaks here, at build time,
not on a live panel.

Dashboard queries read ``job=~"$job", run_id=~"$run_id"`` (template variables fed by
``label_values``) and collapse Ray's per-process labels with ``max by``: each run's series come
from one Controller, so the maximum is the run's value and a duplicated series never doubles it.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Optional

from ringtrain import metrics as m
from ringtrain.metrics import Metric
from ringtrain.telemetry.alerts import LOW_GOODPUT

Json = dict[str, Any]

SCHEMA_VERSION = 39
GRID_COLUMNS = 24
TRAINING_UID = "ringtrain-training"
RELIABILITY_UID = "ringtrain-reliability"
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


def training() -> Json:
    step_time = Query(per_run(m.STEP_TIME, "rank"), "{{run_id}} rank {{rank}}")
    memory = Query(per_run(m.MEMORY_BYTES, "rank"), "{{run_id}} rank {{rank}}")
    world = f"{per_run(m.DP_SIZE)} * {per_run(m.CP_SIZE)}"
    rows = [
        Row(
            4,
            (
                stat("Step", per_run(m.STEP), m.STEP.help, decimals=0),
                stat("Loss", per_run(m.LOSS), m.LOSS.help, decimals=3),
                stat("Tokens/s", per_run(m.TOKENS_PER_SECOND), m.TOKENS_PER_SECOND.help),
                stat(
                    "MFU",
                    per_run(m.MFU),
                    m.MFU.help,
                    unit="percentunit",
                    decimals=1,
                    thresholds=((None, "red"), (0.2, "orange"), (0.35, "green")),
                ),
                stat("DP replicas", per_run(m.DP_SIZE), m.DP_SIZE.help, decimals=0),
                stat("CP degree", per_run(m.CP_SIZE), m.CP_SIZE.help, decimals=0),
            ),
        ),
        Row(
            8,
            (
                graph("Loss", [Query(per_run(m.LOSS))], m.LOSS.help),
                graph("Tokens/s", [Query(per_run(m.TOKENS_PER_SECOND))], m.TOKENS_PER_SECOND.help, min=0),
            ),
        ),
        Row(
            8,
            (
                graph("MFU", [Query(per_run(m.MFU))], m.MFU.help, unit="percentunit", min=0, max=1),
                graph("Step time by rank", [step_time], m.STEP_TIME.help, unit="s", min=0),
            ),
        ),
        Row(
            8,
            (
                graph(
                    "DP and CP over time",
                    [
                        Query(per_run(m.DP_SIZE), "dp {{run_id}}"),
                        Query(per_run(m.CP_SIZE), "cp {{run_id}}"),
                        Query(world, "GPUs {{run_id}}"),
                    ],
                    "Data-parallel replicas, context-parallel degree, and their product (GPUs in use)",
                    decimals=0,
                    min=0,
                    stepped=True,
                ),
                graph("Memory by rank", [memory], m.MEMORY_BYTES.help, unit="bytes", min=0),
            ),
        ),
    ]
    return dashboard(
        TRAINING_UID,
        "ringtrain / training",
        "Loss, throughput, MFU, per-rank step time and memory, and the mesh of ringtrain runs",
        rows,
    )


def reliability() -> Json:
    steps_at_risk = f"{per_run(m.STEP)} - {per_run(m.LAST_DURABLE_STEP)}"
    rows = [
        Row(
            4,
            (
                stat(
                    "Goodput",
                    per_run(m.GOODPUT),
                    m.GOODPUT.help,
                    unit="percentunit",
                    decimals=1,
                    thresholds=((None, "red"), (LOW_GOODPUT, "orange"), (0.9, "green")),
                ),
                stat("Time to recover (last)", per_run(m.RECOVERY_SECONDS), m.RECOVERY_SECONDS.help, unit="s"),
                stat("Recoveries", per_run(m.RECOVERIES), m.RECOVERIES.help, decimals=0),
                stat(
                    "Lost steps",
                    per_run(m.LOST_STEPS),
                    m.LOST_STEPS.help,
                    decimals=0,
                    thresholds=((None, "green"), (1, "orange")),
                ),
                stat(
                    "SDC failures",
                    per_run(m.SDC_FAILURES),
                    m.SDC_FAILURES.help,
                    decimals=0,
                    thresholds=((None, "green"), (1, "red")),
                ),
                stat(
                    "Hang verdicts",
                    per_run(m.HANG_VERDICTS),
                    m.HANG_VERDICTS.help,
                    decimals=0,
                    thresholds=((None, "green"), (1, "orange")),
                ),
            ),
        ),
        Row(
            8,
            (
                graph(
                    "Incidents by kind",
                    [Query(per_run(m.INCIDENTS, "kind"), "{{kind}} {{run_id}}")],
                    m.INCIDENTS.help + ", running totals",
                    decimals=0,
                    min=0,
                    stepped=True,
                ),
                graph("Goodput", [Query(per_run(m.GOODPUT))], m.GOODPUT.help, unit="percentunit", min=0, max=1),
            ),
        ),
        Row(
            8,
            (
                graph(
                    "Time to recover (MTTR)",
                    [Query(per_run(m.RECOVERY_SECONDS))],
                    m.RECOVERY_SECONDS.help,
                    unit="s",
                    min=0,
                    stepped=True,
                ),
                graph(
                    "Recoveries and lost steps",
                    [
                        Query(per_run(m.RECOVERIES), "recoveries {{run_id}}"),
                        Query(per_run(m.LOST_STEPS), "lost steps {{run_id}}"),
                    ],
                    "Recoveries completed and completed steps redone after incidents, running totals",
                    decimals=0,
                    min=0,
                    stepped=True,
                ),
            ),
        ),
        Row(
            8,
            (
                graph(
                    "Snapshot and persist latency",
                    [
                        Query(per_run(m.SNAPSHOT_SECONDS), "snapshot {{run_id}}"),
                        Query(per_run(m.PERSIST_SECONDS), "persist {{run_id}}"),
                    ],
                    "Latency of the last in-memory snapshot (off the critical path) and of the last "
                    "durable checkpoint write",
                    unit="s",
                    min=0,
                    width=8,
                ),
                graph(
                    "Snapshot size",
                    [Query(per_run(m.SNAPSHOT_BYTES))],
                    m.SNAPSHOT_BYTES.help,
                    unit="bytes",
                    min=0,
                    width=8,
                ),
                graph(
                    "Last durable step vs current step",
                    [
                        Query(per_run(m.STEP), "step {{run_id}}"),
                        Query(per_run(m.LAST_DURABLE_STEP), "durable {{run_id}}"),
                        Query(steps_at_risk, "at risk {{run_id}}"),
                    ],
                    "The last completed step, the newest step in the durable store, and the steps "
                    "a loss of the whole cluster would cost",
                    decimals=0,
                    min=0,
                    stepped=True,
                    width=8,
                ),
            ),
        ),
        Row(
            8,
            (
                graph(
                    "SDC probes and failures",
                    [
                        Query(per_run(m.SDC_PROBES), "probes {{run_id}}"),
                        Query(per_run(m.SDC_FAILURES), "failures {{run_id}}"),
                    ],
                    "Silent-data-corruption probe rounds run and rounds that found a mismatch, "
                    "running totals",
                    decimals=0,
                    min=0,
                    stepped=True,
                ),
                graph(
                    "Hang verdicts",
                    [Query(per_run(m.HANG_VERDICTS))],
                    m.HANG_VERDICTS.help + ", running total",
                    decimals=0,
                    min=0,
                    stepped=True,
                ),
            ),
        ),
        Row(
            8,
            (
                graph(
                    "Rank slowdown (stragglers)",
                    [Query(per_run(m.RANK_SLOWDOWN, "rank"), "{{run_id}} rank {{rank}}")],
                    m.RANK_SLOWDOWN.help + "; controllers.straggler_factor marks a straggler",
                    decimals=2,
                    min=0,
                    width=24,
                ),
            ),
        ),
    ]
    return dashboard(
        RELIABILITY_UID,
        "ringtrain / reliability",
        "Incidents, recoveries, goodput, checkpoints and corruption probes of ringtrain runs",
        rows,
    )


DASHBOARDS: dict[str, Callable[[], Json]] = {"training.json": training, "reliability.json": reliability}


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
