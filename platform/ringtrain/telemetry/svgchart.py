"""Inline SVG line charts of per-step series, with a marker per incident: no script, no
network, so a page that holds them opens from disk anywhere."""

from __future__ import annotations

import html
import math
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from ringtrain.incidents import Kind
from ringtrain.telemetry.runfiles import IncidentFile, incident_anchor, is_number

# Points per series drawn: beyond this a series is thinned to each bucket's min and max, so
# a long run's page stays small and a one-step spike (a straggler) still shows.
MAX_POINTS = 1500
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf")
KIND_COLORS = {
    Kind.CRASH.value: "#d62728",
    Kind.NODE_LOST.value: "#8b0000",
    Kind.HANG.value: "#ff7f0e",
    Kind.ERROR.value: "#bcbd22",
    Kind.SDC.value: "#9467bd",
    Kind.NAN.value: "#e377c2",
    Kind.STRAGGLER.value: "#8c564b",
}
# Chart geometry, in SVG user units (the SVG scales to the page's width).
WIDTH, HEIGHT, LEFT, RIGHT, TOP, BOTTOM = 640, 240, 60, 14, 14, 34

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
    finite = [y for s in series for y in drawn(s.points)]
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
        out.append(f'<text class="ytick" x="{LEFT - 4}" y="{py(tick) + 3}">{escape(fmt(tick))}</text>')
    tick_labels = dict(xticks) if xticks is not None else {tick: fmt(tick) for tick in _ticks(x0, x1, integer=True)}
    for tick, text in tick_labels.items():
        out.append(f'<text class="xtick" x="{px(tick)}" y="{bottom + 14}">{escape(text)}</text>')
    out.append(f'<text class="xlabel" x="{LEFT + plot_w / 2}" y="{HEIGHT - 4}">{escape(xlabel)}</text>')
    for incident, step in markers:
        x, color = px(step), kind_color(incident.data.get("kind"))
        tip = f"incident {fmt(incident.data.get('id'))}: {incident.data.get('kind', '?')} at step {fmt(step)}"
        out.append(
            f'<a href="#{incident_anchor(incident)}" class="marker"><title>{escape(tip)}</title>'
            f'<line x1="{x}" x2="{x}" y1="{TOP}" y2="{bottom}" stroke="{color}"/>'
            f'<path d="M{x - 5},{TOP} L{x + 5},{TOP} L{x},{TOP + 8} Z" fill="{color}"/></a>'
        )
    for index, s in enumerate(series):
        color = series_color(index, s)
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
            where = f"{escape(s.label)} at {escape(xlabel)} {escape(tick_labels.get(x, fmt(x)))}"
            if not math.isfinite(y):
                mark = f'<text class="nonfinite" x="{px(x)}" y="{TOP + 12}">'
                out.append(f"{mark}<title>{where}: {y}</title>&#215;</text>")
            elif show_dots or x in alone:
                dot = f'<circle cx="{px(x)}" cy="{py(y)}" r="2.5" fill="{color}">'
                out.append(f"{dot}<title>{where}: {escape(fmt(y))}</title></circle>")
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


def drawn(points: Sequence[Point]) -> list[float]:
    return [y for _, y in points if y is not None and math.isfinite(y)]


def series_color(index: int, series: Series) -> str:
    return "#222222" if series.dashed else PALETTE[index % len(PALETTE)]


def kind_color(kind: Any) -> str:
    return KIND_COLORS.get(str(kind), "#555555")


def fmt(value: Any) -> str:
    """Numbers short and readable (1.23k, 4.5M); other values as text; None as a dash."""
    if value is None:
        return "-"
    if not is_number(value):
        return str(value)
    if not math.isfinite(value):
        return str(value)
    if float(value).is_integer() and abs(value) < 1e6:
        return str(int(value))
    for scale, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= scale:
            return f"{value / scale:.3g}{suffix}"
    return f"{value:.4g}"


def escape(text: str) -> str:
    return html.escape(text, quote=True)
