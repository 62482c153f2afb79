"""The GPU tier's test log: each test's start and outcome, appended the moment it happens.

pytest prints its failures only when the session ends, so a run stopped by a time limit says
nothing about what failed. Where RINGTRAIN_GPU_LOG names a file, every test appends one JSON
line when it starts and one when its outcome is known (passed, failed, error, not run, xfailed,
xpassed; a failure's traceback, a skip's reason), and the session one line with the number of
tests collected. bench/gpu_check.py reads it; a cut run still lists what passed and what failed,
and what was running when it was cut.

Under pytest-xdist each worker writes the tests it runs; the controller writes only what no
worker could (a crashed worker's test). Each line is one ``write`` on a file opened with
O_APPEND, so lines from several processes never interleave.

A CUDA error that poisons the process's context (an illegal memory access, a kernel that
faulted) makes every later CUDA call in that process fail with it: after one, the process's
remaining tests are not run, their reason naming the test that lost the context, so the log
shows one failure and its cause, not one per test that followed it.

Loaded by every run that collects tests/gpu, so it imports nothing beyond the stdlib and pytest.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any, Optional

import pytest

LOG_ENV = "RINGTRAIN_GPU_LOG"
CRASH_PHASE = "???"  # pytest-xdist's phase for the report of a test whose worker died

# CUDA's sticky errors, as their messages read: after one, the context answers every call with it.
STICKY_CUDA_ERRORS = (
    "an illegal memory access was encountered",
    "device-side assert triggered",
    "unspecified launch failure",
    "the launch timed out and was terminated",
    "misaligned address",
    "an illegal instruction was encountered",
    "operation not supported on global/shared address space",
    "invalid program counter",
    "hardware stack error",
    "uncorrectable ECC error encountered",
)

_config: Optional[pytest.Config] = None
_context_lost_in: Optional[str] = None  # the test whose sticky CUDA error poisoned this process


def _xdist_controller() -> bool:
    """Whether this process hands tests to pytest-xdist workers (it registers its session late,
    after this conftest's pytest_configure, so it is asked each time)."""
    return _config is not None and _config.pluginmanager.has_plugin("dsession")


def _worker() -> str:
    """This process's xdist worker id, or "main": from the config, not the environment, which a
    pytest started from inside another's worker inherits."""
    workerinput = getattr(_config, "workerinput", None)
    return workerinput["workerid"] if workerinput else "main"


def _append(record: dict[str, Any]) -> None:
    path = os.environ.get(LOG_ENV)
    if not path:
        return
    data = (json.dumps({**record, "worker": _worker(), "time": round(time.time(), 3)}) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        while data:
            data = data[os.write(fd, data) :]
    finally:
        os.close(fd)


def _skip_reason(report: pytest.TestReport) -> str:
    if isinstance(report.longrepr, tuple) and len(report.longrepr) == 3:
        reason = str(report.longrepr[2])
        return reason.removeprefix("Skipped: ")
    return report.longreprtext


def _outcome(report: pytest.TestReport) -> Optional[str]:
    """The test's outcome this report settles, or None while another report is still to come."""
    xfail = hasattr(report, "wasxfail")
    if report.when == "call" or report.when == CRASH_PHASE:
        if report.skipped:
            return "xfailed" if xfail else "not run"
        if report.passed:
            return "xpassed" if xfail else "passed"
        return "failed"
    if report.failed:  # setup or teardown
        return "error"
    if report.when == "setup" and report.skipped:
        return "xfailed" if xfail else "not run"
    return None


def pytest_configure(config: pytest.Config) -> None:
    global _config
    _config = config


def pytest_collection_finish(session: pytest.Session) -> None:
    if not _xdist_controller() and _worker() in ("main", "gw0"):  # every worker collects the same tests
        _append({"event": "collected", "count": len(session.items)})


def pytest_collectreport(report: pytest.CollectReport) -> None:
    """A module that fails to import: its tests never start, so it is logged as an error."""
    if report.failed and not _xdist_controller() and _worker() in ("main", "gw0"):
        _append({"event": "outcome", "nodeid": report.nodeid, "outcome": "error", "when": "collect",
                 "duration_s": 0.0, "traceback": report.longreprtext})


def pytest_runtest_logstart(nodeid: str, location: tuple[str, Optional[int], str]) -> None:
    if not _xdist_controller():
        _append({"event": "start", "nodeid": nodeid})


def _context_lost() -> bool:
    """Whether this process's CUDA context answers with an error: a test may report one that a
    process of its own (a rank, a Ray worker) met, which leaves this one's context whole, as it
    does where this process never started CUDA."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return False
    try:
        torch.cuda.synchronize()
    except Exception:  # noqa: BLE001 - any error the context answers with is the loss
        return True
    return False


def pytest_runtest_setup(item: pytest.Item) -> None:
    if _context_lost_in is not None:
        pytest.skip(f"not run: this process's CUDA context was lost in {_context_lost_in}")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    global _context_lost_in
    if _xdist_controller() and report.when != CRASH_PHASE:
        return  # its worker wrote it
    outcome = _outcome(report)
    if outcome is None:
        return
    if outcome in ("failed", "error") and _context_lost_in is None and report.when != CRASH_PHASE:
        if any(error in report.longreprtext for error in STICKY_CUDA_ERRORS) and _context_lost():
            _context_lost_in = report.nodeid
    record: dict[str, Any] = {
        "event": "outcome",
        "nodeid": report.nodeid,
        "outcome": outcome,
        "when": report.when,
        "duration_s": round(report.duration, 3),
    }
    if outcome == "not run":
        record["reason"] = _skip_reason(report)
    elif outcome in ("failed", "error"):
        record["traceback"] = report.longreprtext
    _append(record)
