"""`ringtrain plan --goodput`'s study: the job's goodput over seeds and over the settings that
move it (warm spares, snapshot and persist cadence), as text, a JSON-ready dict and an SVG.

Strings and dicts only: printing and writing files are the command's.
"""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass
from typing import Any, Optional

from ringtrain.planner.failures import FailureProfile
from ringtrain.planner.goodput import CAUSES, Costs, Decider, Job, Outcome, simulate

# The settings swept. ringtrain: warm spares in nodes' worth of GPUs and steps between
# in-memory snapshots (its durable checkpoints are written off the critical path, and only a
# loss of every in-memory copy would go back to one). restart: hours between the blocking
# durable checkpoints it restarts from.
SPARE_NODES = (0, 1, 2, 4, 8)
SNAPSHOT_EVERY = (1, 2, 4, 8, 16)
PERSIST_EVERY_H = (0.1, 0.25, 0.5, 1.0, 2.0)


@dataclass(frozen=True)
class Setting:
    spares: int
    snapshot_every: int
    persist_every_s: float

    def applied(self, job: Job) -> Job:
        return dataclasses.replace(
            job, spares=self.spares, snapshot_every=self.snapshot_every, persist_every_s=self.persist_every_s
        )

    def to_dict(self) -> dict[str, Any]:
        return {"spares": self.spares, "snapshot_every": self.snapshot_every, "persist_every_h": self.persist_every_s / 3600}


@dataclass(frozen=True)
class Result:
    """A setting's runs, one per seed."""

    setting: Setting
    runs: tuple[Outcome, ...]

    @property
    def ettr(self) -> float:
        return statistics.fmean(r.ettr for r in self.runs)

    @property
    def goodput(self) -> float:
        return statistics.fmean(r.goodput for r in self.runs)

    def lost_gpu_hours(self) -> dict[str, float]:
        """Mean GPU-hours lost per run, by cause."""
        return {c: statistics.fmean(r.lost_gpu_hours()[c] for r in self.runs) for c in CAUSES}

    def counts(self, name: str) -> dict[str, float]:
        """Mean failures by kind (``name="failures"``) or recoveries by action, per run."""
        keys = sorted({k for r in self.runs for k in getattr(r, name)})
        return {k: statistics.fmean(getattr(r, name).get(k, 0) for r in self.runs) for k in keys}


@dataclass(frozen=True)
class Study:
    job: Job
    profile: FailureProfile
    costs: Costs
    mode: str
    days: float
    seeds: int
    given: Result  # the job's own settings
    swept: tuple[Result, ...]  # best goodput first

    @property
    def best(self) -> Result:
        return self.swept[0] if self.swept else self.given


def study(
    job: Job, profile: FailureProfile, costs: Costs, *, mode: str, days: float, seeds: int, decider: Optional[Decider]
) -> Study:
    """The job as given, and every swept setting, each over the same ``seeds`` failure timelines."""

    def runs(j: Job) -> tuple[Outcome, ...]:
        return tuple(simulate(j, profile, costs, mode=mode, days=days, seed=s, decider=decider) for s in range(seeds))

    given = Result(Setting(job.spares, job.snapshot_every, job.persist_every_s), runs(job))
    swept = [Result(s, runs(s.applied(job))) for s in settings(job, mode)]
    swept.sort(key=lambda r: -r.goodput)
    return Study(job, profile, costs, mode, days, seeds, given, tuple(swept))


def settings(job: Job, mode: str) -> list[Setting]:
    """What the sweep tries, each setting that matters in ``mode``."""
    if mode == "restart":
        return [Setting(0, job.snapshot_every, h * 3600) for h in PERSIST_EVERY_H]
    return [Setting(n * job.gpus_per_node, every, job.persist_every_s) for n in SPARE_NODES for every in SNAPSHOT_EVERY]


def cadence(s: Setting, mode: str) -> float:
    """The cadence that matters in ``mode``: hours between saves, or steps between snapshots."""
    return s.persist_every_s / 3600 if mode == "restart" else float(s.snapshot_every)


# --- rendering -------------------------------------------------------------------------------


def _pct(x: float) -> str:
    return f"{100 * x:.2f}%"


def text(s: Study, name: str, step_from: str, replays: Optional[int]) -> str:
    j, g = s.job, s.given
    expected = s.days * 24 / s.profile.mtbf_h(j.gpus)
    lines = [
        f"goodput: {name} on {j.gpus:,} GPUs (dp {j.dp} x {j.gpus_per_replica} GPUs a replica), "
        f"step {j.step_s:.3g} s ({step_from}), {s.days:g} days, {s.seeds} seeds",
        f"failures: {s.profile.name}, one every {s.profile.mtbf_h(j.gpus):.2f} h on these GPUs "
        f"({expected:.1f} in {s.days:g} days): {s.profile.source}",
        f"recovery: {s.mode}"
        + (f" (the Controller's own decisions, {replays} replayed on a simulated cluster)" if replays is not None else
           " (every failure restarts the job from its last durable checkpoint)"),
        "costs (" + s.costs.source + "): " + ", ".join(
            f"{f.name} {getattr(s.costs, f.name):g}" for f in dataclasses.fields(Costs) if f.name != "source"
        ),
        "",
        _headline("as given", g),
        _headline("best setting", s.best),
        "",
        "GPU-hours lost per run, as given:  " + _lost(g),
        "GPU-hours lost per run, at best:   " + _lost(s.best),
        "failures per run:  " + ", ".join(f"{k} {v:.1f}" for k, v in g.counts("failures").items()),
        "recoveries per run:  " + ", ".join(f"{k} {v:.1f}" for k, v in g.counts("actions").items()),
        "",
        f"{'spares':>7} {'snapshot_every':>15} {'persist_every':>14} {'ETTR':>8} {'goodput':>8}",
    ]  # fmt: skip
    for r in s.swept[:10]:
        st = r.setting
        lines.append(
            f"{st.spares:>7} {st.snapshot_every:>15} {st.persist_every_s / 3600:>12g} h {_pct(r.ettr):>8} {_pct(r.goodput):>8}"
        )
    return "\n".join(lines)


