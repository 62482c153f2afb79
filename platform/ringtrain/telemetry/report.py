"""The run report: one self-contained ``report.html`` drawn from a run directory's files.

What the run wrote is read by ``telemetry.runfiles``, which turns each missing or damaged
part into a warning; the warnings are returned and shown at the top of the page, and
everything that could be read is still drawn. The page needs no network: its CSS is inline
and its charts are inline SVG (``telemetry.svgchart``), so it opens from disk anywhere.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from ringtrain.errors import first_line
from ringtrain.evaluation.buckets import short_count
from ringtrain.planner.devices import CPU_CORE_PEAK_FLOPS
from ringtrain.telemetry.runfiles import NO_SUMMARY, IncidentFile, RunFiles, incident_anchor, is_number, read_run
from ringtrain.telemetry.svgchart import Point, Series, drawn, escape, fmt, kind_color, line_chart, series_color
from ringtrain.train.conversations import PACKING_COUNTS, packing_note
from ringtrain.train.pairs import PAIR_COUNTS

REPORT_NAME = "report.html"
STACK_LINES = 20  # lines of a culprit's stack shown in an incident's detail


def write_report(run_dir: Path) -> tuple[Path, list[str]]:
    """Write ``run_dir/report.html``; returns its path and warnings naming what is missing."""
    if not run_dir.is_dir():
        raise FileNotFoundError(f"run directory {run_dir} does not exist")
    run = read_run(run_dir)
    path = run_dir / REPORT_NAME
    tmp = path.with_name(path.name + ".tmp")
    # Written aside and renamed: a browser reloading the page never sees half of it. Into a new
    # file: whatever was at that name (a link planted in a folder from elsewhere) is not written
    # through, and the rename replaces the entry at ``path``, never what a link there points at.
    tmp.unlink(missing_ok=True)
    with open(tmp, "x", encoding="utf-8") as page:
        page.write(render(run))
    os.replace(tmp, path)
    return path, run.warnings


def render(run: RunFiles) -> str:
    # The sections first: one that meets values it cannot draw adds its warning to the list.
    sections = [_drawn(run, title, draw) for title, draw in SECTIONS]
    name = str(run.config.get("name") or run.path.name)
    written = time.strftime("%Y-%m-%d %H:%M:%S")
    parts = [
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>{escape(name)}: ringtrain run report</title><style>{CSS}</style></head><body>",
        f'<h1>{escape(name)} <span class="status {_status_class(run)}">{escape(_status(run))}</span></h1>',
        f'<p class="meta">{escape(str(run.path))} &middot; report written {escape(written)}</p>',
    ]
    if run.warnings:
        items = "".join(f"<li>{escape(w)}</li>" for w in run.warnings)
        parts.append(f'<section id="warnings" class="warnings"><h2>Missing or damaged</h2><ul>{items}</ul></section>')
    parts += [*sections, "</body></html>\n"]
    return "\n".join(parts)


def _drawn(run: RunFiles, title: str, draw: Callable[[RunFiles], str]) -> str:
    """A section of the page, or, where the run's files hold values of shapes it cannot draw
    (a list where a number belongs, a mapping where a list does), a note and a warning."""
    try:
        return draw(run)
    except (TypeError, ValueError, AttributeError, KeyError, IndexError, OverflowError) as exc:
        warning = f"the {title} section could not be drawn from damaged values ({type(exc).__name__}: {first_line(exc)}): left out"
        run.warnings.append(warning)
        return f'<section><h2>{escape(title.capitalize())}</h2><p class="note">{escape(warning)}</p></section>'


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
        ("steps recorded", f"{fmt(last.get('step'))} of {fmt(total)}" if records else "none"),
        ("loss", f"{fmt(first.get('loss'))} -> {fmt(last.get('loss'))}" if records else "-"),
        ("tokens/s", fmt(summary.get("tokens_per_s") or _mean(records, "tokens_per_s"))),
        ("mesh", f"dp {fmt(last.get('dp'))} x cp {fmt(last.get('cp'))}" if records else "-"),
        ("wall time", f"{fmt(summary.get('wall_time_s'))} s" if "wall_time_s" in summary else "-"),
        ("goodput", _percent(summary.get("goodput", last.get("goodput")))),
        ("last durable step", fmt(summary.get("last_durable_step", last.get("last_durable_step")))),
        ("parameters", _count(summary.get("num_params"))),
        ("incidents", str(len(run.incidents))),
    ]
    packing = _packing_note(summary.get("chat"), run.config.get("data"))
    if packing:
        rows.append(packing)
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


def _packing_note(counts: Any, data: Any) -> Optional[tuple[str, str]]:
    """The chat or preference data's packing row (``conversations.packing_note``), a warning
    when what data.seq_len dropped or cut is past its share; None for other data or an older
    summary."""
    kinds = {"chat data": PACKING_COUNTS, "preference data": PAIR_COUNTS}
    kind = next((name for name, keys in kinds.items()
                 if isinstance(counts, dict) and all(isinstance(counts.get(k), int) for k in keys)), None)  # fmt: skip
    if kind is None or not isinstance(data, dict):
        return None
    seq_len = data.get("seq_len")
    note, warn = packing_note(counts, seq_len if isinstance(seq_len, int) else 0, str(data.get("chat_overlong")))
    return kind, f"warning: {note}" if warn else note


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
            if any(v > 0 for s in computing for v in drawn(s.points))  # runs from before it was measured: none
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
        ("durable", "Last durable step", one("durable step", "last_durable_step", stepped=True), _durable_note(run)),
        ("lr", "Learning rate", one("lr", "lr"), ""),
        ("grad-norm", "Gradient norm", one("grad norm", "grad_norm"), ""),
        ("mfu", "Model FLOPs utilisation", one("MFU", "mfu"), _mfu_note(run)),
    ]
    cards = []
    for chart_id, title, series, note in specs:
        legend = "".join(
            f'<li><span class="swatch{" dashed" if s.dashed else ""}" style="border-color:{series_color(i, s)}"></span>'
            f"{escape(s.label)}</li>"
            for i, s in enumerate(series)
        )
        caption = f'<p class="note">{escape(note)}</p>' if note else ""
        cards.append(
            f'<figure class="chart" id="chart-{chart_id}"><figcaption>{escape(title)}</figcaption>'
            f'{line_chart(series, run.incidents)}<ul class="legend">{legend}</ul>{caption}</figure>'
        )
    return f'<section id="charts"><h2>Charts</h2><div class="grid">{"".join(cards)}</div></section>'


def _durable_note(run: RunFiles) -> str:
    """What a flat durable-step line means: no checkpoint persisted during the run (short runs)."""
    durable = {r["last_durable_step"] for r in run.records if is_number(r.get("last_durable_step"))}
    if len(durable) > 1 or not run.records:
        return ""
    checkpoint = run.config.get("checkpoint")
    every = checkpoint.get("persist_every") if isinstance(checkpoint, dict) else None
    cadence = f" (checkpoint.persist_every is {fmt(every)})" if every is not None else ""
    step = next(iter(durable), 0)
    held = f"stayed at step {fmt(step)}" if step else "was none"
    return f"No checkpoint was persisted during these steps{cadence}: the last durable step {held}."


def _mfu_note(run: RunFiles) -> str:
    """On CPU the peak is a nominal per-core figure, not a measured or datasheet one."""
    device = (run.summary or {}).get("device")
    if not isinstance(device, str) or not device.lower().startswith("cpu"):
        return ""
    return (
        f"On CPU, against a nominal peak of {CPU_CORE_PEAK_FLOPS / 1e9:.0f} GFLOP/s a core (AVX2 FMA at ~3 GHz): "
        "for comparing runs on one machine, not with a GPU's MFU."
    )


def _straggler_note(ranks: list[Series]) -> str:
    means = {s.label: statistics.fmean(drawn(s.points)) for s in ranks if drawn(s.points)}
    if len(means) < 2:
        return ""
    slowest = max(means, key=lambda label: means[label])
    median = statistics.median(means.values())
    ratio = f", {means[slowest] / median:.2f}x the median rank" if median > 0 else ""
    return f"Slowest on average: {slowest} ({means[slowest]:.3g} s{ratio})."


# Evaluations drawn in the loss-by-position chart: the first, the last and some between.
MAX_EVAL_CURVES = 5


def _task_table(step: float, tasks: dict[str, Any]) -> str:
    """The latest evaluation's lm-eval metrics, task by task, under lm-eval's names."""
    rows = "".join(
        f"<tr><td>{escape(str(task))}</td><td>{escape(str(name))}</td><td>{escape(fmt(value))}</td></tr>"
        for task, metrics in sorted(tasks.items()) if isinstance(metrics, dict)
        for name, value in metrics.items() if is_number(value)
    )
    return (f'<h3>lm-eval tasks</h3><p class="note">After step {escape(fmt(step))}.</p><table class="incidents" '
            f'id="eval-tasks"><thead><tr><th>task</th><th>metric</th><th>value</th></tr></thead><tbody>{rows}</tbody></table>')


def _evaluation(run: RunFiles) -> str:
    """Evaluations recorded under ``"eval"`` (``eval.every``): loss over steps, loss by position
    for a few of them, the latest one's buckets, and its passkey accuracy grid."""
    evals = [(float(r["step"]), r["eval"]) for r in run.records if isinstance(r.get("eval"), dict)]
    if not evals:
        return ""
    cards = []
    over_steps = [Series("eval loss", [(step, float(e["loss"]) if is_number(e.get("loss")) else None) for step, e in evals])]
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
            points.append((float(index), float(b["loss"]) if is_number(b.get("loss")) else None))
        curves.append(Series(f"after step {fmt(step)}", points))
    chart = line_chart(curves, xlabel="positions", xticks=sorted(labels.items()))
    cards.append(_card("eval-position", "Eval loss by position", curves, "Each point: the mean loss of the predictions made at those positions.", chart))
    step, latest = evals[-1]
    head = "<tr><th>positions</th><th>loss</th><th>tokens</th></tr>"
    rows = "".join(
        f"<tr><td>{escape(_tokens(b.get('start')))}-{escape(_tokens(b.get('end')))}</td><td>{escape(fmt(b.get('loss')))}</td>"
        f"<td>{escape(fmt(b.get('tokens')))}</td></tr>"
        for b in latest.get("by_position") or []
        if isinstance(b, dict)
    )
    summary = f"After step {fmt(step)}: loss {fmt(latest.get('loss'))}, perplexity {fmt(latest.get('perplexity'))}, {fmt(latest.get('tokens'))} tokens."
    parts = [f'<p>{escape(summary)}</p><table class="incidents" id="eval-buckets"><thead>{head}</thead><tbody>{rows}</tbody></table>']
    passkey = next((e["passkey"] for _, e in reversed(evals) if isinstance(e.get("passkey"), dict)), None)
    if passkey is not None:
        parts.append(_passkey_grid(passkey))
    tasks = next(((s, e["tasks"]) for s, e in reversed(evals) if isinstance(e.get("tasks"), dict)), None)
    if tasks is not None:
        parts.append(_task_table(*tasks))
    return f'<section id="evaluation"><h2>Evaluation</h2><div class="grid">{"".join(cards)}</div>{"".join(parts)}</section>'


