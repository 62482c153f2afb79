"""The run report: one self-contained ``report.html`` drawn from a run directory's files.

It reads what the run wrote (config.yaml, metrics.jsonl, summary.json, incidents/) and
tolerates what a live, crashed or damaged run leaves: a missing file, a half-written last
line, a malformed incident. Each such gap becomes a warning, returned and shown at the top
of the page, and everything that could be read is still drawn. The page needs no network:
its CSS is inline and its charts are inline SVG drawn here, so it opens from disk anywhere.
"""

from __future__ import annotations

import html
import json
import math
import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence, TypeGuard

import yaml

from ringtrain.evaluation.buckets import short_count

REPORT_NAME = "report.html"
NO_SUMMARY = "still running or ended abruptly"
# Keys every incident file should have; one that lacks some is still listed, with a warning.
INCIDENT_KEYS = ("id", "kind", "ranks", "detected_at_step", "action", "reason")
# Points per series drawn: beyond this a series is thinned to each bucket's min and max, so
# a long run's page stays small and a one-step spike (a straggler) still shows.
MAX_POINTS = 1500
STACK_LINES = 20
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf")
KIND_COLORS = {
    "crash": "#d62728",
    "node_lost": "#8b0000",
    "hang": "#ff7f0e",
    "sdc": "#9467bd",
    "nan": "#e377c2",
    "straggler": "#8c564b",
}
# Chart geometry, in SVG user units (the SVG scales to the page's width).
WIDTH, HEIGHT, LEFT, RIGHT, TOP, BOTTOM = 640, 240, 60, 14, 14, 34


@dataclass
class IncidentFile:
    """One file of incidents/: its name, and whatever keys it holds."""

    file: str
    data: dict[str, Any]

    @property
    def step(self) -> Optional[float]:
        value = self.data.get("detected_at_step")
        return float(value) if _number(value) else None


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


def write_report(run_dir: Path) -> tuple[Path, list[str]]:
    """Write ``run_dir/report.html``; returns its path and warnings naming what is missing."""
    if not run_dir.is_dir():
        raise FileNotFoundError(f"run directory {run_dir} does not exist")
    run = read_run(run_dir)
    path = run_dir / REPORT_NAME
    tmp = path.with_name(path.name + ".tmp")
    # Written aside and renamed: a browser reloading the page never sees half of it.
    tmp.write_text(render(run), encoding="utf-8")
    os.replace(tmp, path)
    return path, run.warnings


def read_run(run_dir: Path) -> RunFiles:
    """Everything readable in ``run_dir``; each missing or damaged part adds a warning."""
    run = RunFiles(path=run_dir)
    _read_config(run)
    _read_metrics(run)
    _read_summary(run)
    _read_incidents(run)
    return run


def _read_config(run: RunFiles) -> None:
    path = run.path / "config.yaml"
    if not path.is_file():
        run.warnings.append("config.yaml is missing: the resolved config is not shown")
        return
    run.config_text = path.read_text(encoding="utf-8", errors="replace")
    try:
        loaded = yaml.safe_load(run.config_text)
    except yaml.YAMLError as exc:
        run.warnings.append(f"config.yaml is not valid YAML ({_first_line(exc)}): shown as text")
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
    return record if isinstance(record, dict) and _number(record.get("step")) else None


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
    run.incidents.sort(key=lambda i: (i.data.get("id") if _number(i.data.get("id")) else math.inf, i.file))


# --- the page -------------------------------------------------------------------------------


def render(run: RunFiles) -> str:
    name = str(run.config.get("name") or run.path.name)
    written = time.strftime("%Y-%m-%d %H:%M:%S")
    parts = [
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>{_e(name)}: ringtrain run report</title><style>{CSS}</style></head><body>",
        f'<h1>{_e(name)} <span class="status {_status_class(run)}">{_e(_status(run))}</span></h1>',
        f'<p class="meta">{_e(str(run.path))} &middot; report written {_e(written)}</p>',
    ]
    if run.warnings:
        items = "".join(f"<li>{_e(w)}</li>" for w in run.warnings)
        parts.append(f'<section id="warnings" class="warnings"><h2>Missing or damaged</h2><ul>{items}</ul></section>')
    parts += [_overview(run), _charts(run), _evaluation(run), _incidents(run), _config(run), "</body></html>\n"]
    return "\n".join(parts)


