"""What the store hands back: checkpoint references, loaded checkpoints and skip records.

A loaded checkpoint's shards are a mapping that reads each shard on first access, checks it
against the manifest and keeps it; ``prefetch`` reads them all at once on a thread pool. That
lets a rank that needs a few shards of a large checkpoint read only those.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Optional

from ringtrain.checkpoint.manifest import Manifest


@dataclass(frozen=True)
class CheckpointRef:
    """A committed checkpoint. Refs returned by ``save`` also say what writing it cost."""

    step: int
    uri: str
    num_shards: Optional[int] = None
    num_bytes: Optional[int] = None
    # Wall time of save(): from the call until the manifest was committed (retention excluded).
    seconds: Optional[float] = None
    # Steps that retention deleted after this save.
    deleted_steps: tuple[int, ...] = ()

    @property
    def bytes_per_second(self) -> Optional[float]:
        if self.num_bytes is None or not self.seconds:
            return None
        return self.num_bytes / self.seconds


@dataclass(frozen=True)
class Skipped:
    """A checkpoint ``latest_valid`` passed over, and why."""

    step: int
    uri: str
    reason: str

    def __str__(self) -> str:
        return f"{self.uri}: {self.reason}"


class ShardMap(Mapping[str, bytes]):
    """Shard name -> bytes; each shard is read (and verified) by ``read`` on first access, once."""

    def __init__(self, names: Iterable[str], read: Callable[[str], bytes]) -> None:
        self._names = tuple(names)
        self._known = frozenset(self._names)
        self._read = read
        self._cache: dict[str, bytes] = {}
        self._lock = threading.Lock()

    def __getitem__(self, name: str) -> bytes:
        if name not in self._known:
            raise KeyError(name)
        with self._lock:
            cached = self._cache.get(name)
        if cached is not None:
            return cached
        data = self._read(name)
        with self._lock:
            return self._cache.setdefault(name, data)

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def __contains__(self, name: object) -> bool:
        return name in self._known

    def is_read(self, name: str) -> bool:
        with self._lock:
            return name in self._cache

    def prefetch(self, num_threads: int) -> None:
        """Read every shard not read yet, in parallel; the first failure is raised."""
        pending = [name for name in self._names if not self.is_read(name)]
        if not pending:
            return
        workers = max(1, min(num_threads, len(pending)))
        if workers == 1:
            for name in pending:
                self[name]
            return
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="ckpt-read") as pool:
            futures = [pool.submit(self.__getitem__, name) for name in pending]
            try:
                for future in futures:
                    future.result()
            except BaseException:
                for future in futures:
                    future.cancel()
                raise


class LoadedCheckpoint:
    """A checkpoint opened for reading: its ref, manifest, meta and (lazily read) shards."""

    def __init__(self, ref: CheckpointRef, manifest: Manifest, shards: ShardMap, *, verified: bool) -> None:
        self.ref = ref
        self.manifest = manifest
        self.shards: ShardMap = shards
        # Whether each shard is checked against the manifest's size and checksum when read.
        self.verified = verified
        # The newer checkpoints latest_valid() passed over to reach this one, newest first.
        self.skipped: tuple[Skipped, ...] = ()

    @property
    def step(self) -> int:
        return self.ref.step

    @property
    def uri(self) -> str:
        return self.ref.uri

    @property
    def meta(self) -> Mapping[str, Any]:
        return self.manifest.meta

    def __repr__(self) -> str:
        return f"LoadedCheckpoint(step={self.step}, uri={self.uri!r}, num_shards={len(self.shards)})"
