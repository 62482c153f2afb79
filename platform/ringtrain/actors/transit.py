"""The snapshot transit window: from a step's reports to its snapshot being readable at a holder.

A kill that lands inside this window finds the dead rank's newest snapshot nowhere off its
process, so the recovery either rebuilds that shard from a replica (ZeRO-0) or trains the step
again; the step's record is written only after the window (``actors.safekeeping``), so what
such a kill costs is a step never recorded. The holders timestamp every put
(``SnapshotHolder.arrivals``); the step records carry the wall time their reports were all in
(``reported_at``); this module pairs them. Wall clocks of one machine, or of nodes kept in
sync: a negative window means the snapshot was safe before the last report came in.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Sequence

_MAX_LISTED = 512
Arrival = tuple[int, int, str, float]  # rank, step, role (node | buddy), wall time


def gather_arrivals(holders: Iterable[Any], timeout_s: float = 5.0) -> list[Arrival]:
    """Every live holder's arrivals (a dead or slow holder contributes none)."""
    import ray

    out: list[Arrival] = []
    for holder in holders:
        try:
            out += [tuple(a) for a in ray.get(holder.arrivals.remote(), timeout=timeout_s)]  # type: ignore[misc]
        except Exception:
            continue
    return out


def _quantile(sorted_ms: Sequence[float], q: float) -> float:
    i = min(len(sorted_ms) - 1, max(0, round(q * (len(sorted_ms) - 1))))
    return sorted_ms[i]


def transit_window(records: Sequence[Mapping[str, Any]], arrivals: Iterable[Arrival]) -> dict[str, Any]:
    """Per role: the distribution (ms) of arrival time minus the time the step's reports were
    in, over every (rank, step) whose step was recorded; the newest record of a redone step
    counts."""
    recorded = {int(r["step"]): float(r.get("reported_at", r["time"])) for r in records if "time" in r}
    by_role: dict[str, list[float]] = {}
    for _rank, step, role, t in arrivals:
        if step in recorded:
            by_role.setdefault(role, []).append((t - recorded[step]) * 1000.0)
    out: dict[str, Any] = {}
    for role, values in sorted(by_role.items()):
        ms = sorted(values)
        out[role] = {
            "count": len(ms),
            "p50_ms": _quantile(ms, 0.5),
            "p90_ms": _quantile(ms, 0.9),
            "max_ms": ms[-1],
            "min_ms": ms[0],
            "after_reports": sum(1 for v in ms if v > 0),
            "ms": [round(v, 2) for v in values[-_MAX_LISTED:]],  # the newest, for pooling across runs
        }
    return out
