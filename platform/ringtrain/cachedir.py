"""The folder each node caches ``s3://`` dataset shards in: the user's own, and private.

A cache every user of a node shares (``/tmp/ringtrain-data-cache``) lets anyone who can write
there first plant shards for someone else's run, or read another user's data; a shard's sha256
is checked on use, but a planted folder still decides where writes go. So the default is
``<temp>/ringtrain-data-cache-<uid>``, made with mode 0700, and used only when it is this user's
own real folder: a link, or a folder of another user, is refused with a DataError naming it, and
one of ours that others can read or write is made private again. A folder the user names
(``data.cache_dir``, ``$RINGTRAIN_DATA_CACHE``) is theirs to choose; it is made 0700 when missing.
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

from ringtrain.errors import DataError

CACHE_ENV = "RINGTRAIN_DATA_CACHE"
PRIVATE = 0o700


def data_cache_dir(configured: str = "") -> Path:
    """The cache folder: ``configured``, else $RINGTRAIN_DATA_CACHE, else this user's private one."""
    chosen = configured or os.environ.get(CACHE_ENV)
    if chosen:
        path = Path(chosen)
        path.mkdir(mode=PRIVATE, parents=True, exist_ok=True)
        return path
    return private_dir(Path(tempfile.gettempdir()) / f"ringtrain-data-cache-{os.getuid()}")


def private_dir(path: Path) -> Path:
    """``path`` as a folder only this user can enter: made 0700 if missing, checked if not."""
    try:
        path.mkdir(mode=PRIVATE)
    except FileExistsError:
        pass
    found = os.lstat(path)
    if not stat.S_ISDIR(found.st_mode):
        raise DataError(f"{path}: the data cache is not a folder (a link or a file); remove it, or set {CACHE_ENV}")
    if found.st_uid != os.getuid():
        raise DataError(
            f"{path}: the data cache belongs to uid {found.st_uid}, not to this user (uid {os.getuid()}); "
            f"another user may have made it to plant data: remove it, or set {CACHE_ENV}"
        )
    if stat.S_IMODE(found.st_mode) != PRIVATE:
        os.chmod(path, PRIVATE)
    return path
