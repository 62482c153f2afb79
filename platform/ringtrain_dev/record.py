"""What a benchmark ran on, and the one writer of its JSON under bench/results/.

A number without the code and machine behind it cannot be compared with the next one, so every
bench script starts a ``Run`` before it measures (the commit is read then: the code that ran)
and ends with ``Run.write``, which puts the provenance at the top of the JSON:

    bench, git {commit, dirty, dirty_paths}, started_utc, timestamp (UTC, when written),
    wall_s, device, device_type, torch, python, machine {os, cpu, num_cpus, memory_gb, ...}

``dirty_paths`` lists the tracked files that differed from the commit (results excluded: they
are outputs), so a reader can judge whether a change under way could have moved the numbers.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import time
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parents[2]
RESULTS_DIR = ROOT / "bench" / "results"
_OUTPUTS = "bench/results/"


def utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def _git(*args: str) -> Optional[str]:
    try:
        done = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def git_state() -> dict[str, Any]:
    """The commit checked out and the tracked files that differ from it (None outside git)."""
    commit = _git("rev-parse", "HEAD")
    status = _git("status", "--porcelain", "--untracked-files=no")
    if commit is None or status is None:
        return {"commit": None, "dirty": None, "dirty_paths": []}
    paths = [line[3:] for line in status.splitlines() if line[3:] and not line[3:].startswith(_OUTPUTS)]
    return {"commit": commit.strip(), "dirty": bool(paths), "dirty_paths": paths}


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_gb() -> Optional[float]:
    try:
        return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError):
        return None


def machine() -> dict[str, Any]:
    return {"os": platform.platform(), "hostname": platform.node(), "cpu": _cpu_model(),
            "num_cpus": os.cpu_count(), "memory_gb": _memory_gb()}


def device(device_type: str) -> dict[str, Any]:
    """The accelerator the numbers belong to, and the torch build that drove it."""
    import torch

    out: dict[str, Any] = {"device_type": device_type, "torch": torch.__version__, "python": platform.python_version()}
    if device_type == "cuda":
        out["device"] = torch.cuda.get_device_name(0)
        out["cuda"] = torch.version.cuda
        out["num_devices"] = torch.cuda.device_count()
    else:
        out["device"] = f"cpu {_cpu_model()}"
    return out


class Run:
    """One run of one benchmark: its provenance, taken when it starts, and its writer."""

    def __init__(self, bench: str) -> None:
        self.bench = bench
        self.git = git_state()
        self.started_utc = utc_now()
        self._t0 = time.perf_counter()

    def header(self, device_type: str) -> dict[str, Any]:
        return {"bench": self.bench, "git": self.git, "started_utc": self.started_utc, "timestamp": utc_now(),
                "wall_s": round(time.perf_counter() - self._t0, 1), **device(device_type), "machine": machine()}

    def write(self, results: dict[str, Any], *, device_type: str, out: Optional[Path] = None) -> Path:
        """Write the provenance followed by ``results`` to ``out`` (default:
        bench/results/<bench>-<device_type>.json); returns the path."""
        path = out or RESULTS_DIR / f"{self.bench}-{device_type}.json"
        record = {**self.header(device_type), **results}
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(record, indent=2) + "\n")
        shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
        dirty = " (tree dirty: " + ", ".join(self.git["dirty_paths"]) + ")" if self.git["dirty"] else ""
        print(f"wrote {shown} at commit {(self.git['commit'] or 'unknown')[:12]}{dirty}")
        return path
