"""Where a prepared dataset is written: token shards packed in document order, staged, then published.

Shards are cut from the ordered stream of documents by a token budget: a shard takes documents
until the next one would pass ``shard_tokens`` (a document longer than that gets a shard of its
own), so shard boundaries depend on the documents alone, never on how the work was split.
Tokens stream to disk as they come: memory holds one shard's document lengths, not its tokens.

Everything goes under a temporary location first (a hidden sibling folder, or a sibling S3
prefix) and the manifest is written last; a failure removes the staging area and leaves the
output as it was.

``--overwrite`` replaces only a dataset ringtrain wrote: the output must hold a readable
manifest of this format and nothing it does not list (the manifest and its shards). A folder or
prefix holding anything else, a user's files or another tool's output, is refused, naming what
is in the way: replacing it would delete what ringtrain did not write.
"""

from __future__ import annotations

import hashlib
import io
import shutil
import tempfile
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO, Optional

import numpy as np

from ringtrain.errors import ConfigError, DataError
from ringtrain.folderswap import DestinationAppeared, swap_in
from ringtrain.prepared import DOCS_DTYPE, MANIFEST_NAME, Manifest, ShardInfo, mask_path, shard_paths
from ringtrain.uris import local_path

OUT_KEY = "--out"
COPY_CHUNK = 8 << 20


def _npy_header(dtype: np.dtype, count: int) -> bytes:
    """The .npy header np.save writes for a 1-D array of ``count`` elements (format 1.0)."""
    buffer = io.BytesIO()
    header = {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False, "shape": (count,)}
    np.lib.format.write_array_header_1_0(buffer, header)
    return buffer.getvalue()


def _write_npy(dest: Path, dtype: np.dtype, count: int, body: BinaryIO) -> str:
    """Write header + ``body``'s bytes to ``dest``; the file's sha256."""
    digest = hashlib.sha256()
    with open(dest, "wb") as out:
        header = _npy_header(dtype, count)
        digest.update(header)
        out.write(header)
        while chunk := body.read(COPY_CHUNK):
            digest.update(chunk)
            out.write(chunk)
    return digest.hexdigest()


class ShardBuilder:
    """One shard under construction: tokens (and a chat shard's mask) appended to raw files,
    document lengths in memory."""

    def __init__(self, folder: Path, index: int, dtype: np.dtype, chat: bool = False) -> None:
        self.index, self.dtype, self.folder = index, dtype, folder
        self.tokens_rel, self.docs_rel = shard_paths(index)
        self._raw_path = folder / (self.tokens_rel + ".raw")
        self._raw_path.parent.mkdir(parents=True, exist_ok=True)
        self._raw = open(self._raw_path, "wb")
        self.mask_rel = mask_path(index) if chat else None
        self._mask_raw = open(folder / (self.mask_rel + ".raw"), "wb") if self.mask_rel else None
        self._lengths: list[np.ndarray] = []
        self.num_tokens = 0
        self.num_documents = 0

    def add(self, tokens: np.ndarray, lengths: np.ndarray, mask: Optional[np.ndarray] = None) -> None:
        if (mask is None) != (self._mask_raw is None) or (mask is not None and mask.size != tokens.size):
            raise ValueError(f"shard {self.index}: a chat shard takes a mask as long as its tokens, a text shard none")
        self._raw.write(np.ascontiguousarray(tokens, dtype=self.dtype).tobytes())
        if self._mask_raw is not None and mask is not None:
            self._mask_raw.write(np.ascontiguousarray(mask, dtype=np.uint8).tobytes())
        self._lengths.append(lengths)
        self.num_tokens += int(tokens.size)
        self.num_documents += int(lengths.size)

    def finish(self) -> ShardInfo:
        """Write the shard's two .npy files (the raw file becomes the tokens' body)."""
        self._raw.close()
        with open(self._raw_path, "rb") as raw:
            tokens_sha = _write_npy(self.folder / self.tokens_rel, self.dtype, self.num_tokens, raw)
        self._raw_path.unlink()
        offsets = np.zeros(self.num_documents + 1, dtype=DOCS_DTYPE)
        np.cumsum(np.concatenate(self._lengths), out=offsets[1:])
        body = io.BytesIO(offsets.tobytes())
        docs_sha = _write_npy(self.folder / self.docs_rel, offsets.dtype, offsets.size, body)
        mask_sha = None
        if self._mask_raw is not None and self.mask_rel is not None:
            self._mask_raw.close()
            raw_mask = self.folder / (self.mask_rel + ".raw")
            with open(raw_mask, "rb") as raw:
                mask_sha = _write_npy(self.folder / self.mask_rel, np.dtype(np.uint8), self.num_tokens, raw)
            raw_mask.unlink()
        return ShardInfo(self.tokens_rel, self.docs_rel, self.num_documents, self.num_tokens, tokens_sha, docs_sha,
                         self.mask_rel, mask_sha)  # fmt: skip

    def discard(self) -> None:
        self._raw.close()
        if self._mask_raw is not None:
            self._mask_raw.close()


