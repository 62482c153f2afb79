"""The folder each node caches ``s3://`` dataset shards in: the user's own, and private.

A cache every user of a node shares (``/tmp/ringtrain-data-cache``) lets anyone who can write
there first plant shards for someone else's run, or read another user's data; a shard's sha256
is checked on use, but a planted folder still decides where writes go. So the cache is
``data.cache_dir``, else ``$RINGTRAIN_DATA_CACHE``, else ``<temp>/ringtrain-data-cache-<uid>``,
and whichever it is, it is used only as this user's own real folder: made with mode 0700 when
missing; a link, a file, or a folder of another user refused with a DataError naming it and the
setting to change; one of ours that others can enter made private again.

Files land in it through ``write_cached``: a temp file of a name nobody can guess, opened
exclusively (it never follows a link planted under that name), then renamed over the file.
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

from ringtrain.errors import DataError

CACHE_ENV = "RINGTRAIN_DATA_CACHE"
CACHE_KEY = "data.cache_dir"
PRIVATE = 0o700


def data_cache_dir(configured: str = "") -> Path:
    """The cache folder: ``configured``, else $RINGTRAIN_DATA_CACHE, else this user's private one."""
    if configured:
        return private_dir(Path(configured), f"name another {CACHE_KEY}")
    from_env = os.environ.get(CACHE_ENV)
    if from_env:
        return private_dir(Path(from_env), f"set {CACHE_ENV} to another folder")
    default = Path(tempfile.gettempdir()) / f"ringtrain-data-cache-{os.getuid()}"
    return private_dir(default, f"set {CACHE_KEY} or {CACHE_ENV}")


def private_dir(path: Path, remedy: str = f"set {CACHE_KEY} or {CACHE_ENV}") -> Path:
    """``path`` as a folder only this user can enter: made 0700 if missing (its parents as
    usual), checked if not; ``remedy`` ends the refusal's message."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        path.mkdir(mode=PRIVATE)
    except FileExistsError:
        pass
    found = os.lstat(path)
    if not stat.S_ISDIR(found.st_mode):
        raise DataError(f"{path}: the data cache is not a folder (a link or a file); remove it, or {remedy}")
    if found.st_uid != os.getuid():
        raise DataError(
            f"{path}: the data cache belongs to uid {found.st_uid}, not to this user (uid {os.getuid()}); "
            f"another user may have made it to plant data: remove it, or {remedy}"
        )
    if stat.S_IMODE(found.st_mode) != PRIVATE:
        os.chmod(path, PRIVATE, follow_symlinks=False)
    return path


def write_cached(path: Path, data: bytes) -> None:
    """``data`` at ``path`` atomically: readers see the old file or the whole new one, and a
    crash leaves at most a temp file, never a partial ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    # mkstemp: a random name, created with O_EXCL and mode 0600.
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