def _card(chart_id: str, title: str, series: Sequence[Series], note: str, chart: str) -> str:
    legend = "".join(
        f'<li><span class="swatch" style="border-color:{series_color(i, s)}"></span>{escape(s.label)}</li>' for i, s in enumerate(series)
    )
    caption = f'<p class="note">{escape(note)}</p>' if note else ""
    return f'<figure class="chart" id="chart-{chart_id}"><figcaption>{escape(title)}</figcaption>{chart}<ul class="legend">{legend}</ul>{caption}</figure>'


def _passkey_grid(passkey: dict[str, Any]) -> str:
    """Accuracy by prompt length (rows) and depth (columns), each cell shaded by its value."""
    depths = passkey.get("depths") or []
    head = "<tr><th>length</th>" + "".join(f"<th>depth {escape(fmt(d))}</th>" for d in depths) + "<th>all</th></tr>"
    rows = []
    accuracy = passkey.get("accuracy") or []
    by_length = passkey.get("by_length") or {}
    for length, cells in zip(passkey.get("lengths") or [], accuracy):
        tds = "".join(
            f'<td style="background:rgba(44,160,44,{float(c):.2f})">{escape(_percent(c))}</td>' for c in cells
        )
        rows.append(f"<tr><th>{escape(fmt(length))}</th>{tds}<td>{escape(_percent(by_length.get(str(length))))}</td></tr>")
    trials = passkey.get("trials")
    return (
        f'<h3>Passkey retrieval</h3><p class="note">{escape(fmt(trials))} key(s) per cell; greedy decoding.</p>'
        f'<table class="incidents" id="passkey-grid"><thead>{head}</thead><tbody>{"".join(rows)}</tbody></table>'
    )


