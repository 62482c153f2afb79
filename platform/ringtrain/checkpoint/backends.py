"""Object backends: named byte objects under a root, on a file system here and in S3 (s3.py).

The store speaks to a backend in keys relative to the root (``step-000000012/params/w``) and
needs only five verbs from it: put, get, list, delete and delete a folder. Every put is durable
when it returns, which is what lets the store order "all shards, then the manifest" as a
commit.

The writer lease (lease.py) needs three more, conditional on an object's version (S3's ETag, a
file's sha256): read with the version, write only if the object is still that version (or, with
no version, still absent), delete only if it is still that version. So two runs racing for one
lease cannot both win.

A store may come from elsewhere, so nothing in it is trusted: a read with a ``limit`` reads at
most that many bytes and raises ObjectTooLarge (naming the object) past it, and the file backend
refuses a symbolic link anywhere below its root (UnsafeObject): a step folder linked to another
folder is neither read, written nor deleted through.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import shutil
import stat
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Protocol
from urllib.parse import unquote, urlsplit

from ringtrain.checkpoint.layout import TEMP_PREFIX


# Objects read and written with a version (the writer lease) are small records: one past this
# size is not one, and is compared as OVERSIZED instead of being read whole.
VERSIONED_LIMIT = 1 << 20
OVERSIZED = "oversized"


@dataclass(frozen=True)
class ObjectInfo:
    key: str
    size: int


class ObjectMissing(LookupError):
    """No object is stored under ``key``."""

    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


class ObjectTooLarge(ValueError):
    """The object holds more bytes than the reader allows: it is not what it should be."""

    def __init__(self, uri: str, limit: int) -> None:
        super().__init__(f"{uri} holds more than {limit:,} bytes, more than any such object may: not read")
        self.uri, self.limit = uri, limit

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.uri, self.limit))


class UnsafeObject(OSError):
    """A path below a file store's root is a symbolic link: refused, never followed."""


class ObjectBackend(Protocol):
    root_uri: str

    def uri(self, key: str) -> str:
        """A URI naming the object or folder ``key``, for messages and references."""

    def put(self, key: str, data: bytes) -> None:
        """Store ``data`` under ``key``, replacing any object there; durable once this returns."""

    def get(self, key: str, size_hint: Optional[int] = None, limit: Optional[int] = None) -> bytes:
        """The object's bytes, or ObjectMissing; ``size_hint`` lets large reads run in parts;
        ObjectTooLarge when it holds more than ``limit`` bytes (none read past it)."""

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """Every object below the folder ``prefix`` ("" or ending in '/'), at any depth."""

    def delete(self, keys: Iterable[str]) -> None:
        """Remove these objects durably; keys that do not exist are not an error.

        The objects of one call may go in any order: a caller that needs one gone before the
        others (a manifest before its shards) deletes it in a call of its own.
        """

    def delete_prefix(self, prefix: str) -> None:
        """Remove every object below the folder ``prefix`` (ending in '/')."""

    def is_transient(self, exc: BaseException) -> bool:
        """Whether retrying the call that raised ``exc`` may succeed."""

    def get_versioned(self, key: str, limit: Optional[int] = None) -> tuple[bytes, str]:
        """The object's bytes and version, or ObjectMissing; ObjectTooLarge past ``limit``."""

    def put_if(self, key: str, data: bytes, version: Optional[str]) -> Optional[str]:
        """Store ``data`` only if the object is still ``version`` (None: still absent); the new
        version, or None when it was not."""

    def delete_if(self, key: str, version: str) -> bool:
        """Remove the object only if it is still ``version``; whether it was removed."""


