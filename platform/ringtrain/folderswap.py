"""A finished folder put in place of whatever is at its destination, judged at the last moment.

`ringtrain prepare` and `ringtrain export` build their output in a hidden sibling folder and
rename it into place. What is at the destination may have changed since the command checked it
(both run for minutes to hours, on shared file systems): so it is moved aside first, where
nothing else can add to it, judged there, and put back untouched if the judge refuses it. A
folder made at the destination meanwhile stops the final rename, since a directory is renamed
only onto an empty one or nothing.
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path
from typing import Callable, Optional


class DestinationAppeared(OSError):
    """Something was made at the destination between moving the old one aside and renaming the
    new one in. Nothing there was replaced; ``aside`` is where the old folder now is (None when
    there was none)."""

    def __init__(self, destination: Path, aside: Optional[Path], reason: str) -> None:
        super().__init__(reason)
        self.destination, self.aside, self.reason = destination, aside, reason


def swap_in(staged: Path, destination: Path, judge: Callable[[Path], None]) -> None:
    """Rename ``staged`` to ``destination``. What was there is first moved aside and passed to
    ``judge``, which raises to refuse it: it is then put back, and the exception goes on. Once
    the new folder is in place, the old one is deleted."""
    aside: Optional[Path] = None
    if destination.exists() or destination.is_symlink():
        aside = destination.parent / f".{destination.name}.replaced-{uuid.uuid4().hex[:8]}"
        os.rename(destination, aside)
        try:
            judge(aside)
        except BaseException:
            os.rename(aside, destination)  # as it was
            raise
    try:
        os.rename(staged, destination)
    except OSError as exc:
        raise DestinationAppeared(destination, aside, exc.strerror or str(exc)) from None
    if aside is None:
        return
    if aside.is_dir() and not aside.is_symlink():
        shutil.rmtree(aside, ignore_errors=True)
    else:
        aside.unlink()