def _lost(r: Result) -> str:
    """Where the GPU-hours went, most first."""
    lost = sorted(r.lost_gpu_hours().items(), key=lambda item: -item[1])
    return ", ".join(f"{cause} {hours:,.0f}" for cause, hours in lost if hours >= 0.5) or "none"


def _headline(label: str, r: Result) -> str:
    ettrs = [o.ettr for o in r.runs]
    st = r.setting
    return (
        f"{label + ':':14} ETTR {_pct(r.ettr)} ({_pct(min(ettrs))} - {_pct(max(ettrs))} over seeds), goodput "
        f"{_pct(r.goodput)}  [spares {st.spares}, snapshot_every {st.snapshot_every}, persist_every "
        f"{st.persist_every_s / 3600:g} h]"
    )


def record(s: Study, name: str, step_from: str, replays: Optional[int]) -> dict[str, Any]:
    def result(r: Result) -> dict[str, Any]:
        ettrs = [o.ettr for o in r.runs]
        return {
            **r.setting.to_dict(),
            "ettr": r.ettr,
            "ettr_min": min(ettrs),
            "ettr_max": max(ettrs),
            "goodput": r.goodput,
            "lost_gpu_hours": r.lost_gpu_hours(),
            "failures": r.counts("failures"),
            "recoveries": r.counts("actions"),
        }

    g = s.given
    return {
        "job": name,
        **dataclasses.asdict(s.job),
        "gpus": s.job.gpus,
        "step_from": step_from,
        "mode": s.mode,
        "days": s.days,
        "seeds": s.seeds,
        "failures_profile": {"name": s.profile.name, "source": s.profile.source, "per_gpu_hour": s.profile.per_gpu_hour},
        "costs": dataclasses.asdict(s.costs),
        "controller_replays": replays,
        "ettr": g.ettr,
        "goodput": g.goodput,
        "given": result(g),
        "best": result(s.best),
        "swept": [result(r) for r in s.swept],
    }


def chart(s: Study) -> str:
    """An SVG of goodput against the cadence that matters (restart: hours between durable
    checkpoints; ringtrain: steps between snapshots), a line per warm spares count."""
    width, height, left, right, top, bottom = 640, 300, 64, 150, 20, 44
    lines: dict[int, list[tuple[float, float]]] = {}
    for r in sorted(s.swept, key=lambda r: (r.setting.spares, cadence(r.setting, s.mode))):
        lines.setdefault(r.setting.spares, []).append((cadence(r.setting, s.mode), 100 * r.goodput))
    unit, axis = ("h", "persist every (hours)") if s.mode == "restart" else ("", "snapshot every (steps)")
    xs = [x for pts in lines.values() for x, _ in pts]
    ys = [y for pts in lines.values() for _, y in pts]
    x0, x1 = min(xs), max(xs) if max(xs) > min(xs) else min(xs) + 1
    y0, y1 = min(ys) - 0.2, max(ys) + 0.2
    pw, ph = width - left - right, height - top - bottom

    def px(x: float) -> float:
        return round(left + (x - x0) / (x1 - x0) * pw, 1)

    def py(y: float) -> float:
        return round(top + (y1 - y) / (y1 - y0) * ph, 1)

    colors = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b")
    out = [
        f'<svg viewBox="0 0 {width} {height}" xmlns="http://www.w3.org/2000/svg" font-family="sans-serif" font-size="11">',
        f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="#fcfcfc" stroke="#ccc"/>',
    ]
    for i in range(5):
        y = y0 + (y1 - y0) * i / 4
        out.append(f'<text x="{left - 6}" y="{py(y) + 4}" text-anchor="end" fill="#555">{y:.1f}%</text>')
    for x in sorted(set(xs)):
        out.append(f'<text x="{px(x)}" y="{top + ph + 16}" text-anchor="middle" fill="#555">{x:g}{unit}</text>')
    out.append(f'<text x="{left + pw / 2}" y="{height - 8}" text-anchor="middle" fill="#333">{axis}</text>')
    out.append(f'<text x="14" y="{top + ph / 2}" transform="rotate(-90 14 {top + ph / 2})" text-anchor="middle" fill="#333">goodput ({s.mode})</text>')
    for i, (spares, pts) in enumerate(lines.items()):
        color = colors[i % len(colors)]
        path = " ".join(f"{px(x)},{py(y)}" for x, y in pts)
        out.append(f'<polyline points="{path}" fill="none" stroke="{color}" stroke-width="1.8"/>')
        ly = top + 14 + 16 * i
        out.append(f'<line x1="{left + pw + 12}" y1="{ly - 4}" x2="{left + pw + 32}" y2="{ly - 4}" stroke="{color}" stroke-width="3"/>')
        out.append(f'<text x="{left + pw + 38}" y="{ly}" fill="#333">{spares} warm spares</text>')
    out.append("</svg>")
    return "\n".join(out)
