"""`ringtrain plan --goodput`'s study: the job's goodput over seeds and over the settings that
move it (warm spares, snapshot and persist cadence), as text, a JSON-ready dict and an SVG.

Strings and dicts only: printing and writing files are the command's.
"""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass
from typing import Any, Callable, Optional

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


# Told after each simulated run: (runs done, runs in the study).
OnRun = Callable[[int, int], None]


def study(
    job: Job,
    profile: FailureProfile,
    costs: Costs,
    *,
    mode: str,
    days: float,
    seeds: int,
    decider: Optional[Decider],
    on_run: Optional[OnRun] = None,
) -> Study:
    """The job as given, and every swept setting, each over the same ``seeds`` failure timelines;
    ``on_run`` hears of each run as it ends (a long study's progress)."""
    swept_settings = settings(job, mode)
    total = (1 + len(swept_settings)) * seeds
    done = 0

    def runs(j: Job) -> tuple[Outcome, ...]:
        nonlocal done
        outcomes = []
        for seed in range(seeds):
            outcomes.append(simulate(j, profile, costs, mode=mode, days=days, seed=seed, decider=decider))
            done += 1
            if on_run is not None:
                on_run(done, total)
        return tuple(outcomes)

    given = Result(Setting(job.spares, job.snapshot_every, job.persist_every_s), runs(job))
    swept = [Result(s, runs(s.applied(job))) for s in swept_settings]
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


def persist_steps(s: Setting, step_s: float) -> int:
    """``checkpoint.persist_every`` (steps) for the setting's seconds between durable
    checkpoints: to two significant figures past 100 steps, then a whole multiple of its
    ``snapshot_every`` (a durable checkpoint copies a snapshot, and the job's check asks it)."""
    steps = max(1, round(s.persist_every_s / step_s))
    if steps >= 100:
        steps = int(float(f"{steps:.2g}"))
    every = max(1, s.snapshot_every)
    return max(1, round(steps / every)) * every


def duration(seconds: float) -> str:
    """A time as a person says it: 40 ms, 25 s, 12 min, 1.5 h, 3.2 days."""
    for unit, size in (("days", 86400.0), ("h", 3600.0), ("min", 60.0), ("s", 1.0)):
        if seconds >= 0.95 * size:  # 59.9 min is said as 1 h
            return f"{seconds / size:.2g} {unit}" if seconds < 10 * size else f"{seconds / size:.0f} {unit}"
    return f"{seconds * 1000:.2g} ms" if seconds >= 1e-3 else f"{seconds * 1e6:.2g} us"


def config_keys(s: Setting, step_s: float, mode: str) -> list[str]:
    """The job's keys that make the setting: what a ``ringtrain run`` line adds (restart mode
    sweeps the durable cadence alone)."""
    persist = f"checkpoint.persist_every={persist_steps(s, step_s)}"
    if mode == "restart":
        return [persist]
    return [f"mesh.spares={s.spares}", f"checkpoint.snapshot_every={s.snapshot_every}", persist]


def _setting(s: Setting, j: Job, mode: str) -> str:
    """The setting in the job's keys, each with its unit (restart mode: its durable cadence)."""
    every = persist_steps(s, j.step_s)
    persist = f"checkpoint.persist_every={every} (steps: a durable checkpoint every {duration(every * j.step_s)})"
    if mode == "restart":
        return persist
    nodes = s.spares / j.gpus_per_node
    spares = f"{s.spares} warm spare GPUs" + (f", {nodes:g} nodes" if nodes == int(nodes) else "") if s.spares else "no warm spare"
    return f"mesh.spares={s.spares} ({spares}), checkpoint.snapshot_every={s.snapshot_every} (steps), {persist}"


def text(s: Study, name: str, step_from: str, replays: Optional[int], run: str) -> str:
    """The study for a person; ``run`` is the ``ringtrain run`` line of the layout simulated, to
    which the best setting's keys are added."""
    j, g = s.job, s.given
    expected = s.days * 24 / s.profile.mtbf_h(j.gpus)
    lines = [
        f"goodput: {name} on {j.gpus:,} GPUs (dp {j.dp} x {j.gpus_per_replica} GPUs a replica), "
        f"a step of {duration(j.step_s)} ({step_from}), {s.days:g} days, {s.seeds} failure timelines (--seeds)",
        f"failures: {s.profile.name}, one every {duration(3600 * s.profile.mtbf_h(j.gpus))} on these GPUs "
        f"({expected:.1f} in {s.days:g} days): {s.profile.source}",
        f"recovery: {s.mode}"
        + (f" (each failure handled as ringtrain's Controller decides, e.g. a warm spare takes the seat or the job "
           f"shrinks; {replays} distinct cases decided)" if replays is not None else
           " (every failure restarts the job from its last durable checkpoint)"),
        "costs (" + s.costs.source + "): " + ", ".join(
            f"{f.name} {getattr(s.costs, f.name):g}" for f in dataclasses.fields(Costs) if f.name != "source"
        ),
        "",
        _headline("as given", g),
        "  " + _setting(g.setting, j, s.mode),
        _headline("best setting", s.best),
        "  " + _setting(s.best.setting, j, s.mode),
        "",
        "GPU-hours lost per run, as given:  " + _lost(g),
        "GPU-hours lost per run, at best:   " + _lost(s.best),
        "failures per run:  " + ", ".join(f"{k} {v:.1f}" for k, v in g.counts("failures").items()),
        "recoveries per run:  " + (", ".join(f"{k} {v:.1f}" for k, v in g.counts("actions").items()) or "none"),
        "",
        f"{'mesh.spares':>11} {'snapshot_every':>14} {'persist_every (time)':>22} {'ETTR':>8} {'goodput':>8}",
    ]  # fmt: skip
    for r in s.swept[:10]:
        st = r.setting
        every = persist_steps(st, j.step_s)
        persist = f"{every} ({duration(every * j.step_s)})"
        lines.append(f"{st.spares:>11} {st.snapshot_every:>14} {persist:>22} {_pct(r.ettr):>8} {_pct(r.goodput):>8}")
    lines += ["", f"run: {run} {' '.join(config_keys(s.best.setting, j.step_s, s.mode))}"]
    return "\n".join(lines)


def _lost(r: Result) -> str:
    """Where the GPU-hours went, most first."""
    lost = sorted(r.lost_gpu_hours().items(), key=lambda item: -item[1])
    return ", ".join(f"{cause} {hours:,.0f}" for cause, hours in lost if hours >= 0.5) or "none"


def _headline(label: str, r: Result) -> str:
    ettrs = [o.ettr for o in r.runs]
    return (
        f"{label + ':':14} ETTR {_pct(r.ettr)} ({_pct(min(ettrs))} - {_pct(max(ettrs))} over seeds), goodput "
        f"{_pct(r.goodput)}"
    )


def record(s: Study, name: str, step_from: str, replays: Optional[int], run: str) -> dict[str, Any]:
    """The study as JSON-ready data: every figure unrounded, and each setting's job keys as a
    person sets them (``config``) beside the best one's ``run`` line."""

    def result(r: Result) -> dict[str, Any]:
        ettrs = [o.ettr for o in r.runs]
        keys = config_keys(r.setting, s.job.step_s, s.mode)
        return {
            **r.setting.to_dict(),
            "config": {key: int(value) for key, value in (k.split("=") for k in keys)},
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
        "run": f"{run} {' '.join(config_keys(s.best.setting, s.job.step_s, s.mode))}",
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