class Packer:
    """Documents in order -> shards of at most ``shard_tokens`` tokens; ``on_shard`` gets each
    finished one. ``chat``: every document comes with its loss mask, written beside the tokens."""

    def __init__(
        self, folder: Path, dtype: np.dtype, shard_tokens: int, on_shard: Callable[[ShardInfo], None], chat: bool = False
    ) -> None:
        if shard_tokens < 1:
            raise ConfigError("--shard-tokens", f"must be positive, got {shard_tokens}")
        self.folder, self.dtype, self.shard_tokens, self.on_shard = folder, dtype, shard_tokens, on_shard
        self.chat = chat
        self.shards: list[ShardInfo] = []
        self._current: Optional[ShardBuilder] = None

    def add(self, tokens: np.ndarray, lengths: np.ndarray, mask: Optional[np.ndarray] = None) -> None:
        """Documents ``lengths`` (tokens each, EOS included) laid end to end in ``tokens``; a chat
        dataset's ``mask`` is as long as ``tokens``."""
        first, pos = 0, 0
        while first < lengths.size:
            shard = self._current or self._open()
            ends = np.cumsum(lengths[first:])
            fit = int(np.searchsorted(ends, self.shard_tokens - shard.num_tokens, side="right"))
            if fit == 0 and shard.num_documents:
                self._close()
                continue
            fit = max(fit, 1)  # a document longer than a whole shard fills one alone
            size = int(ends[fit - 1])
            shard.add(tokens[pos : pos + size], lengths[first : first + fit], None if mask is None else mask[pos : pos + size])
            first, pos = first + fit, pos + size
            if shard.num_tokens >= self.shard_tokens or first < lengths.size:
                self._close()

    def finish(self) -> list[ShardInfo]:
        if self._current is not None and self._current.num_documents:
            self._close()
        return self.shards

    def discard(self) -> None:
        if self._current is not None:
            self._current.discard()

    def _open(self) -> ShardBuilder:
        self._current = ShardBuilder(self.folder, len(self.shards), self.dtype, self.chat)
        return self._current

    def _close(self) -> None:
        assert self._current is not None
        info = self._current.finish()
        self._current = None
        self.shards.append(info)
        self.on_shard(info)


def _files(shard: ShardInfo) -> tuple[str, ...]:
    """The files of a shard, relative to the dataset root: tokens, docs and a chat shard's mask."""
    return (shard.tokens, shard.docs) if shard.mask is None else (shard.tokens, shard.docs, shard.mask)


