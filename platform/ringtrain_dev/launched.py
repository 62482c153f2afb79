"""A bench's run launched in a session of its own, its output to a log, and every process it
started found and killed by PID (never by name).

Each process of the run inherits ``RINGTRAIN_BENCH_TMP`` (the run's temp folder): that finds
them all, torchrun's ranks and Ray's workers included, which start sessions of their own.
Everything launched shares the repo's TORCH_EXTENSIONS_DIR (or $RINGTRAIN_BENCH_EXTENSIONS_DIR),
so DeepSpeed builds its CPU comm op once rather than in every new process.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import psutil

from ringtrain_dev.ray_head import REPO, TORCH_EXTENSIONS_DIR

MARKER = "RINGTRAIN_BENCH_TMP"


def launch(cmd: list[str], tmp: Path, extra_env: dict[str, str], cwd: Path) -> subprocess.Popen[bytes]:
    """``cmd`` started in a new session, its output in ``tmp``/out.log."""
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    env.update(
        extra_env,
        TORCH_EXTENSIONS_DIR=os.environ.get("RINGTRAIN_BENCH_EXTENSIONS_DIR", str(TORCH_EXTENSIONS_DIR)),
        PYTHONPATH=os.pathsep.join([str(REPO / "platform"), env.get("PYTHONPATH", "")]),
        **{MARKER: str(tmp)},  # every process of the run inherits it: how stop() finds them
    )
    with open(tmp / "out.log", "wb") as log:
        return subprocess.Popen(cmd, env=env, cwd=cwd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def ours(tmp: Path) -> set[int]:
    """Pids of the live processes started for the run whose temp dir is ``tmp``."""
    found = set()
    for proc in psutil.process_iter():
        try:
            if proc.environ().get(MARKER) == str(tmp):
                found.add(proc.pid)
        except (psutil.Error, OSError):
            continue
    return found


def stop(proc: subprocess.Popen[bytes], tmp: Path) -> None:
    """SIGKILL the run's session and every process carrying its marker (torchrun's ranks and
    Ray's workers start sessions of their own), by pid."""
    for _ in range(3):
        for kill, pid in [(os.killpg, proc.pid), *((os.kill, p) for p in ours(tmp))]:
            try:
                kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait(timeout=30)
        time.sleep(0.2)
        if not ours(tmp):
            return


def log_tail(tmp: Path, num_chars: int = 2000) -> str:
    return (tmp / "out.log").read_text(errors="replace")[-num_chars:] if (tmp / "out.log").exists() else ""


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The complete JSON lines of a file another process appends to."""
    out = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a line still being written
            continue
    return out
