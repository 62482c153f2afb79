"""`ringtrain run` stopped by SIGTERM mid-run (what ``ray job stop`` and Kubernetes send): the
run ends cleanly and its summary.json says ``stopped`` at the last step metrics.jsonl holds.

While it trains it holds its checkpoint store's writer lease, renewed as it goes: a second run
on the same store is refused with exit 2 naming it, and the lease is gone once it has stopped."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from .test_run_e2e import QUICKSTART, REPO, TINY, TORCH_EXTENSIONS_DIR, processes_using, ray_tmp  # noqa: F401  (fixture)

pytestmark = [pytest.mark.ray, pytest.mark.slow]

STEPS = 500  # far more than the test waits for: the signal always lands mid-run
SEEN_STEPS = 3
LEASE_S = 3  # renewed every second: seen renewed well within the test's wait


def records(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    # Lines are flushed whole (RunDir), so every line read is a complete record.
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_sigterm_stops_the_run_and_its_summary_says_stopped(tmp_path: Path, ray_tmp: Path) -> None:
    run_dir = tmp_path / "run"
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    env.update(
        HOME=str(tmp_path),
        RAY_TMPDIR=str(ray_tmp),
        RAY_AUTH_MODE="disabled",
        TORCH_EXTENSIONS_DIR=str(TORCH_EXTENSIONS_DIR),
        PYTHONPATH=os.pathsep.join([str(REPO / "platform"), env.get("PYTHONPATH", "")]),
    )
    # Output goes to files: a pipe nobody reads while waiting would fill up and stall the run.
    with open(tmp_path / "stdout", "w") as out, open(tmp_path / "stderr", "w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "ringtrain", "run", str(QUICKSTART), *TINY, f"train.steps={STEPS}", f"run_dir={run_dir}",
             f"checkpoint.lease_s={LEASE_S}"],
            env=env, cwd=tmp_path, stdout=out, stderr=err,
        )  # fmt: skip
        try:
            deadline = time.monotonic() + 240
            while len(records(run_dir)) < SEEN_STEPS:
                assert proc.poll() is None, f"the run ended before step {SEEN_STEPS}: {(tmp_path / 'stderr').read_text()[-3000:]}"
                assert time.monotonic() < deadline, f"no step {SEEN_STEPS} within 240 s"
                time.sleep(0.2)
            lease_path = run_dir / "checkpoints" / "writer.lease"
            first = json.loads(lease_path.read_text())
            assert first["holder"]["pid"] == proc.pid and first["holder"]["run_dir"] == str(run_dir)
            renewed = time.monotonic() + 30
            while json.loads(lease_path.read_text())["expires_at"] <= first["expires_at"]:
                assert time.monotonic() < renewed, "the lease was not renewed while the run trained"
                time.sleep(0.2)
            # A second run on the same store: refused before it starts anything.
            second = subprocess.run(
                [sys.executable, "-m", "ringtrain", "run", str(QUICKSTART), *TINY,
                 f"checkpoint.uri={(run_dir / 'checkpoints').as_uri()}", "checkpoint.resume=auto", f"run_dir={tmp_path / 'second'}"],
                env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120,
            )  # fmt: skip
            assert second.returncode == 2, second.stderr[-3000:]
            assert f"is being written by run 'quickstart' (pid {proc.pid} on " in second.stderr
            assert len(second.stderr.strip().splitlines()) == 1 and "Traceback" not in second.stderr
            assert not (tmp_path / "second").exists()
            proc.send_signal(signal.SIGTERM)
            returncode = proc.wait(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
    stderr = (tmp_path / "stderr").read_text()

    # Handled, not killed by the signal (-15); not 0 either: the job did not finish.
    assert returncode == 1, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["status"], summary["error"]) == ("stopped", "interrupted")
    steps = [r["step"] for r in records(run_dir)]
    assert steps == list(range(1, len(steps) + 1))
    assert SEEN_STEPS <= summary["final_step"] == steps[-1] < STEPS
    assert summary["final_loss"] == records(run_dir)[-1]["loss"]
    assert summary["ledger"]["steps"] == summary["final_step"]
    assert not (run_dir / "checkpoints" / "writer.lease").exists(), "the stopped run released its lease"
    assert processes_using(ray_tmp) == []
