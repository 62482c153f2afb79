"""Closing an embedded cluster: its own processes are given time to exit; one left behind by a
parent that is gone (a daemon a worker started) is stopped at once, not waited for."""

from __future__ import annotations

import contextlib
import logging
import subprocess

import psutil
import pytest

from ringtrain.actors import cluster


def test_a_process_left_behind_is_stopped_at_once_and_a_child_is_left_to_finish(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(cluster, "EXIT_WAIT_S", 5.0)
    # A daemon as a worker would leave one: its own session, its parent gone at once.
    started = subprocess.run(["setsid", "sh", "-c", "sleep 600 >/dev/null 2>&1 & echo $!"], capture_output=True, text=True)
    orphan = psutil.Process(int(started.stdout))
    child = subprocess.Popen(["sleep", "0.5"])  # a process of this one's own that ends by itself
    try:
        with caplog.at_level(logging.WARNING, logger=cluster.__name__):
            cluster._end_processes([orphan, psutil.Process(child.pid)])

        assert not orphan.is_running()
        assert child.wait(timeout=5) == 0  # it ended by itself, not by a signal
        assert "outlived" not in caplog.text  # stopped by its SIGTERM, never waited out and killed
    finally:
        for pid in (orphan.pid, child.pid):
            with contextlib.suppress(psutil.Error):
                psutil.Process(pid).kill()
