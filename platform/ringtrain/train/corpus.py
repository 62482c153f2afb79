"""A prepared dataset as the trainer reads it: its manifest, and its shards opened on demand.

The format is ``ringtrain.prepared``'s. A local dataset's shards are memory-mapped where they
lie; an ``s3://`` dataset's shards are fetched the first time a sample touches them into a cache
folder on the node's disk (written under a temporary name and renamed, so a reader never sees a
half-written file, and several workers of one node share one copy). No shard is read before a
sample needs it, so step 1 waits for the shards of its own samples, never for the corpus.

Every shard file is checked against the manifest's sha256 once per process, on first use (off
the critical path when the data prefetcher asks for it a step ahead). A cached copy that fails
the check is fetched again; a source file that fails it raises a DataError naming the shard.

The corpus is one token stream: its shards in order (each document ends with EOS, and none
spans two shards, so the stream is the documents joined end to end). Offsets below are
positions in that stream.
"""

from __future__ import annotations

import hashlib
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Optional

import numpy as np

from ringtrain.cachedir import data_cache_dir, write_cached
from ringtrain.errors import DataError
from ringtrain.prepared import MANIFEST_NAME, MAX_MANIFEST_BYTES, SHARD_DIR, Manifest, ShardInfo, sha256_file
from ringtrain.uris import is_s3, local_path


def is_prepared_path(path: str) -> bool:
    """Whether ``path`` names a prepared dataset (complete or not): an s3:// prefix, or a folder
    holding a manifest or a ``shards/`` folder (one without a manifest was never finished)."""
    if is_s3(path):
        return True
    local = local_path(path)
    return local is not None and local.is_dir() and ((local / MANIFEST_NAME).exists() or (local / SHARD_DIR).is_dir())


def _s3_backend(uri: str) -> Any:
    # The checkpoint store's S3 client (endpoint and credentials from the AWS environment,
    # standard retries): one way to reach S3 in the platform. Imported here: boto3 only for s3://.
    from ringtrain.checkpoint.options import S3Options
    from ringtrain.checkpoint.s3 import S3Backend, parse_s3_uri

    bucket, prefix = parse_s3_uri(uri)
    return S3Backend(bucket, prefix, S3Options())


def read_manifest(uri: str) -> Manifest:
    """The manifest of the dataset at ``uri``; DataError when it is missing or malformed."""
    uri = uri.rstrip("/")  # as PreparedCorpus names a dataset: s3://b/p/ is s3://b/p
    if not is_s3(uri):
        return Manifest.load(uri)
    from ringtrain.checkpoint.backends import ObjectMissing

    try:
        text = _s3_backend(uri).get(MANIFEST_NAME, limit=MAX_MANIFEST_BYTES)
    except ObjectMissing:
        raise DataError(f"{uri}/{MANIFEST_NAME}: no manifest; {uri} is not a prepared dataset (run `ringtrain prepare`)") from None
    except Exception as exc:  # boto3's errors (credentials, network) are many; name the object
        from ringtrain.checkpoint.s3_access import cause

        said = cause(exc) or f"{type(exc).__name__}: {exc}"
        raise DataError(f"{uri}/{MANIFEST_NAME}: cannot read: {said}") from None
    return Manifest.loads(text, f"{uri}/{MANIFEST_NAME}")


