"""Object backends: named byte objects under a root, on a file system here and in S3 (s3.py).

The store speaks to a backend in keys relative to the root (``step-000000012/params/w``) and
needs only five verbs from it: put, get, list, delete and delete a folder. Every put is durable
when it returns, which is what lets the store order "all shards, then the manifest" as a
commit.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Protocol
from urllib.parse import unquote, urlsplit

from ringtrain.checkpoint.layout import TEMP_PREFIX


@dataclass(frozen=True)
class ObjectInfo:
    key: str
    size: int


class ObjectMissing(LookupError):
    """No object is stored under ``key``."""

    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


class ObjectBackend(Protocol):
    root_uri: str

    def uri(self, key: str) -> str:
        """A URI naming the object or folder ``key``, for messages and references."""

    def put(self, key: str, data: bytes) -> None:
        """Store ``data`` under ``key``, replacing any object there; durable once this returns."""

    def get(self, key: str, size_hint: Optional[int] = None) -> bytes:
        """The object's bytes, or ObjectMissing; ``size_hint`` lets large reads run in parts."""

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


class FileBackend:
    """Objects as files below a root folder: written to a temporary name, fsynced, renamed."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.root_uri = root.as_uri()

    def uri(self, key: str) -> str:
        return self._path(key).as_uri()

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

    def get(self, key: str, size_hint: Optional[int] = None) -> bytes:
        try:
            return self._path(key).read_bytes()
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            raise ObjectMissing(key) from None

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

    def _path(self, key: str) -> Path:
        return self.root.joinpath(*[part for part in key.split("/") if part])

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