def _tokens(value: Any) -> str:
    """A token position as the buckets are named: 1024 -> 1K."""
    return short_count(int(value)) if is_number(value) else "?"


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
            f'<a href="#{incident_anchor(incident)}">{escape(fmt(d.get("id")))}</a>',
            f'<span class="kind" style="background:{kind_color(kind)}">{escape(kind)}</span>',
            escape(fmt(d.get("detected_at_step"))),
            escape(_ranks(d.get("ranks"))),
            escape(str(d.get("action", "-"))),
            escape(_secs(d.get("detect_s"))),
            escape(_secs(d.get("recover_s"))),
            escape(fmt(d.get("lost_steps"))),
            escape(f"{fmt(d.get('dp_before'))} -> {fmt(d.get('dp_after'))}"),
            escape(str(d.get("reason", ""))),
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
        ("detected at step", fmt(d.get("detected_at_step"))),
        ("detected at", _when(d.get("detected_at"))),
        ("action", str(d.get("action", "-"))),
        ("reason", str(d.get("reason", ""))),
    ]
    verdict = d.get("verdict")
    stack = ""
    if isinstance(verdict, dict):
        outcomes = verdict.get("outcomes")
        facts += [_outcome_fact(o) for o in outcomes if isinstance(o, dict)] if isinstance(outcomes, list) else []
        # A hang's diagnosis: under "hang" beside the outcomes, or the verdict itself (older runs).
        hang = verdict["hang"] if isinstance(verdict.get("hang"), dict) else verdict
        labels = {"culprit_rank": "culprit rank", "host": "host", "op": "op", "seq": "collective seq"}
        facts += [(label, fmt(hang[key])) for key, label in labels.items() if key in hang]
        shown_elsewhere = {*labels, "stack", "outcomes", "hang"}
        facts += [(f"verdict {k}", _plain(v)) for k, v in {**verdict, **hang}.items() if k not in shown_elsewhere]
        if isinstance(hang.get("stack"), str) and hang["stack"].strip():
            lines = hang["stack"].strip().splitlines()
            shown = f"its last {STACK_LINES} of {len(lines)} lines" if len(lines) > STACK_LINES else "whole"
            excerpt = "\n".join(lines[-STACK_LINES:])
            stack = f'<p>Stack ({shown}):</p><pre class="stack">{escape(excerpt)}</pre>'
    title = f"Incident {fmt(d.get('id'))}: {d.get('kind', '?')}"
    return f'<article class="incident" id="{incident_anchor(incident)}"><h3>{escape(title)}</h3>{_facts(facts)}{stack}</article>'


