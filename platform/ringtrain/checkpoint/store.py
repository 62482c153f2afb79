"""The durable checkpoint store: step-tagged sets of named shards, committed by a manifest.

``save`` writes every shard, then the manifest; a checkpoint without a manifest does not exist,
so a crash at any point leaves either the old set of checkpoints or the old set plus the new
one. Retention then deletes the oldest checkpoints, each manifest first, so a half-deleted
checkpoint is never taken for a valid one. ``latest_valid`` walks the checkpoints newest first
and passes over (and reports) any that is uncommitted, damaged, or made for another model.

One store serializes its own saves and deletions; reads may run alongside them. Several
processes may read one root, but only one may write to it: a ``Fence`` (the run's writer lease,
lease.py) passed to ``save`` and ``delete`` is confirmed before every shard, the manifest commit
and every deletion, and once it raises nothing more is written or deleted, not even the pieces
of the save it interrupted (the store may be another run's by then). A store pickles (an S3 client is
made again on the other side), so it can be handed to actors.
"""

from __future__ import annotations

import builtins
import logging
import random
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, Optional, TypeVar, Union

from ringtrain import uris
from ringtrain.checkpoint.backends import (
    FileBackend,
    ObjectBackend,
    ObjectInfo,
    ObjectMissing,
    ObjectTooLarge,
    UnsafeObject,
    file_root,
)
from ringtrain.checkpoint.fence import Fence, FenceLost
from ringtrain.checkpoint.fence import confirm as _confirm
from ringtrain.checkpoint.layout import (
    MANIFEST_NAME,
    TEMP_PREFIX,
    check_shard_names,
    check_step,
    manifest_key,
    parse_step_dir,
    shard_key,
    step_dir,
)
from ringtrain.checkpoint.loaded import CheckpointRef, LoadedCheckpoint, ShardMap, Skipped
from ringtrain.checkpoint.manifest import (
    DEFAULT_CHECKSUM_ALGO,
    MAX_MANIFEST_BYTES,
    CheckpointCorrupt,
    Manifest,
    ManifestInvalid,
    ShardEntry,
    check_checksum_algo,
    check_meta,
    checksum,
)
from ringtrain.checkpoint.options import S3Options

logger = logging.getLogger(__name__)

T = TypeVar("T")
# Given a checkpoint's meta, a reason it does not fit the model being trained, or None if it does.
Compatible = Callable[[Mapping[str, Any]], Optional[str]]


@dataclass
class _StepObjects:
    """One step folder as a listing shows it: object key below the folder -> size."""

    step: int
    sizes: dict[str, int] = field(default_factory=dict)

    @property
    def committed(self) -> bool:
        return MANIFEST_NAME in self.sizes