class LocalOutput:
    """A local folder: staged in a hidden sibling folder, published by renaming it into place.

    What is at the folder may change while prepare runs (for hours, on a shared file system): it
    is judged again when it is replaced, once moved aside where nothing else can add to it, and
    put back untouched unless ``--overwrite`` may replace it (``check_replaceable``). The staged
    dataset is then kept, and the error says where."""

    def __init__(self, root: Path, uri: str = "", overwrite: bool = False) -> None:
        self.root, self.uri, self.overwrite = root, uri or str(root), overwrite
        self.staging = root.parent / f".{root.name}.partial-{uuid.uuid4().hex[:8]}"
        self.kept = False  # the staged dataset outlives a refused publish

    def exists(self) -> bool:
        return self.root.exists() and (not self.root.is_dir() or any(self.root.iterdir()))

    def contents(self) -> tuple[Optional[str], list[str]]:
        return _folder_contents(self.root)

    def begin(self) -> Path:
        self.staging.mkdir(parents=True)
        return self.staging

    def shard_written(self, info: ShardInfo) -> None:
        """Shards are written in place in the staging folder: nothing to move."""

    def publish(self, manifest: Manifest) -> None:
        (self.staging / MANIFEST_NAME).write_text(manifest.dumps())
        try:
            swap_in(self.staging, self.root, self._judge)
        except ConfigError as exc:
            raise self._refused(exc.reason) from None
        except DestinationAppeared as exc:
            kept = f"; the dataset it was to replace is at {exc.aside}" if exc.aside is not None else ""
            raise self._refused(f"{self.uri} appeared while preparing ({exc.reason}){kept}") from None

    def _judge(self, moved: Path) -> None:
        """ConfigError unless what was at the folder (now at ``moved``) may be replaced: nothing,
        an empty folder, or with --overwrite a dataset of ours and nothing else."""
        if moved.is_symlink() or not moved.is_dir():
            raise ConfigError(OUT_KEY, f"{self.uri} is a file or a link, not a folder")
        if any(moved.iterdir()):
            may_replace(self.uri, self.overwrite, lambda: _folder_contents(moved))

    def _refused(self, reason: str) -> ConfigError:
        self.kept = True
        return kept_at(reason, str(self.staging))

    def abort(self) -> None:
        if not self.kept:
            shutil.rmtree(self.staging, ignore_errors=True)


def _folder_contents(folder: Path) -> tuple[Optional[str], list[str]]:
    """A local output folder's manifest text (None when there is none) and every entry's
    relative path (files, links and empty folders)."""
    manifest = folder / MANIFEST_NAME
    text = manifest.read_text(encoding="utf-8", errors="replace") if manifest.is_file() else None
    entries = []
    for path in sorted(folder.rglob("*")):
        if path.is_file() or path.is_symlink() or (path.is_dir() and not any(path.iterdir())):
            entries.append(str(path.relative_to(folder)))
    return text, entries


class S3Output:
    """An s3:// prefix: shards uploaded under a sibling staging prefix, copied into place, manifest last.

    S3 has no rename, so what is under the prefix is judged again just before the copy (prepare
    may run for hours, and something may have been written there meanwhile): a refused publish
    writes the manifest into the staging prefix instead, a whole dataset there, and names it."""

    def __init__(self, uri: str, overwrite: bool = False) -> None:
        from ringtrain.checkpoint.options import S3Options
        from ringtrain.checkpoint.s3 import S3Backend, parse_s3_uri
        from ringtrain.checkpoint.s3_access import check_reachable

        try:
            self.bucket, self.prefix = parse_s3_uri(uri)
        except ValueError:
            raise ConfigError(OUT_KEY, f"{uri}: expected s3://bucket/prefix") from None
        if not self.prefix:
            raise ConfigError(OUT_KEY, f"{uri}: name a prefix inside the bucket, not the bucket itself")
        check_reachable(uri, OUT_KEY)  # credentials, endpoint and bucket, before any pipeline starts
        self.root = S3Backend(self.bucket, self.prefix, S3Options())
        self.staging = S3Backend(self.bucket, f"{self.prefix}.partial-{uuid.uuid4().hex[:8]}", S3Options())
        self.uri, self.overwrite = uri, overwrite
        self.kept = False  # the staged dataset outlives a refused publish
        self._local: Optional[Path] = None

    def exists(self) -> bool:
        return any(True for _ in self.root.list())

    def contents(self) -> tuple[Optional[str], list[str]]:
        """The manifest's text (None when there is none) and every object's key below the prefix."""
        from ringtrain.checkpoint.backends import ObjectMissing

        keys = sorted(info.key for info in self.root.list())
        try:
            text: Optional[str] = self.root.get(MANIFEST_NAME).decode("utf-8", errors="replace")
        except ObjectMissing:
            text = None
        return text, keys

    def begin(self) -> Path:
        self._local = Path(tempfile.mkdtemp(prefix="rt-prepare-"))
        return self._local

    def _key(self, backend: Any, rel: str) -> str:
        return f"{backend.prefix}/{rel}"

    def shard_written(self, info: ShardInfo) -> None:
        assert self._local is not None
        for rel in _files(info):
            local = self._local / rel
            self.root.client.upload_file(str(local), self.bucket, self._key(self.staging, rel))
            local.unlink()  # local disk holds one shard at a time

    def publish(self, manifest: Manifest) -> None:
        try:
            self._judge()
        except ConfigError as exc:
            self.staging.put(MANIFEST_NAME, manifest.dumps().encode())
            self.kept = True
            raise kept_at(exc.reason, f"s3://{self.bucket}/{self.staging.prefix}") from None
        client: Any = self.root.client
        keep = {MANIFEST_NAME}
        # Readers never see a manifest naming a half-copied set: the old one goes first.
        self.root.delete([MANIFEST_NAME])
        for shard in manifest.shards:
            for rel in _files(shard):
                keep.add(rel)
                source = {"Bucket": self.bucket, "Key": self._key(self.staging, rel)}
                client.copy(source, self.bucket, self._key(self.root, rel))
        self.root.delete([info.key for info in self.root.list() if info.key not in keep])
        self.root.put(MANIFEST_NAME, manifest.dumps().encode())
        self.abort()

    def _judge(self) -> None:
        """ConfigError unless what is under the prefix now may be replaced: nothing, or with
        --overwrite a dataset of ours and nothing else."""
        if self.exists():
            may_replace(self.uri, self.overwrite, self.contents, taken="appeared while preparing")

    def abort(self) -> None:
        if self._local is not None:
            shutil.rmtree(self._local, ignore_errors=True)
        if not self.kept:
            self.staging.delete_prefix("")