class FileBackend:
    """Objects as files below a root folder: written to a temporary name, fsynced, renamed."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.root_uri = root.as_uri()

    def uri(self, key: str) -> str:
        return self.root.joinpath(*[part for part in key.split("/") if part]).as_uri()

    def put(self, key: str, data: bytes) -> None:
        path = self._path(key)
        self._make_dirs(path.parent)
        # A fixed-length temporary name: the real name may already be 255 bytes long.
        tmp = path.with_name(f"{TEMP_PREFIX}{uuid.uuid4().hex}")
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        # The rename is durable only once the folder holding the new entry is synced.
        _fsync_dir(path.parent)

    def get(self, key: str, size_hint: Optional[int] = None, limit: Optional[int] = None) -> bytes:
        path = self._path(key)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except (FileNotFoundError, NotADirectoryError):
            raise ObjectMissing(key) from None
        except OSError as exc:
            if exc.errno == errno.ELOOP:  # O_NOFOLLOW met a link
                raise UnsafeObject(f"{path} is a symbolic link: a store's objects are never read through one") from None
            raise
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise ObjectMissing(key)  # a folder, or a device or pipe where an object should be
            data = f.read() if limit is None else f.read(limit + 1)
        if limit is not None and len(data) > limit:
            raise ObjectTooLarge(path.as_uri(), limit)
        return data

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        yield from self._walk(self._path(prefix) if prefix else self.root, prefix)

    def delete(self, keys: Iterable[str]) -> None:
        for key in keys:
            path = self._path(key)
            try:
                path.unlink()
            except FileNotFoundError:
                continue
            _fsync_dir(path.parent)

    def delete_prefix(self, prefix: str) -> None:
        folder = self._path(prefix)
        try:
            shutil.rmtree(folder)
        except FileNotFoundError:
            return
        _fsync_dir(folder.parent)

    def is_transient(self, exc: BaseException) -> bool:
        return False

    def get_versioned(self, key: str, limit: Optional[int] = None) -> tuple[bytes, str]:
        data = self.get(key, limit=limit)
        return data, _version(data)

    def put_if(self, key: str, data: bytes, version: Optional[str]) -> Optional[str]:
        with self._locked(key):
            if self._current_version(key) != version:
                return None
            self.put(key, data)
            return _version(data)

    def delete_if(self, key: str, version: str) -> bool:
        with self._locked(key):
            if self._current_version(key) != version:
                return False
            self.delete([key])
            return True

    def _current_version(self, key: str) -> Optional[str]:
        try:
            return _version(self.get(key, limit=VERSIONED_LIMIT))
        except ObjectMissing:
            return None
        except ObjectTooLarge:
            return OVERSIZED  # matches no version a writer holds: nothing replaces or removes it

    @contextlib.contextmanager
    def _locked(self, key: str) -> Iterator[None]:
        """An exclusive lock on ``key`` for a read-then-write, between processes of any host
        that share the file system's locks (a hidden file beside the object holds it)."""
        path = self._path(key)
        self._make_dirs(path.parent)
        fd = os.open(path.with_name(f".{path.name}.lock"), os.O_CREAT | os.O_RDWR, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing releases the lock

    def _path(self, key: str) -> Path:
        """The path of ``key``; UnsafeObject when a folder on the way below the root, or the
        object itself, is a symbolic link (the root itself is the user's choice)."""
        path = self.root
        for part in [part for part in key.split("/") if part]:
            path = path / part
            if path.is_symlink():
                raise UnsafeObject(f"{path} is a symbolic link: a store's objects are never reached through one")
        return path

    def _walk(self, folder: Path, prefix: str) -> Iterator[ObjectInfo]:
        try:
            entries = list(os.scandir(folder))
        except (FileNotFoundError, NotADirectoryError):
            return
        for entry in entries:
            if entry.is_dir(follow_symlinks=False):
                yield from self._walk(Path(entry.path), f"{prefix}{entry.name}/")
            elif entry.is_file(follow_symlinks=False):
                try:
                    size = entry.stat(follow_symlinks=False).st_size
                except FileNotFoundError:
                    continue
                yield ObjectInfo(key=f"{prefix}{entry.name}", size=size)

    def _make_dirs(self, folder: Path) -> None:
        missing: list[Path] = []
        while not folder.is_dir():
            missing.append(folder)
            folder = folder.parent
        for created in reversed(missing):
            created.mkdir(exist_ok=True)
            _fsync_dir(created.parent)


def _version(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def file_root(uri: str) -> Path:
    """The folder a ``file://`` URI or a plain path names, made absolute."""
    if "://" not in uri:
        return Path(os.path.abspath(os.path.expanduser(uri)))
    parts = urlsplit(uri)
    if parts.netloc not in ("", "localhost"):
        raise ValueError(
            f"checkpoint URI {uri!r}: file URIs name a local path (file:///abs/path), not host {parts.netloc!r}"
        )
    path = unquote(parts.path)
    if not path.startswith("/"):
        raise ValueError(f"checkpoint URI {uri!r}: a file URI needs an absolute path (file:///abs/path)")
    return Path(os.path.abspath(path))