class CheckpointStore:
    """Checkpoints under one root URI; see the module docstring for the guarantees."""

    def __init__(
        self,
        backend: ObjectBackend,
        *,
        keep: int = 3,
        num_threads: int = 8,
        checksum_algo: str = DEFAULT_CHECKSUM_ALGO,
        commit_attempts: int = 5,
        backoff_s: float = 0.2,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep must be an int >= 1 (checkpoints to retain), got {keep!r}")
        if num_threads < 1 or commit_attempts < 1:
            raise ValueError("num_threads and commit_attempts must be >= 1")
        self.backend = backend
        self.keep = keep
        self.num_threads = num_threads
        self.checksum_algo = check_checksum_algo(checksum_algo)
        # Our own retry of a whole call (the manifest commit, reads, listings), around botocore's
        # per-request retries: the commit decides whether a checkpoint exists, so it is worth
        # riding out a longer blip than one request's retries cover.
        self.commit_attempts = commit_attempts
        self.backoff_s = backoff_s
        self._sleep = sleep
        self._write_lock = threading.Lock()
        # What the last latest_valid() passed over, newest first.
        self.skipped: builtins.list[Skipped] = []

    def __getstate__(self) -> dict[str, Any]:
        # A store crosses process boundaries (it is shipped to actors); its lock does not.
        state = dict(self.__dict__)
        del state["_write_lock"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._write_lock = threading.Lock()

    @property
    def uri(self) -> str:
        return self.backend.root_uri

    def checkpoint_uri(self, step: int) -> str:
        return self.backend.uri(step_dir(step))

    def __repr__(self) -> str:
        return f"CheckpointStore({self.uri!r}, keep={self.keep})"

    def save(
        self, step: int, shards: Mapping[str, bytes], meta: Mapping[str, Any], *, fence: Optional[Fence] = None
    ) -> CheckpointRef:
        """Write ``shards``, commit them with a manifest holding ``meta``, then apply retention.

        Arguments are checked before anything is written: the step, the shard names (see
        layout.py) and ``meta``, which must be JSON (it is stored as JSON and read back so).
        Saving a step that already exists replaces it, uncommitting the old one first.
        ``fence`` is confirmed before each write and deletion; what it raises ends the save.
        """
        check_step(step)
        check_shard_names(shards)
        stored_meta = check_meta(meta)
        payload = {name: data if isinstance(data, bytes) else bytes(data) for name, data in shards.items()}
        with self._write_lock:
            started = time.perf_counter()
            self._clear_step(step, fence)
            entries = self._write_shards(step, payload, fence)
            manifest = Manifest(
                step=step,
                created_at=time.time(),
                meta=stored_meta,
                shards=entries,
                checksum_algo=self.checksum_algo,
            )
            encoded = manifest.encode()
            commit_key = manifest_key(step)
            _confirm(fence)
            self._retrying(f"commit {self.backend.uri(commit_key)}", lambda: self.backend.put(commit_key, encoded))
            seconds = time.perf_counter() - started
            logger.info(
                "committed checkpoint %s: %d shards, %d bytes in %.3fs",
                self.checkpoint_uri(step), len(entries), manifest.num_bytes, seconds,
            )
            deleted = self._apply_retention(step, fence)
        return CheckpointRef(
            step=step,
            uri=self.checkpoint_uri(step),
            num_shards=len(entries),
            num_bytes=manifest.num_bytes,
            seconds=seconds,
            deleted_steps=deleted,
        )

    def list(self) -> builtins.list[CheckpointRef]:
        """Committed checkpoints, newest first."""
        return [
            CheckpointRef(step=folder.step, uri=self.checkpoint_uri(folder.step))
            for folder in self._scan()
            if folder.committed
        ]

    def load(
        self, ref_or_step: Union[CheckpointRef, int], *, verify: bool = True, eager: bool = False
    ) -> LoadedCheckpoint:
        """Open a committed checkpoint; CheckpointCorrupt if its manifest is missing or invalid.

        Shards are read on first access, or all at once here with ``eager``. With ``verify``
        each shard is checked against the manifest's size and checksum as it is read, and a
        mismatch raises CheckpointCorrupt naming the shard.
        """
        step = ref_or_step.step if isinstance(ref_or_step, CheckpointRef) else check_step(ref_or_step)
        loaded = self._open(step, verify=verify)
        if eager:
            loaded.shards.prefetch(self.num_threads)
        return loaded

    def latest_valid(
        self, compatible: Optional[Compatible] = None, *, verify: bool = True
    ) -> Optional[LoadedCheckpoint]:
        """The newest checkpoint that is committed, intact and fits, or None.

        Newer checkpoints that fail are passed over with a warning and recorded in
        ``self.skipped`` and the result's ``skipped``: no manifest, an unreadable manifest, a
        ``compatible(meta)`` that returns a reason, or a shard that is missing, of the wrong
        size or (with ``verify``, which reads every shard) fails its checksum. With ``verify`` the
        returned checkpoint's shards are already read; without it they are read, and checked,
        on access. Errors other than damage (a network outage, denied access) are raised, not
        skipped: they say nothing about the checkpoint.
        """
        skipped: list[Skipped] = []
        found: Optional[LoadedCheckpoint] = None
        for folder in self._scan():
            uri = self.checkpoint_uri(folder.step)
            reason = self._check(folder, compatible, verify)
            if isinstance(reason, LoadedCheckpoint):
                found = reason
                break
            logger.warning("skipping checkpoint %s: %s", uri, reason)
            skipped.append(Skipped(step=folder.step, uri=uri, reason=reason))
        self.skipped = skipped
        if found is None:
            if skipped:
                logger.warning("no valid checkpoint under %s (%d skipped)", self.uri, len(skipped))
            return None
        found.skipped = tuple(skipped)
        return found

    def delete(self, ref_or_step: Union[CheckpointRef, int], *, fence: Optional[Fence] = None) -> None:
        """Delete one checkpoint, manifest first; deleting one that is not there does nothing."""
        step = ref_or_step.step if isinstance(ref_or_step, CheckpointRef) else check_step(ref_or_step)
        with self._write_lock:
            self._delete_step(step, fence)

    def _check(
        self, folder: _StepObjects, compatible: Optional[Compatible], verify: bool
    ) -> Union[LoadedCheckpoint, str]:
        """The loaded checkpoint if ``folder`` passes every check, else the reason it fails."""
        if not folder.committed:
            return "manifest is missing (a save that never committed, or a deletion that stopped halfway)"
        try:
            loaded = self._open(folder.step, verify=True)
        except CheckpointCorrupt as exc:
            return exc.reason
        if compatible is not None:
            why = compatible(loaded.meta)
            if why is not None:
                return f"incompatible with this model: {why}"
        for name, entry in loaded.manifest.shards.items():
            size = folder.sizes.get(name)
            if size is None:
                return f"shard {name!r} is missing ({self.backend.uri(shard_key(folder.step, name))})"
            if size != entry.size:
                return _size_problem(name, size, entry.size, self.backend.uri(shard_key(folder.step, name)))
        if verify:
            try:
                loaded.shards.prefetch(self.num_threads)
            except CheckpointCorrupt as exc:
                return exc.reason
        return loaded

    def _open(self, step: int, *, verify: bool) -> LoadedCheckpoint:
        uri = self.checkpoint_uri(step)
        key = manifest_key(step)
        try:
            data = self._retrying(f"read {self.backend.uri(key)}", lambda: self.backend.get(key, limit=MAX_MANIFEST_BYTES))
        except ObjectMissing:
            raise CheckpointCorrupt(uri, "manifest is missing (never committed, or deleted)") from None
        except (ObjectTooLarge, UnsafeObject) as exc:
            raise CheckpointCorrupt(uri, f"manifest refused: {exc}") from None
        try:
            manifest = Manifest.decode(data, step=step)
        except ManifestInvalid as exc:
            raise CheckpointCorrupt(uri, f"manifest is unreadable: {exc}") from None
        ref = CheckpointRef(step=step, uri=uri, num_shards=len(manifest.shards), num_bytes=manifest.num_bytes)
        shards = ShardMap(manifest.shards, lambda name: self._read_shard(manifest, name, verify))
        return LoadedCheckpoint(ref, manifest, shards, verified=verify)

    def _read_shard(self, manifest: Manifest, name: str, verify: bool) -> bytes:
        key = shard_key(manifest.step, name)
        object_uri = self.backend.uri(key)
        entry = manifest.shards[name]
        uri = self.checkpoint_uri(manifest.step)
        try:
            data = self._retrying(f"read {object_uri}", lambda: self.backend.get(key, entry.size, limit=entry.size))
        except ObjectMissing:
            raise CheckpointCorrupt(uri, f"shard {name!r} is missing ({object_uri})") from None
        except ObjectTooLarge:
            raise CheckpointCorrupt(uri, f"shard {name!r} holds more than the {entry.size} bytes the manifest says ({object_uri})") from None
        except UnsafeObject as exc:
            raise CheckpointCorrupt(uri, f"shard {name!r} refused: {exc}") from None
        if verify:
            if len(data) != entry.size:
                raise CheckpointCorrupt(uri, _size_problem(name, len(data), entry.size, object_uri))
            if checksum(manifest.checksum_algo, data) != entry.checksum:
                raise CheckpointCorrupt(
                    uri,
                    f"shard {name!r} fails its {manifest.checksum_algo} checksum (corrupt data in {object_uri})",
                )
        return data

    def _write_shards(self, step: int, payload: Mapping[str, bytes], fence: Optional[Fence]) -> dict[str, ShardEntry]:
        def write(name: str) -> ShardEntry:
            data = payload[name]
            entry = ShardEntry(size=len(data), checksum=checksum(self.checksum_algo, data))
            _confirm(fence)
            self.backend.put(shard_key(step, name), data)
            return entry

        names = list(payload)
        workers = max(1, min(self.num_threads, len(names)))
        try:
            if workers == 1:
                return {name: write(name) for name in names}
            with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="ckpt-write") as pool:
                futures = {name: pool.submit(write, name) for name in names}
                try:
                    return {name: future.result() for name, future in futures.items()}
                except BaseException:
                    for future in futures.values():
                        future.cancel()
                    raise
        except BaseException:
            # Never committed, so never visible; removing the pieces only saves space, and
            # retention removes them later if this fails too. Not without the fence: the
            # folder may hold another writer's save of this step by now.
            try:
                _confirm(fence)
                self.backend.delete_prefix(f"{step_dir(step)}/")
            except Exception as cleanup:
                logger.warning("could not remove the partial checkpoint %s: %s", self.checkpoint_uri(step), cleanup)
            raise

    def _clear_step(self, step: int, fence: Optional[Fence]) -> None:
        existing = {info.key for info in self.backend.list(f"{step_dir(step)}/")}
        if not existing:
            return
        if manifest_key(step) in existing:
            logger.warning("replacing committed checkpoint %s", self.checkpoint_uri(step))
        self._delete_step(step, fence)

    def _delete_step(self, step: int, fence: Optional[Fence]) -> None:
        # The manifest goes first: once it is gone the checkpoint no longer exists, whatever
        # happens to the deletion of its shards.
        _confirm(fence)
        self.backend.delete([manifest_key(step)])
        _confirm(fence)
        self.backend.delete_prefix(f"{step_dir(step)}/")

    def _apply_retention(self, saved: int, fence: Optional[Fence]) -> tuple[int, ...]:
        """Delete committed checkpoints beyond the newest ``keep`` and dead saves older than ``saved``.

        A failure stops retention with a warning (the checkpoint is committed: failing to delete
        old ones must not fail the save), except the fence's: that one ends the save."""
        deleted: list[int] = []
        try:
            folders = self._scan()
            committed = [folder.step for folder in folders if folder.committed]
            kept = set(committed[: self.keep]) | {saved}
            newer = [step for step in committed if step > saved]
            if newer:
                logger.warning(
                    "saved step %d under %s, but newer checkpoints exist (steps %s): latest_valid() prefers them; "
                    "delete them if training rolled back past them",
                    saved, self.uri, ", ".join(map(str, newer)),
                )
            # An uncommitted folder older than the step just saved is a save that died.
            doomed = [f.step for f in folders if f.step not in kept and (f.committed or f.step < saved)]
        except Exception as exc:
            logger.warning("retention under %s failed, old checkpoints remain: %s", self.uri, exc)
            return ()
        for step in doomed:
            logger.info("retention (keep=%d) deletes checkpoint %s", self.keep, self.checkpoint_uri(step))
            try:
                self._delete_step(step, fence)
            except FenceLost:
                raise
            except Exception as exc:
                logger.warning("retention under %s failed, old checkpoints remain: %s", self.uri, exc)
                break
            deleted.append(step)
        return tuple(deleted)

    def _scan(self) -> builtins.list[_StepObjects]:
        """Every step folder under the root with its objects, newest first (one listing)."""
        folders: dict[int, _StepObjects] = {}
        for info in self._list_all():
            head, _, rest = info.key.partition("/")
            step = parse_step_dir(head)
            if step is None or not rest:
                continue
            folder = folders.setdefault(step, _StepObjects(step))
            # A leftover temporary file still makes its folder known, so retention can remove it.
            if not rest.rsplit("/", 1)[-1].startswith(TEMP_PREFIX):
                folder.sizes[rest] = info.size
        return [folders[step] for step in sorted(folders, reverse=True)]

    def _list_all(self) -> Iterable[ObjectInfo]:
        return self._retrying(f"list {self.uri}", lambda: list(self.backend.list("")))

    def _retrying(self, what: str, op: Callable[[], T]) -> T:
        for attempt in range(1, self.commit_attempts + 1):
            try:
                return op()
            except Exception as exc:
                if attempt == self.commit_attempts or not self.backend.is_transient(exc):
                    raise
                # Exponential backoff with jitter, so that many writers do not retry in lockstep.
                delay = min(10.0, self.backoff_s * 2 ** (attempt - 1)) * random.uniform(0.5, 1.0)
                logger.warning(
                    "%s failed (attempt %d of %d): %s; retrying in %.2fs",
                    what, attempt, self.commit_attempts, exc, delay,
                )
                self._sleep(delay)
        raise AssertionError("unreachable: the last attempt returns or raises")


def _size_problem(name: str, size: int, expected: int, object_uri: str) -> str:
    if size < expected:
        return f"shard {name!r} is truncated: {size} of {expected} bytes ({object_uri})"
    return f"shard {name!r} has {size} bytes, the manifest says {expected} ({object_uri})"


def open_store(
    uri: str,
    *,
    keep: int = 3,
    num_threads: int = 8,
    checksum_algo: str = DEFAULT_CHECKSUM_ALGO,
    endpoint_url: Optional[str] = None,
    s3_options: Optional[S3Options] = None,
    commit_attempts: int = 5,
) -> CheckpointStore:
    """A store for ``file:///abs/path``, a plain path, or ``s3://bucket/prefix``.

    Opening touches nothing: folders are made on the first save, and an S3 client on first use.
    For S3, ``endpoint_url`` overrides the endpoint boto3 would take from the environment
    (``AWS_ENDPOINT_URL``); ``s3_options`` sets part sizes, retries and the listing page size.
    """
    backend: ObjectBackend
    if uris.is_s3(uri):
        # Imported here so that file stores never pay for importing boto3.
        from ringtrain.checkpoint.s3 import S3Backend, parse_s3_uri

        bucket, prefix = parse_s3_uri(uri)
        s3 = s3_options if s3_options is not None else S3Options()
        if endpoint_url is not None:
            s3 = replace(s3, endpoint_url=endpoint_url)
        backend = S3Backend(bucket, prefix, s3)
    elif not uris.is_known(uri):
        raise ValueError(f"checkpoint URI {uri!r}: supported schemes are {', '.join(uris.SCHEMES)} (or a plain path)")
    elif endpoint_url is not None or s3_options is not None:
        raise ValueError(f"checkpoint URI {uri!r}: endpoint_url and s3_options apply to s3:// URIs only")
    else:
        backend = FileBackend(file_root(uri))
    return CheckpointStore(
        backend, keep=keep, num_threads=num_threads, checksum_algo=checksum_algo, commit_attempts=commit_attempts
    )