def _status(run: RunFiles) -> str:
    if run.summary is None:
        return NO_SUMMARY
    return str(run.summary.get("status", "unknown"))


def _status_class(run: RunFiles) -> str:
    status = _status(run)
    return f"status-{status}" if status in ("finished", "failed", "stopped") else "status-unknown"


def _overview(run: RunFiles) -> str:
    summary = run.summary or {}
    records = run.records
    first, last = (records[0], records[-1]) if records else ({}, {})
    train = run.config.get("train")
    total = train.get("steps") if isinstance(train, dict) else None
    rows = [
        ("status", _status(run)),
        ("steps recorded", f"{_fmt(last.get('step'))} of {_fmt(total)}" if records else "none"),
        ("loss", f"{_fmt(first.get('loss'))} -> {_fmt(last.get('loss'))}" if records else "-"),
        ("tokens/s", _fmt(summary.get("tokens_per_s") or _mean(records, "tokens_per_s"))),
        ("mesh", f"dp {_fmt(last.get('dp'))} x cp {_fmt(last.get('cp'))}" if records else "-"),
        ("wall time", f"{_fmt(summary.get('wall_time_s'))} s" if "wall_time_s" in summary else "-"),
        ("goodput", _percent(summary.get("goodput", last.get("goodput")))),
        ("last durable step", _fmt(summary.get("last_durable_step", last.get("last_durable_step")))),
        ("parameters", _fmt(summary.get("num_params"))),
        ("incidents", str(len(run.incidents))),
    ]
    if run.num_replayed:
        rows.append(("replayed steps", f"{run.num_replayed} (a resume ran them again; the later attempt is drawn)"))
    if summary.get("resumed_from"):
        rows.append(("resumed from", str(summary["resumed_from"])))
    if summary.get("error"):
        rows.append(("error", str(summary["error"])))
    errors = summary.get("checkpoint_errors")
    for error in errors if isinstance(errors, list) else []:
        rows.append(("checkpoint error", str(error)))
    return f'<section id="overview"><h2>Overview</h2>{_facts(rows)}</section>'


def _charts(run: RunFiles) -> str:
    records = run.records
    num_ranks = max((len(r.get("rank_step_time_s") or []) for r in records), default=0)
    ranks = [Series(f"rank {rank}", _ranked(records, "rank_step_time_s", rank)) for rank in range(num_ranks)]
    # Compute time (outside the step's collectives): the straggler is the long one, where step
    # times are all alike because every rank waits for it.
    computing = [Series(f"rank {rank}", _ranked(records, "rank_compute_s", rank)) for rank in range(num_ranks)]

    def one(label: str, key: str, *, stepped: bool = False) -> list[Series]:
        return [Series(label, _points(records, key), stepped=stepped)]

    # (id, title, series, note under the chart)
    specs: list[tuple[str, str, list[Series], str]] = [
        ("loss", "Loss", one("loss", "loss"), ""),
        ("throughput", "Throughput (tokens/s)", one("tokens/s", "tokens_per_s"), ""),
        (
            "step-time",
            "Step time by rank (s)",
            [*ranks, Series("step (controller)", _points(records, "step_time_s"), dashed=True)],
            _straggler_note(ranks),
        ),
        *(
            [("compute-time", "Compute time by rank (s): slowdown against the median rank", computing, _straggler_note(computing))]
            if any(v > 0 for s in computing for v in _drawn(s.points))  # runs from before it was measured: none
            else []
        ),
        (
            "timeline",
            "Incidents and data-parallel size",
            one("dp", "dp", stepped=True),
            "Markers are incidents at the step that saw them; click one for its details.",
        ),
        (
            "checkpoint",
            "Snapshot and persist latency (s)",
            [*one("snapshot", "snapshot_s"), *one("persist", "persist_s")],
            "",
        ),
        ("goodput", "Goodput (training time / wall time)", one("goodput", "goodput"), ""),
        ("durable", "Last durable step", one("durable step", "last_durable_step", stepped=True), ""),
        ("lr", "Learning rate", one("lr", "lr"), ""),
        ("grad-norm", "Gradient norm", one("grad norm", "grad_norm"), ""),
        ("mfu", "Model FLOPs utilisation", one("MFU", "mfu"), ""),
    ]
    cards = []
    for chart_id, title, series, note in specs:
        legend = "".join(
            f'<li><span class="swatch{" dashed" if s.dashed else ""}" style="border-color:{_color(i, s)}"></span>'
            f"{_e(s.label)}</li>"
            for i, s in enumerate(series)
        )
        caption = f'<p class="note">{_e(note)}</p>' if note else ""
        cards.append(
            f'<figure class="chart" id="chart-{chart_id}"><figcaption>{_e(title)}</figcaption>'
            f'{line_chart(series, run.incidents)}<ul class="legend">{legend}</ul>{caption}</figure>'
        )
    return f'<section id="charts"><h2>Charts</h2><div class="grid">{"".join(cards)}</div></section>'


