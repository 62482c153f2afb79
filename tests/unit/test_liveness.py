"""Whether a writer lease's holder process is gone (``checkpoint.liveness``): known gone only
when no process has its pid, or the one that has it started at another time; a ``/proc`` that
hides other users' processes (``hidepid``) proves nothing, so such a live holder keeps its lease.
"""

from __future__ import annotations

import errno
import os
from typing import Any

import pytest

from ringtrain.checkpoint import liveness
from ringtrain.checkpoint.lease import Holder

PID = (1 << 22) + 1  # above the largest pid_max Linux allows: no process has it


def hidden_stat(monkeypatch: pytest.MonkeyPatch, error: type[OSError], kill: int) -> None:
    """Process ``PID``'s stat fails with ``error`` (hidepid=1: PermissionError; hidepid=2: the
    folder is not there at all) and ``kill(PID, 0)`` fails with errno ``kill`` (0: succeeds)."""
    real_open = open

    def fake_open(path: Any, *args: Any, **kwargs: Any) -> Any:
        if str(path) == f"/proc/{PID}/stat":
            code = errno.EACCES if error is PermissionError else errno.ENOENT
            raise error(code, os.strerror(code), str(path))
        return real_open(path, *args, **kwargs)

    def fake_kill(pid: int, signal: int) -> None:
        assert (pid, signal) == (PID, 0)
        if kill == errno.ESRCH:
            raise ProcessLookupError(kill, os.strerror(kill))
        if kill:
            raise PermissionError(kill, os.strerror(kill))

    monkeypatch.setattr(liveness, "open", fake_open, raising=False)
    monkeypatch.setattr(liveness.os, "kill", fake_kill)


@pytest.mark.parametrize(
    "error, kill, gone",
    [
        (PermissionError, errno.EPERM, False),  # hidepid=1: the stat is there, not ours to read
        (FileNotFoundError, errno.EPERM, False),  # hidepid=2: hidden, but kill(2) finds it runs
        (FileNotFoundError, 0, False),
        (FileNotFoundError, errno.ESRCH, True),  # no such process: the holder ended
    ],
    ids=["hidepid-1", "hidepid-2", "signalled", "no-such-process"],
)
def test_an_unreadable_stat_is_gone_only_when_no_process_has_the_pid(
    monkeypatch: pytest.MonkeyPatch, error: type[OSError], kill: int, gone: bool
) -> None:
    hidden_stat(monkeypatch, error, kill)
    holder = Holder("run-id", "first", "/runs/first", "host", PID, liveness.this_boot(), 12345)
    assert liveness.is_gone(holder.boot, PID, holder.started) is gone
    assert holder.gone() is gone
    assert liveness.started(PID) is None  # what a new holder records when it cannot read its own


def test_a_process_is_gone_when_its_pid_runs_another_process_or_none() -> None:
    boot, mine = liveness.this_boot(), liveness.started(os.getpid())
    assert boot and mine
    assert not liveness.is_gone(boot, os.getpid(), mine)
    assert liveness.is_gone(boot, os.getpid(), mine + 1)  # the pid handed on to a later process
    assert liveness.is_gone(boot, PID, mine)  # no such process
    assert not liveness.is_gone("another host's boot", PID, mine)  # nothing known elsewhere
