"""Where a command writes a file the user names (``generate --out``, ``plan --chart``), checked
with the other input before the work starts: a path that cannot be written fails in a second,
not after the results are made, and with one line instead of a traceback."""

from __future__ import annotations

import os
from pathlib import Path

from ringtrain.errors import ConfigError


def check_writable(path: str, flag: str) -> None:
    """ConfigError naming ``flag`` when ``path`` cannot be written as a file: it is a folder or a
    file that may not be written, or the folder it would go in is missing, not a folder, or not
    writable."""
    target = Path(path)
    if target.is_dir():
        raise ConfigError(flag, f"{path} is a folder; name a file to write")
    if target.exists() and not os.access(target, os.W_OK):
        raise ConfigError(flag, f"{path}: cannot write this file")
    folder = target.parent
    if not folder.exists():
        raise ConfigError(flag, f"{path}: no such folder {folder}; make it first")
    if not folder.is_dir():
        raise ConfigError(flag, f"{path}: {folder} is a file, not a folder")
    if not os.access(folder, os.W_OK):
        raise ConfigError(flag, f"{path}: cannot write in {folder}")
