"""``ringtrain`` run as a user runs it: a command to its end (``ringtrain_cli``), or a `ringtrain
run` in the background stopped by a signal mid-run, as `ray job stop`, Kubernetes or Ctrl-C stop
one (``Background``): shared by the Ray tier's tests and bench/stop.py.

Each run gets its own HOME and Ray temp dir (its processes are then recognisable by their
command lines); a background run's output goes to files, since a pipe nobody reads while the
test waits would fill up and stall the run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

from ringtrain_dev.ray_head import REPO, TORCH_EXTENSIONS_DIR

QUICKSTART = REPO / "jobs" / "quickstart.yaml"


def run_env(home: Path, ray_tmp: Path) -> dict[str, str]:
    """The environment of a run of this checkout's ringtrain on an embedded cluster of its own
    (token authentication off: nothing but the run joins it)."""
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    env.update(
        HOME=str(home),
        RAY_TMPDIR=str(ray_tmp),
        RAY_AUTH_MODE="disabled",
        TORCH_EXTENSIONS_DIR=str(TORCH_EXTENSIONS_DIR),
        PYTHONPATH=os.pathsep.join([str(REPO / "platform"), env.get("PYTHONPATH", "")]),
    )
    return env


def ringtrain_cli(argv: list[str], *, home: Path, ray_tmp: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """``ringtrain ARGV`` to its end, with its own HOME and Ray temp dir; its output captured."""
    return subprocess.run(
        [sys.executable, "-m", "ringtrain", *argv], env=run_env(home, ray_tmp), capture_output=True, text=True,
        timeout=timeout, cwd=home,
    )  # fmt: skip


def run_cli(args: list[str], *, home: Path, ray_tmp: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """``ringtrain run ARGS`` as a user would start it, with its own HOME and Ray temp dir."""
    return ringtrain_cli(["run", *args], home=home, ray_tmp=ray_tmp, timeout=timeout)


def records(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    # Lines are flushed whole (RunDir), so every line read is a complete record.
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


class Background:
    """``ringtrain run ARGS`` running in the background; ``logs`` holds its stdout and stderr."""

    def __init__(self, args: list[str], *, home: Path, ray_tmp: Path, logs: Path) -> None:
        logs.mkdir(parents=True, exist_ok=True)
        self.logs = logs
        with open(logs / "stdout", "w") as out, open(logs / "stderr", "w") as err:
            # A process group of its own, as a shell's job has: a signal can go to the whole group.
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "ringtrain", "run", *args],
                env=run_env(home, ray_tmp), cwd=home, stdout=out, stderr=err, start_new_session=True,
            )  # fmt: skip

    @property
    def stdout(self) -> str:
        return (self.logs / "stdout").read_text()

    @property
    def stderr(self) -> str:
        return (self.logs / "stderr").read_text()

    def wait_for_steps(self, run_dir: Path, steps: int, timeout_s: float = 240) -> None:
        """Until metrics.jsonl holds ``steps`` records (polled every 0.1 s, at most ``timeout_s``)."""
        deadline = time.monotonic() + timeout_s
        while len(records(run_dir)) < steps:
            assert self.proc.poll() is None, f"the run ended before step {steps}: {self.stderr[-3000:]}"
            assert time.monotonic() < deadline, f"no step {steps} within {timeout_s:g} s"
            time.sleep(0.1)

    def stop(self, signum: int = signal.SIGTERM, timeout_s: float = 120, *, group: bool = False) -> tuple[int, float]:
        """Send ``signum`` (to the run's whole process group with ``group``, as a shell's `kill %1`
        or a supervisor stopping a control group does) and wait for the run to exit: (its exit
        code, seconds from the signal to the exit)."""
        t0 = time.monotonic()
        if group:
            os.killpg(self.proc.pid, signum)
        else:
            self.proc.send_signal(signum)
        code = self.proc.wait(timeout=timeout_s)
        return code, time.monotonic() - t0

    def kill(self) -> None:
        """What a test's ``finally`` calls: a run still going is killed and reaped."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)


def stop_line(stdout: str) -> Optional[str]:
    """The run's one line about what its stop saved, if it printed one."""
    found = [line for line in stdout.splitlines() if line.startswith("stop: ")]
    assert len(found) <= 1, found
    return found[0] if found else None