def _straggler_note(ranks: list[Series]) -> str:
    means = {s.label: statistics.fmean(_drawn(s.points)) for s in ranks if _drawn(s.points)}
    if len(means) < 2:
        return ""
    slowest = max(means, key=lambda label: means[label])
    median = statistics.median(means.values())
    ratio = f", {means[slowest] / median:.2f}x the median rank" if median > 0 else ""
    return f"Slowest on average: {slowest} ({means[slowest]:.3g} s{ratio})."


# Evaluations drawn in the loss-by-position chart: the first, the last and some between.
MAX_EVAL_CURVES = 5


def _evaluation(run: RunFiles) -> str:
    """Evaluations recorded under ``"eval"`` (``eval.every``): loss over steps, loss by position
    for a few of them, the latest one's buckets, and its passkey accuracy grid."""
    evals = [(float(r["step"]), r["eval"]) for r in run.records if isinstance(r.get("eval"), dict)]
    if not evals:
        return ""
    cards = []
    over_steps = [Series("eval loss", [(step, float(e["loss"]) if _number(e.get("loss")) else None) for step, e in evals])]
    cards.append(_card("eval-loss", "Eval loss", over_steps, "", line_chart(over_steps)))
    chosen = [evals[round(i * (len(evals) - 1) / (MAX_EVAL_CURVES - 1))] for i in range(MAX_EVAL_CURVES)] if len(evals) > MAX_EVAL_CURVES else evals
    chosen = list({step: (step, e) for step, e in chosen}.values())
    labels: dict[float, str] = {}
    curves = []
    for step, e in chosen:
        buckets = [b for b in e.get("by_position") or [] if isinstance(b, dict)]
        points: list[Point] = []
        for index, b in enumerate(buckets):
            labels[float(index)] = f"{_tokens(b.get('start'))}-{_tokens(b.get('end'))}"
            points.append((float(index), float(b["loss"]) if _number(b.get("loss")) else None))
        curves.append(Series(f"after step {_fmt(step)}", points))
    chart = line_chart(curves, xlabel="positions", xticks=sorted(labels.items()))
    cards.append(_card("eval-position", "Eval loss by position", curves, "Each point: the mean loss of the predictions made at those positions.", chart))
    step, latest = evals[-1]
    head = "<tr><th>positions</th><th>loss</th><th>tokens</th></tr>"
    rows = "".join(
        f"<tr><td>{_e(_tokens(b.get('start')))}-{_e(_tokens(b.get('end')))}</td><td>{_e(_fmt(b.get('loss')))}</td>"
        f"<td>{_e(_fmt(b.get('tokens')))}</td></tr>"
        for b in latest.get("by_position") or []
        if isinstance(b, dict)
    )
    summary = f"After step {_fmt(step)}: loss {_fmt(latest.get('loss'))}, perplexity {_fmt(latest.get('perplexity'))}, {_fmt(latest.get('tokens'))} tokens."
    parts = [f'<p>{_e(summary)}</p><table class="incidents" id="eval-buckets"><thead>{head}</thead><tbody>{rows}</tbody></table>']
    passkey = next((e["passkey"] for _, e in reversed(evals) if isinstance(e.get("passkey"), dict)), None)
    if passkey is not None:
        parts.append(_passkey_grid(passkey))
    return f'<section id="evaluation"><h2>Evaluation</h2><div class="grid">{"".join(cards)}</div>{"".join(parts)}</section>'


