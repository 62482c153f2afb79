"""Interleaved on/off blocks: their order, the paired ratio with its confidence interval, and
how busy the rest of the machine was meanwhile.

On a shared machine the load of other work drifts and bursts. Blocks of steps with a feature on
alternate with blocks with it off; two neighbouring blocks (one of each) share the machine's
state of the moment, so the ratio of their means cancels slow drift. The estimate is the mean
of the pairs' log ratios, with a Student-t 95% interval over pairs: it says how much of the
reported ratio the noise could account for.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from pathlib import Path
from typing import Any, Optional, Sequence


def schedule(num_blocks: int) -> list[bool]:
    """on, off, off, on, on, off, ...: both modes see the same mean position in the run, so a
    linear drift (caches, allocator, thermal) weighs on both alike."""
    return [b % 4 in (0, 3) for b in range(num_blocks)]


def t_quantile(p: float, df: int) -> float:
    """Student-t quantile by the Cornish-Fisher expansion around the normal one (Abramowitz &
    Stegun 26.7.5): within 0.2% of the exact value for df >= 3, 11% low at df = 1."""
    z = statistics.NormalDist().inv_cdf(p)
    g1 = (z**3 + z) / 4
    g2 = (5 * z**5 + 16 * z**3 + 3 * z) / 96
    g3 = (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / 384
    g4 = (79 * z**9 + 776 * z**7 + 1482 * z**5 - 1920 * z**3 - 945 * z) / 92160
    return z + g1 / df + g2 / df**2 + g3 / df**3 + g4 / df**4


def paired_ratio(blocks: Sequence[tuple[bool, float]]) -> dict[str, Any]:
    """``blocks``: (on, mean step time) in run order. Pairs neighbouring blocks (0-1, 2-3, ...)
    and returns the on/off ratio as the exponential of the mean log ratio, its 95% interval,
    the median pair ratio (robust to a burst), and every pair's ratio."""
    logs = [math.log(a / b) if a_on else math.log(b / a)
            for (a_on, a), (b_on, b) in zip(blocks[0::2], blocks[1::2]) if a_on != b_on]
    out: dict[str, Any] = {"num_pairs": len(logs), "pair_ratios": [math.exp(x) for x in logs]}
    if not logs:
        return {**out, "ratio": None, "ci95": None, "half_width": None, "median": None}
    mean = statistics.fmean(logs)
    half = t_quantile(0.975, len(logs) - 1) * statistics.stdev(logs) / math.sqrt(len(logs)) if len(logs) > 1 else math.inf
    return {**out, "ratio": math.exp(mean), "ci95": [math.exp(mean - half), math.exp(mean + half)],
            # the interval's half-width as a fraction of the step: the smallest effect it resolves
            "half_width": math.exp(half) - 1, "median": statistics.median(out["pair_ratios"]),
            "stdev_log": statistics.stdev(logs) if len(logs) > 1 else None}


def block_means(rows: Sequence[dict[str, Any]], key: str = "wall_s") -> list[tuple[bool, float]]:
    """(on, mean of ``key``) per block, in block order; rows carry "block" and "on"."""
    blocks: dict[int, tuple[bool, list[float]]] = {}
    for row in rows:
        blocks.setdefault(row["block"], (row["on"], []))[1].append(row[key])
    return [(on, statistics.fmean(values)) for _, (on, values) in sorted(blocks.items())]


def machine_busy_s() -> Optional[float]:
    """CPU seconds every process on this machine has used since boot (Linux), or None."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    except OSError:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def own_cpu_s() -> float:
    """CPU seconds of this process and everything it started: live descendants (and what they
    reaped) through psutil, the exited children this process reaped through os.times."""
    import psutil

    t = os.times()
    total = t.user + t.system + t.children_user + t.children_system
    for child in psutil.Process().children(recursive=True):
        try:
            c = child.cpu_times()
            total += c.user + c.system + c.children_user + c.children_system
        except psutil.Error:  # exited meanwhile: its parent's count will have it
            pass
    return total


class OutsideLoad:
    """The share of the machine's CPUs that processes this bench did not start used between
    ``start()`` and ``stop()``."""

    def start(self) -> None:
        self._busy, self._ours, self._wall = machine_busy_s(), own_cpu_s(), time.perf_counter()

    def stop(self) -> dict[str, Any]:
        busy, ours, wall = machine_busy_s(), own_cpu_s(), time.perf_counter()
        fraction = None
        if busy is not None and self._busy is not None:
            used = (busy - self._busy) - (ours - self._ours)
            fraction = max(0.0, used) / ((wall - self._wall) * (os.cpu_count() or 1))
        return {"outside_cpu_fraction": fraction, "num_cpus": os.cpu_count()}