class PreparedCorpus:
    """Token stream and document offsets of one prepared dataset, read shard by shard."""

    def __init__(self, uri: str, *, cache_dir: str = "", manifest: Optional[Manifest] = None) -> None:
        self.uri = uri.rstrip("/")
        self.manifest = manifest if manifest is not None else read_manifest(self.uri)
        self.shards: list[ShardInfo] = self.manifest.shards
        if not self.shards:
            raise DataError(f"{self.uri}: the manifest lists no shards")
        self.dtype = np.dtype(self.manifest.dtype)
        self.eos_id = self.manifest.tokenizer.eos_id
        sizes = np.array([s.num_tokens for s in self.shards], dtype=np.int64)
        self.token_starts = np.concatenate(([0], np.cumsum(sizes)))  # stream offset of each shard
        docs = np.array([s.num_documents for s in self.shards], dtype=np.int64)
        self.doc_index_starts = np.concatenate(([0], np.cumsum(docs)))  # first document of each shard
        self.num_tokens = int(self.token_starts[-1])
        self._remote = _s3_backend(self.uri) if is_s3(self.uri) else None
        root = local_path(self.uri)
        cache_key = hashlib.sha256(self.uri.encode()).hexdigest()[:16]
        self._root = root if root is not None else data_cache_dir(cache_dir) / cache_key
        self._lock = threading.Lock()
        self._opened: dict[tuple[int, str], Future[np.ndarray]] = {}
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="ringtrain-shards")

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError("a PreparedCorpus holds open files and threads; pass its uri instead")

    # ---- shards ---------------------------------------------------------------------------

    def shard(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        """(tokens, document starts) of shard ``index``, memory-mapped and verified."""
        return self._future(index, "tokens").result(), self.docs(index)

    def docs(self, index: int) -> np.ndarray:
        """Document start offsets of shard ``index`` (its small file alone)."""
        return self._future(index, "docs").result()

    def prefetch(self, index: int) -> None:
        """Start fetching and verifying shard ``index`` in the background."""
        if 0 <= index < len(self.shards):
            self._future(index, "tokens")
            self._future(index, "docs")

    def _future(self, index: int, kind: str) -> Future[np.ndarray]:
        with self._lock:
            future = self._opened.get((index, kind))
            if future is None or (future.done() and future.exception() is not None):
                opener = {"tokens": self._open_tokens, "docs": self._open_docs, "mask": self._open_mask}[kind]
                future = self._pool.submit(opener, index)
                self._opened[(index, kind)] = future
            return future

    def _open_tokens(self, index: int) -> np.ndarray:
        info = self.shards[index]
        tokens = np.load(self._verified(info.tokens, info.tokens_sha256, index), mmap_mode="r")
        if tokens.ndim != 1 or tokens.dtype != self.dtype or len(tokens) != info.num_tokens:
            raise DataError(f"{self._name(info.tokens)}: want {info.num_tokens} tokens of {self.dtype}, "
                            f"found a {tokens.ndim}-D {tokens.dtype} array of {tokens.size}")
        return tokens

    def _open_docs(self, index: int) -> np.ndarray:
        info = self.shards[index]
        docs = np.load(self._verified(info.docs, info.docs_sha256, index))
        if docs.ndim != 1 or len(docs) != info.num_documents + 1 or docs[0] != 0 or docs[-1] != info.num_tokens:
            raise DataError(f"{self._name(info.docs)}: document offsets do not match the manifest "
                            f"({info.num_documents} documents, {info.num_tokens} tokens)")
        return docs.astype(np.int64, copy=False)

    def _open_mask(self, index: int) -> np.ndarray:
        info = self.shards[index]
        relative = getattr(info, "mask", None) or info.tokens.replace(".tokens.npy", ".mask.npy")
        sha256 = getattr(info, "mask_sha256", None)
        path = self._verified(relative, sha256, index) if sha256 else self._root / relative
        if not path.is_file():
            raise DataError(f"{self._name(relative)}: shard {index}'s loss mask is missing")
        mask = np.load(path, mmap_mode="r")
        if mask.ndim != 1 or mask.dtype != np.uint8 or len(mask) != info.num_tokens:
            raise DataError(f"{self._name(relative)}: want a loss mask of {info.num_tokens} uint8, "
                            f"found a {mask.ndim}-D {mask.dtype} array of {mask.size}")
        return mask

    def _name(self, relative: str) -> str:
        return f"{self.uri}/{relative}"

    def _verified(self, relative: str, sha256: str, index: int) -> Path:
        """A local copy of shard file ``relative`` whose bytes match ``sha256``."""
        path = self._root / relative
        if self._remote is None:
            if not path.is_file():
                raise DataError(f"{self._name(relative)}: shard {index} is missing")
            if sha256_file(path) != sha256:
                raise DataError(f"{self._name(relative)}: shard {index} fails its sha256 check against the manifest")
            return path
        if path.is_file() and sha256_file(path) == sha256:
            return path
        # Missing, or a cached copy that went bad (a crash mid-write cannot leave one: see below).
        try:
            data = self._remote.get(relative)
        except Exception as exc:  # the endpoint gone, the credentials expired: one line, not botocore's
            from ringtrain.checkpoint.s3_access import cause

            said = cause(exc)
            if said is None:
                raise
            raise DataError(f"{self._name(relative)}: shard {index} cannot be fetched: {said}") from None
        if hashlib.sha256(data).hexdigest() != sha256:
            raise DataError(f"{self._name(relative)}: shard {index} fails its sha256 check against the manifest")
        write_cached(path, data)  # atomic, through an exclusively opened temp file
        return path

    # ---- the token stream -----------------------------------------------------------------

    def shard_of(self, offset: int) -> int:
        return int(np.searchsorted(self.token_starts, offset, side="right") - 1)

    def tokens(self, start: int, stop: int) -> np.ndarray:
        """Stream tokens ``[start, stop)`` as int64, read across shard boundaries."""
        if not 0 <= start <= stop <= self.num_tokens:
            raise DataError(f"{self.uri}: tokens [{start}, {stop}) outside the stream of {self.num_tokens}")
        parts, pos = [], start
        while pos < stop:
            i = self.shard_of(pos)
            self.prefetch(i + 1)  # the stream runs on into the next shard sooner or later
            tokens = self._future(i, "tokens").result()
            end = min(stop, int(self.token_starts[i + 1]))
            parts.append(np.asarray(tokens[pos - self.token_starts[i] : end - self.token_starts[i]], dtype=np.int64))
            pos = end
        return np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)

    @property
    def is_chat(self) -> bool:
        """Whether the dataset holds conversations with loss masks (``prepare --format chat``)."""
        return getattr(self.manifest, "content", "text") == "chat"

    @property
    def is_preference(self) -> bool:
        """Whether the dataset holds preference pairs, three documents a pair (``prepare --format
        preference``)."""
        return getattr(self.manifest, "content", "text") == "preference"

    def mask(self, start: int, stop: int) -> np.ndarray:
        """The loss mask of stream tokens ``[start, stop)`` of a chat dataset (1: a trained
        target), read across shard boundaries."""
        parts, pos = [], start
        while pos < stop:
            i = self.shard_of(pos)
            mask = self._future(i, "mask").result()
            end = min(stop, int(self.token_starts[i + 1]))
            parts.append(np.asarray(mask[pos - self.token_starts[i] : end - self.token_starts[i]], dtype=np.uint8))
            pos = end
        return np.concatenate(parts) if parts else np.empty(0, dtype=np.uint8)

    def document_span(self, document: int) -> tuple[int, int]:
        """Stream offsets ``[start, stop)`` of document ``document`` (over the whole dataset)."""
        i = int(np.searchsorted(self.doc_index_starts, document, side="right") - 1)
        docs = self.docs(i)
        local = document - int(self.doc_index_starts[i])
        base = int(self.token_starts[i])
        return base + int(docs[local]), base + int(docs[local + 1])

    def doc_starts_in(self, start: int, stop: int) -> np.ndarray:
        """Stream offsets of the document starts in ``(start, stop)``: the boundaries inside."""
        out, pos = [], start
        while pos < stop:
            i = self.shard_of(pos)
            docs = self.docs(i)
            base = int(self.token_starts[i])
            inside = docs[:-1] + base  # its last entry is the next shard's first start
            out.append(inside[(inside > start) & (inside < stop)])
            pos = int(self.token_starts[i + 1])
        return np.concatenate(out) if out else np.empty(0, dtype=np.int64)

    def document_at(self, offset: int) -> int:
        """Index (over the whole dataset) of the document holding stream token ``offset``."""
        i = self.shard_of(offset)
        docs = self.docs(i)
        return int(self.doc_index_starts[i]) + int(np.searchsorted(docs, offset - self.token_starts[i], side="right") - 1)

    def document_lengths(self) -> np.ndarray:
        """Every document's length in tokens, in stream order (reads every shard's offsets)."""
        futures = [self._future(i, "docs") for i in range(len(self.shards))]
        return np.concatenate([np.diff(f.result()) for f in futures])

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