def _card(chart_id: str, title: str, series: Sequence[Series], note: str, chart: str) -> str:
    legend = "".join(
        f'<li><span class="swatch" style="border-color:{_color(i, s)}"></span>{_e(s.label)}</li>' for i, s in enumerate(series)
    )
    caption = f'<p class="note">{_e(note)}</p>' if note else ""
    return f'<figure class="chart" id="chart-{chart_id}"><figcaption>{_e(title)}</figcaption>{chart}<ul class="legend">{legend}</ul>{caption}</figure>'


def _passkey_grid(passkey: dict[str, Any]) -> str:
    """Accuracy by prompt length (rows) and depth (columns), each cell shaded by its value."""
    depths = passkey.get("depths") or []
    head = "<tr><th>length</th>" + "".join(f"<th>depth {_e(_fmt(d))}</th>" for d in depths) + "<th>all</th></tr>"
    rows = []
    accuracy = passkey.get("accuracy") or []
    by_length = passkey.get("by_length") or {}
    for length, cells in zip(passkey.get("lengths") or [], accuracy):
        tds = "".join(
            f'<td style="background:rgba(44,160,44,{float(c):.2f})">{_e(_percent(c))}</td>' for c in cells
        )
        rows.append(f"<tr><th>{_e(_fmt(length))}</th>{tds}<td>{_e(_percent(by_length.get(str(length))))}</td></tr>")
    trials = passkey.get("trials")
    return (
        f'<h3>Passkey retrieval</h3><p class="note">{_e(_fmt(trials))} key(s) per cell; greedy decoding.</p>'
        f'<table class="incidents" id="passkey-grid"><thead>{head}</thead><tbody>{"".join(rows)}</tbody></table>'
    )


def _tokens(value: Any) -> str:
    """A token position as the buckets are named: 1024 -> 1K."""
    return short_count(int(value)) if _number(value) else "?"


INCIDENT_COLUMNS = ("id", "kind", "step", "ranks", "action", "detect", "recover", "lost steps", "dp", "reason")


