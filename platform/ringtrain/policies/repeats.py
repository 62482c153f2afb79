"""Repeating errors: an exception that comes back on the same step after a rollback. Pure.

A rank's own exception rolls the step back and retries it in place (``policies.faults``):
right for a transient fault, wasted for a deterministic one (a bug, a bad sample), which comes
back on every retry until ``controllers.max_recoveries`` runs out. Two occurrences of the same
error, told apart by its type, message and the frame that raised it in ringtrain or user code,
on the same step are enough to call it deterministic: the run stops after the second, naming
the frame.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Optional

# One frame of a Python traceback as ``traceback.format_exc`` writes it.
_FRAME = re.compile(r'File "(?P<path>[^"]+)", line (?P<line>\d+), in (?P<func>\S+)')
# Frames of installed libraries and of the interpreter itself: never where a user looks first.
_LIBRARY = re.compile(r"[/\\](site|dist)-packages[/\\]|[/\\]lib[/\\]python\d[\d.]*[/\\]|^<frozen ")


def user_frame(traceback_text: str) -> str:
    """``path:line in func`` of the innermost frame in ringtrain or user code (not in an
    installed library or the standard library) of a formatted traceback; "" if there is none."""
    found = ""
    for m in _FRAME.finditer(traceback_text):
        path = m.group("path")
        if "/ringtrain/" in path or "\\ringtrain\\" in path or not _LIBRARY.search(path):
            found = f"{_short(path)}:{m.group('line')} in {m.group('func')}"
    return found


def _short(path: str) -> str:
    """The path from the package root on (``ringtrain/train/trainer.py``), else as given."""
    for marker in ("/ringtrain/", "\\ringtrain\\"):
        at = path.rfind(marker)
        if at >= 0:
            return "ringtrain/" + path[at + len(marker) :].replace("\\", "/")
    return path


@dataclass(frozen=True)
class ErrorSignature:
    """What makes two errors the same one."""

    error: str  # "<ExceptionType>: <first line of the message>"
    frame: str  # user_frame of its traceback ("" when unknown)

    @property
    def type(self) -> str:
        return self.error.partition(":")[0].strip()

    def to_dict(self) -> dict[str, str]:
        return {"type": self.type, "message": self.error.partition(":")[2].strip(), "frame": self.frame}


@dataclass
class RepeatTracker:
    """The errors seen so far, by step; ``observe`` says how often this one was seen there."""

    seen: dict[tuple[int, ErrorSignature], int] = field(default_factory=dict)

    def observe(self, step: int, signature: ErrorSignature) -> int:
        """Record ``signature`` at ``step``; returns its occurrences there, this one included."""
        key = (step, signature)
        self.seen[key] = self.seen.get(key, 0) + 1
        return self.seen[key]


def repeated_reason(signature: ErrorSignature, step: int, occurrences: int) -> Optional[str]:
    """Why the run stops, when ``occurrences`` (at ``step``) make the error deterministic."""
    if occurrences < 2:
        return None
    where = f" at {signature.frame}" if signature.frame else ""
    return (
        f"the same error ({signature.error}{where}) came back on step {step} after a rollback "
        f"({occurrences} times): not transient, so not retried"
    )