Output = LocalOutput | S3Output


def open_output(uri: str, overwrite: bool) -> Output:
    """The output ``uri`` names; refused when it holds anything and ``overwrite`` is off, or
    holds anything but a dataset of ours when it is on."""
    path = local_path(uri)
    output: Output = LocalOutput(path.absolute(), uri, overwrite) if path is not None else S3Output(uri, overwrite)
    if path is not None and (path.is_symlink() or (path.exists() and not path.is_dir())):
        raise ConfigError(OUT_KEY, f"{uri} is a file or a link, not a folder")
    if output.exists():
        may_replace(uri, overwrite, output.contents)
    return output


def may_replace(uri: str, overwrite: bool, contents: Callable[[], tuple[Optional[str], list[str]]], *,
                taken: str = "already exists") -> None:
    """ConfigError unless what is at ``uri`` (``taken``: found there) may be replaced: with
    --overwrite, a dataset of ours and nothing else (``contents``, listed only then)."""
    if not overwrite:
        raise ConfigError(OUT_KEY, f"{uri} {taken}; pass --overwrite to replace it")
    check_replaceable(uri, *contents())


def kept_at(reason: str, staged: str) -> ConfigError:
    """A refused publish's error: why, and where the prepared dataset is kept instead."""
    return ConfigError(OUT_KEY, f"{reason}; nothing there was replaced, and the prepared dataset is kept at {staged}")


def check_replaceable(uri: str, manifest_text: Optional[str], entries: list[str]) -> None:
    """ConfigError unless ``entries`` are exactly a dataset's: a valid manifest and what it lists."""
    refuse = "--overwrite replaces only a dataset `ringtrain prepare` wrote; choose a new or empty --out"
    if manifest_text is None:
        raise ConfigError(OUT_KEY, f"{uri} holds no {MANIFEST_NAME} of a prepared dataset: {refuse}")
    try:
        manifest = Manifest.loads(manifest_text, f"{uri}/{MANIFEST_NAME}")
    except DataError as exc:
        raise ConfigError(OUT_KEY, f"{exc}; {refuse}") from None
    ours = {MANIFEST_NAME} | {rel for shard in manifest.shards for rel in _files(shard)}
    foreign = [entry for entry in entries if entry not in ours]
    if foreign:
        listed = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
        raise ConfigError(OUT_KEY, f"{uri} holds {listed}, which its manifest does not list: {refuse}")