def _incidents(run: RunFiles) -> str:
    if not run.incidents:
        return '<section id="incidents"><h2>Incidents</h2><p>None recorded.</p></section>'
    head = "".join(f"<th>{h}</th>" for h in INCIDENT_COLUMNS)
    rows = []
    for incident in run.incidents:
        d = incident.data
        kind = str(d.get("kind", "?"))
        cells = [
            f'<a href="#{_anchor(incident)}">{_e(_fmt(d.get("id")))}</a>',
            f'<span class="kind" style="background:{_kind_color(kind)}">{_e(kind)}</span>',
            _e(_fmt(d.get("detected_at_step"))),
            _e(_ranks(d.get("ranks"))),
            _e(str(d.get("action", "-"))),
            _e(_secs(d.get("detect_s"))),
            _e(_secs(d.get("recover_s"))),
            _e(_fmt(d.get("lost_steps"))),
            _e(f"{_fmt(d.get('dp_before'))} -> {_fmt(d.get('dp_after'))}"),
            _e(str(d.get("reason", ""))),
        ]
        rows.append("<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    table = f'<table class="incidents"><thead><tr>{head}</tr></thead><tbody>{"".join(rows)}</tbody></table>'
    details = "".join(_incident_detail(incident) for incident in run.incidents)
    return f'<section id="incidents"><h2>Incidents</h2>{table}{details}</section>'


def _incident_detail(incident: IncidentFile) -> str:
    d = incident.data
    facts = [
        ("file", f"incidents/{incident.file}"),
        ("kind", str(d.get("kind", "?"))),
        ("ranks", _ranks(d.get("ranks"))),
        ("detected at step", _fmt(d.get("detected_at_step"))),
        ("detected at", _when(d.get("detected_at"))),
        ("action", str(d.get("action", "-"))),
        ("reason", str(d.get("reason", ""))),
    ]
    verdict = d.get("verdict")
    stack = ""
    if isinstance(verdict, dict):
        labels = {"culprit_rank": "culprit rank", "host": "host", "op": "op", "seq": "collective seq"}
        facts += [(label, _fmt(verdict[key])) for key, label in labels.items() if key in verdict]
        facts += [(f"verdict {k}", _fmt(v)) for k, v in verdict.items() if k not in labels and k != "stack"]
        if isinstance(verdict.get("stack"), str) and verdict["stack"].strip():
            lines = verdict["stack"].strip().splitlines()
            shown = f"its last {STACK_LINES} of {len(lines)} lines" if len(lines) > STACK_LINES else "whole"
            excerpt = "\n".join(lines[-STACK_LINES:])
            stack = f'<p>Stack ({shown}):</p><pre class="stack">{_e(excerpt)}</pre>'
    title = f"Incident {_fmt(d.get('id'))}: {d.get('kind', '?')}"
    return f'<article class="incident" id="{_anchor(incident)}"><h3>{_e(title)}</h3>{_facts(facts)}{stack}</article>'


def _config(run: RunFiles) -> str:
    if run.config_text is None:
        return '<section id="config"><h2>Resolved config</h2><p>config.yaml is missing.</p></section>'
    return (
        '<section id="config"><h2>Resolved config</h2><details><summary>config.yaml</summary>'
        f"<pre>{_e(run.config_text)}</pre></details></section>"
    )


def _facts(rows: list[tuple[str, str]]) -> str:
    body = "".join(f"<tr><th>{_e(k)}</th><td>{_e(v)}</td></tr>" for k, v in rows)
    return f'<table class="facts">{body}</table>'


# --- SVG line charts ------------------------------------------------------------------------


# (step, value): None where the record has no value (a gap); NaN or inf is marked, not drawn.
Point = tuple[float, Optional[float]]


@dataclass(frozen=True)
class Series:
    label: str
    points: Sequence[Point]
    stepped: bool = False  # a value holds until the next point (dp, durable step)
    dashed: bool = False


def line_chart(
    series: Sequence[Series],
    incidents: Sequence[IncidentFile] = (),
    *,
    xlabel: str = "step",
    xticks: Optional[Sequence[tuple[float, str]]] = None,
) -> str:
    """An inline SVG of ``series`` over steps (or what ``xlabel`` names, at ``xticks``: (x,
    label) pairs), with a vertical marker for each incident."""
    finite = [y for s in series for y in _drawn(s.points)]
    markers = [(i, i.step) for i in incidents if i.step is not None]
    xs = [x for s in series for x, _ in s.points] + [step for _, step in markers]
    svg = f'<svg viewBox="0 0 {WIDTH} {HEIGHT}" role="img" xmlns="http://www.w3.org/2000/svg">'
    if not finite:
        return f'{svg}<text class="empty" x="{WIDTH / 2}" y="{HEIGHT / 2}">no data recorded</text></svg>'
    # Counts (dp, a step number) get whole-number ticks, not 1.8, 2.2.
    whole = all(y.is_integer() for y in finite)
    x0, x1 = _span([min(xs), max(xs)], pad=0.0)
    y0, y1 = _span(finite, pad=0.05, whole=whole)
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    right, bottom = LEFT + plot_w, TOP + plot_h

    def px(x: float) -> float:
        return round(LEFT + (x - x0) / (x1 - x0) * plot_w, 1)

    def py(y: float) -> float:
        return round(TOP + (1 - (y - y0) / (y1 - y0)) * plot_h, 1)

    out = [svg, f'<rect class="plot" x="{LEFT}" y="{TOP}" width="{plot_w}" height="{plot_h}"/>']
    for tick in _ticks(y0, y1, integer=whole):
        out.append(f'<line class="grid" x1="{LEFT}" x2="{right}" y1="{py(tick)}" y2="{py(tick)}"/>')
        out.append(f'<text class="ytick" x="{LEFT - 4}" y="{py(tick) + 3}">{_e(_fmt(tick))}</text>')
    tick_labels = dict(xticks) if xticks is not None else {tick: _fmt(tick) for tick in _ticks(x0, x1, integer=True)}
    for tick, text in tick_labels.items():
        out.append(f'<text class="xtick" x="{px(tick)}" y="{bottom + 14}">{_e(text)}</text>')
    out.append(f'<text class="xlabel" x="{LEFT + plot_w / 2}" y="{HEIGHT - 4}">{_e(xlabel)}</text>')
    for incident, step in markers:
        x, color = px(step), _kind_color(incident.data.get("kind"))
        tip = f"incident {_fmt(incident.data.get('id'))}: {incident.data.get('kind', '?')} at step {_fmt(step)}"
        out.append(
            f'<a href="#{_anchor(incident)}" class="marker"><title>{_e(tip)}</title>'
            f'<line x1="{x}" x2="{x}" y1="{TOP}" y2="{bottom}" stroke="{color}"/>'
            f'<path d="M{x - 5},{TOP} L{x + 5},{TOP} L{x},{TOP + 8} Z" fill="{color}"/></a>'
        )
    for index, s in enumerate(series):
        color = _color(index, s)
        dash = ' stroke-dasharray="5 3"' if s.dashed else ""
        points = _thin(s.points)
        alone: set[float] = set()
        for segment in _segments(points, stepped=s.stepped):
            if len(segment) == 1:
                alone.add(segment[0][0])  # a line needs two points: this one gets a dot below
                continue
            coords = " ".join(f"{px(x)},{py(y)}" for x, y in segment)
            out.append(f'<polyline points="{coords}" stroke="{color}"{dash}/>')
        show_dots = len(points) <= 60
        for x, y in points:
            if y is None:
                continue
            where = f"{_e(s.label)} at {_e(xlabel)} {_e(tick_labels.get(x, _fmt(x)))}"
            if not math.isfinite(y):
                mark = f'<text class="nonfinite" x="{px(x)}" y="{TOP + 12}">'
                out.append(f"{mark}<title>{where}: {y}</title>&#215;</text>")
            elif show_dots or x in alone:
                dot = f'<circle cx="{px(x)}" cy="{py(y)}" r="2.5" fill="{color}">'
                out.append(f"{dot}<title>{where}: {_e(_fmt(y))}</title></circle>")
    out.append("</svg>")
    return "".join(out)


def _segments(points: Sequence[Point], *, stepped: bool) -> list[list[tuple[float, float]]]:
    """Runs of finite points; a gap or a non-finite value breaks the line rather than bridging it."""
    segments: list[list[tuple[float, float]]] = [[]]
    for x, y in points:
        if y is None or not math.isfinite(y):
            segments.append([])
            continue
        current = segments[-1]
        if stepped and current:
            current.append((x, current[-1][1]))
        current.append((x, y))
    return [s for s in segments if s]


def _thin(points: Sequence[Point]) -> list[Point]:
    if len(points) <= MAX_POINTS:
        return list(points)
    size = math.ceil(len(points) / (MAX_POINTS // 2))
    kept: list[Point] = []
    for start in range(0, len(points), size):
        bucket = points[start : start + size]
        finite = [(x, y) for x, y in bucket if y is not None and math.isfinite(y)]
        extremes = {min(finite, key=lambda p: p[1]), max(finite, key=lambda p: p[1])} if finite else set()
        # Every non-finite value stays (each is news); one gap per bucket is enough to break the line.
        odd = [(x, y) for x, y in bucket if y is not None and not math.isfinite(y)]
        gap = [(x, y) for x, y in bucket if y is None][:1]
        kept += sorted([*extremes, *odd, *gap], key=lambda p: p[0])
    return kept


def _span(values: list[float], *, pad: float, whole: bool = False) -> tuple[float, float]:
    low, high = min(values), max(values)
    if high == low:
        delta = 1.0 if whole else abs(low) * 0.1 or 1.0
        return low - delta, high + delta
    margin = (high - low) * pad
    return low - margin, high + margin


def _ticks(low: float, high: float, *, integer: bool = False, count: int = 6) -> list[float]:
    """Round-numbered ticks (1, 2 or 5 times a power of ten) inside [low, high]."""
    raw = (high - low) / count
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    if integer:
        step = max(1.0, round(step))
    first = math.ceil(low / step) * step
    return [first + i * step for i in range(int((high - first) / step) + 1)]


# --- small helpers --------------------------------------------------------------------------


def _number(value: Any) -> TypeGuard[float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _points(records: list[dict[str, Any]], key: str) -> list[Point]:
    return [(float(r["step"]), float(r[key]) if _number(r.get(key)) else None) for r in records]


def _ranked(records: list[dict[str, Any]], key: str, rank: int) -> list[Point]:
    """Rank ``rank``'s values; None at steps it was not part of the job (dp was smaller)."""
    points: list[Point] = []
    for r in records:
        values = r.get(key)
        value = values[rank] if isinstance(values, list) and rank < len(values) else None
        points.append((float(r["step"]), float(value) if _number(value) else None))
    return points


def _drawn(points: Sequence[Point]) -> list[float]:
    return [y for _, y in points if y is not None and math.isfinite(y)]


def _mean(records: list[dict[str, Any]], key: str) -> Optional[float]:
    values = [r[key] for r in records if _number(r.get(key)) and math.isfinite(r[key])]
    return statistics.fmean(values) if values else None


def _color(index: int, series: Series) -> str:
    return "#222222" if series.dashed else PALETTE[index % len(PALETTE)]


def _kind_color(kind: Any) -> str:
    return KIND_COLORS.get(str(kind), "#555555")


def _anchor(incident: IncidentFile) -> str:
    # From the file name, which is unique in the folder; kept to characters safe in an id.
    stem = incident.file.rsplit(".", 1)[0]
    return "incident-" + "".join(c if c.isalnum() or c in "-_" else "_" for c in stem)


def _ranks(value: Any) -> str:
    return ", ".join(str(r) for r in value) if isinstance(value, (list, tuple)) else _fmt(value)


def _secs(value: Any) -> str:
    return f"{value:.3g} s" if _number(value) and math.isfinite(value) else "-"


def _percent(value: Any) -> str:
    return f"{value:.1%}" if _number(value) and math.isfinite(value) else "-"


def _when(value: Any) -> str:
    if not _number(value) or not math.isfinite(value):
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(value))


def _fmt(value: Any) -> str:
    """Numbers short and readable (1.23k, 4.5M); other values as text; None as a dash."""
    if value is None:
        return "-"
    if not _number(value):
        return str(value)
    if not math.isfinite(value):
        return str(value)
    if float(value).is_integer() and abs(value) < 1e6:
        return str(int(value))
    for scale, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= scale:
            return f"{value / scale:.3g}{suffix}"
    return f"{value:.4g}"


def _first_line(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


def _e(text: str) -> str:
    return html.escape(text, quote=True)


CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",sans-serif;color:#1d1d1f;background:#fff}
body{margin:24px auto;max-width:1400px;padding:0 16px}
h1{font-size:22px;margin:0 0 4px}
h2{font-size:17px;margin:28px 0 10px;border-bottom:1px solid #ddd}
h3{font-size:15px;margin:16px 0 6px}
.status{font-size:13px;font-weight:600;padding:2px 8px;border-radius:10px;background:#eee;vertical-align:middle}
.status-finished{background:#d8f3dc}
.status-failed{background:#ffd6d6}
.status-stopped,.status-unknown{background:#fff0c2}
.meta,.note{color:#666;font-size:12px;margin:4px 0}
.warnings{background:#fff4e5;border:1px solid #f0b429;border-radius:6px;padding:4px 14px}
.warnings h2{border:0;margin:8px 0 0}
table{border-collapse:collapse}
th,td{text-align:left;padding:3px 10px 3px 0;vertical-align:top}
table.incidents th,table.incidents td{border-bottom:1px solid #eee;padding:4px 10px 4px 0}
.facts th{color:#555;font-weight:500;white-space:nowrap}
.grid{display:grid;grid-template-columns:repeat(auto-fill,minmax(520px,1fr));gap:16px}
figure.chart{margin:0;border:1px solid #e3e3e3;border-radius:6px;padding:8px 10px}
figcaption{font-weight:600;margin-bottom:4px}
svg{width:100%;height:auto;display:block}
svg .plot{fill:#fcfcfc;stroke:#ccc}
svg .grid{stroke:#eee}
svg polyline{fill:none;stroke-width:1.6}
svg text{font-size:10px;fill:#555}
svg .ytick{text-anchor:end}
svg .xtick,svg .xlabel,svg .empty,svg .nonfinite{text-anchor:middle}
svg .empty{font-size:13px;fill:#999}
svg .nonfinite{font-size:14px;fill:#d62728;font-weight:700}
svg .marker line{stroke-width:1.5;stroke-dasharray:4 3}
ul.legend{list-style:none;margin:4px 0 0;padding:0;display:flex;flex-wrap:wrap;gap:4px 14px;font-size:12px}
.swatch{display:inline-block;width:16px;border-top:3px solid;margin-right:5px;vertical-align:middle}
.swatch.dashed{border-top-style:dashed}
.kind{color:#fff;border-radius:4px;padding:0 6px;font-size:12px}
article.incident{border-left:3px solid #ddd;padding-left:12px;margin:12px 0}
pre{background:#f6f8fa;border-radius:6px;padding:10px;overflow:auto;font-size:12px;max-height:480px}
""".strip()
