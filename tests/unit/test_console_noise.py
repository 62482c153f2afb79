"""Ray's advice to turn token authentication off, printed at every embedded start, is dropped;
its other warnings are not. A dead worker's raylet paragraph (a guess at the OOM killer and
`ray stop --force`) becomes one line of what Ray knows."""

from __future__ import annotations

import logging

import pytest

from ringtrain.actors.console import AUTH_ADVICE_LOGGER, condense, quiet_ray_console

# What Ray 2.60's driver printed, word for word, when chaos `crash` ended rank 1's worker.
WORKER_DIED = (
    "A worker died or was killed while executing a task by an unexpected system error. To troubleshoot "
    "the problem, check the logs for the dead worker. Lease ID: 010000009d661fa8be4cc829386af6fcf4734a0a2ab64c"
    "03685fbad70c568e45 Worker ID: 04ab05d80d3594fbf8c486d27ea66f352ae12d9d2a373233b34fd160 Node ID: 1211ee746"
    "cadcf4f1141656dcbf6cb037964fef19666acfbdb1bb4ec Worker IP address: 192.0.2.2 Worker port: 41071 Worker "
    "PID: 31981 Worker exit type: SYSTEM_ERROR Worker exit detail: Worker unexpectedly exits with a "
    "connection error code 2. End of file. Some common causes include: (1) the process was killed by the "
    "OOM killer due to high memory usage, (2) ray stop --force was called, or (3) the worker crashed "
    "unexpectedly due to SIGSEGV or another unexpected error. If the process was killed by the kernel OOM "
    "killer (verifiable by checking for OOM in dmesg of the OOMing node), consider enabling resource "
    "isolation via --enable-resource-isolation to prevent node deaths by resource contention and "
    "significant loss of progress by uninformed kernel OOM killing."
)
AUTH_ADVICE = "Token authentication is enabled for this Ray cluster. Set RAY_AUTH_MODE=disabled to opt out."


def test_a_dead_workers_paragraph_becomes_one_line_of_facts() -> None:
    line = condense(WORKER_DIED)
    assert line == (
        "Ray: worker pid 31981 at 192.0.2.2 exited (SYSTEM_ERROR: Worker unexpectedly exits with a connection "
        "error code 2. End of file.); ringtrain's incident line says what happened and what it does"
    )
    # The same paragraph wrapped over lines, as a terminal or a log shows it.
    assert condense(WORKER_DIED.replace(". ", ".\n    ")) == line
    assert condense(AUTH_ADVICE) is None
    assert condense("The autoscaler could not place 4 CPU") == "The autoscaler could not place 4 CPU"


def test_the_drivers_error_printer_shows_the_condensed_line(capsys: pytest.CaptureFixture[str]) -> None:
    """Through the function Ray's error listener calls, as installed for a run."""
    import ray._private.worker as ray_worker

    quiet_ray_console()
    installed = ray_worker.print_to_stdstream
    quiet_ray_console()  # once, however often a process connects
    assert ray_worker.print_to_stdstream is installed
    ray_worker.print_to_stdstream({"lines": [WORKER_DIED], "pid": "raylet", "is_err": False}, ignore_prefix=False)
    ray_worker.print_to_stdstream({"lines": [AUTH_ADVICE], "pid": "raylet", "is_err": False}, ignore_prefix=False)
    printed = capsys.readouterr().out
    assert len(printed.strip().splitlines()) == 1, printed
    assert "Ray: worker pid 31981 at 192.0.2.2 exited (SYSTEM_ERROR" in printed
    assert "OOM" not in printed and "ray stop" not in printed


def test_the_advice_to_disable_auth_is_dropped(caplog: pytest.LogCaptureFixture) -> None:
    quiet_ray_console()
    quiet_ray_console()  # once is enough, however often a process connects
    logger = logging.getLogger(AUTH_ADVICE_LOGGER)
    assert len(logger.filters) == 1
    with caplog.at_level(logging.WARNING, logger=AUTH_ADVICE_LOGGER):
        logger.warning("Token authentication is enabled for this Ray cluster. Set RAY_AUTH_MODE=disabled to opt out.")
        logger.warning("the token file is unreadable")
    assert [r.getMessage() for r in caplog.records] == ["the token file is unreadable"]
