"""A bench script run on the CPU as a user runs it from the checkout, for the benches' tests."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# What a bench's process finds ringtrain (and its development package beside it) by.
ENV = {**os.environ, "PYTHONPATH": str(REPO / "platform")}


def run_bench(script: str, *args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    """``python bench/<script> ARGS`` from the checkout, which must exit 0; its output."""
    done = subprocess.run([sys.executable, str(REPO / "bench" / script), *args], cwd=REPO, env=ENV,
                          capture_output=True, text=True, timeout=timeout)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return done