def _outcome_fact(outcome: dict[str, Any]) -> tuple[str, str]:
    """How one rank's step ended: ``rank 1: died (ActorDiedError), its node gone``."""
    text = str(outcome.get("outcome", "?"))
    if outcome.get("error"):
        text += f" ({outcome['error']})"
    if outcome.get("where"):
        text += f" in {outcome['where']}"
    if outcome.get("node_alive") is False:
        text += ", its node gone"
    return (f"rank {fmt(outcome.get('rank'))}", text)


def _plain(value: Any) -> str:
    """A verdict's other values as text a reader scans: mappings as ``key: value``, lists joined."""
    if isinstance(value, dict):
        return ", ".join(f"{k}: {_plain(v)}" for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return ", ".join(_plain(v) for v in value)
    return fmt(value)


def _config(run: RunFiles) -> str:
    if run.config_text is None:
        return '<section id="config"><h2>Resolved config</h2><p>config.yaml is missing.</p></section>'
    return (
        '<section id="config"><h2>Resolved config</h2><details><summary>config.yaml</summary>'
        f"<pre>{escape(run.config_text)}</pre></details></section>"
    )


def _facts(rows: list[tuple[str, str]]) -> str:
    body = "".join(f"<tr><th>{escape(k)}</th><td>{escape(v)}</td></tr>" for k, v in rows)
    return f'<table class="facts">{body}</table>'


def _points(records: list[dict[str, Any]], key: str) -> list[Point]:
    return [(float(r["step"]), float(r[key]) if is_number(r.get(key)) else None) for r in records]


def _ranked(records: list[dict[str, Any]], key: str, rank: int) -> list[Point]:
    """Rank ``rank``'s values; None at steps it was not part of the job (dp was smaller)."""
    points: list[Point] = []
    for r in records:
        values = r.get(key)
        value = values[rank] if isinstance(values, list) and rank < len(values) else None
        points.append((float(r["step"]), float(value) if is_number(value) else None))
    return points


def _mean(records: list[dict[str, Any]], key: str) -> Optional[float]:
    values = [r[key] for r in records if is_number(r.get(key)) and math.isfinite(r[key])]
    return statistics.fmean(values) if values else None


def _ranks(value: Any) -> str:
    return ", ".join(str(r) for r in value) if isinstance(value, (list, tuple)) else fmt(value)


def _count(value: Any) -> str:
    """A count in full, with thousands separators: 834,176."""
    return f"{int(value):,}" if is_number(value) and math.isfinite(value) else "-"


def _secs(value: Any) -> str:
    return f"{value:.3g} s" if is_number(value) and math.isfinite(value) else "-"


def _percent(value: Any) -> str:
    return f"{value:.1%}" if is_number(value) and math.isfinite(value) else "-"


def _when(value: Any) -> str:
    if not is_number(value) or not math.isfinite(value):
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(value))


# The page's sections in order, by the title a warning names them with.
SECTIONS: tuple[tuple[str, Callable[[RunFiles], str]], ...] = (
    ("overview", _overview),
    ("charts", _charts),
    ("evaluation", _evaluation),
    ("incidents", _incidents),
    ("resolved config", _config),
)

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
