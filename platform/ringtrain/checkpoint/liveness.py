"""Whether a process a record names is still running, when the record was written on this host.

A writer lease names its holder's pid, but a pid alone proves nothing: on another host it names
another process, and on this one it may have been handed to a new process since. So a record
also carries where its pid means something (the host's boot id and the pid namespace: a
container has its own) and the process's start time (clock ticks since boot, from
``/proc/<pid>/stat``). A process is known gone only when the record was made under this very
boot and pid namespace and no process with that pid and start time is running; anywhere else
(another host, another container, a system without ``/proc``) nothing is known, and the caller
waits, as for a live one. So does a ``/proc`` that hides another user's processes (mounted with
``hidepid``): a stat this process may not read is no proof the process ended, only the kernel's
"no such process" is.
"""

from __future__ import annotations

import os
from functools import lru_cache
from typing import Optional

_BOOT_ID = "/proc/sys/kernel/random/boot_id"


@lru_cache(maxsize=1)
def this_boot() -> str:
    """This host's boot and pid namespace (``<boot id> <pid namespace>``), or "" where unknown."""
    try:
        with open(_BOOT_ID) as f:
            boot = f.read().strip()
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""
    return f"{boot} {namespace}" if boot and namespace else ""


def started(pid: int) -> Optional[int]:
    """The start time of process ``pid`` in clock ticks since boot; None when there is none, or
    it cannot be read."""
    try:
        return _start_ticks(pid)
    except OSError:
        return None


def is_gone(boot: str, pid: int, start_ticks: int) -> bool:
    """Whether the process ``pid`` that started at ``start_ticks`` under ``boot`` is known to have
    ended: only when ``boot`` is this host's current boot and pid namespace, and either no
    process has that pid or the one that has it started at another time."""
    if not boot or boot != this_boot() or start_ticks <= 0:
        return False
    try:
        now = _start_ticks(pid)
    except OSError:  # no stat to read: hidden (hidepid), or no such process, which only kill(2) tells apart
        return not _exists(pid)
    return now is not None and now != start_ticks


def _start_ticks(pid: int) -> Optional[int]:
    """Process ``pid``'s start time from its stat (None when the stat does not parse); OSError
    when the stat cannot be read."""
    with open(f"/proc/{pid}/stat") as f:
        _, name_end, rest = f.read().rpartition(")")
    fields = rest.split() if name_end else []
    try:
        return int(fields[19])  # the 22nd field of stat, counted from the state after the name
    except (IndexError, ValueError):
        return None


def _exists(pid: int) -> bool:
    """Whether a process ``pid`` runs, as signal 0 finds it: EPERM is one this process may not
    signal, so it runs; only ESRCH says none does."""
    if pid <= 0:  # 0 and negative pids name process groups, not a process
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # PermissionError: it runs under another user
        return True
    return True
