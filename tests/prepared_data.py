"""Small prepared datasets written directly with numpy and the manifest dataclasses, so reader
tests do not depend on the Ray pipeline that ``ringtrain prepare`` runs."""

from __future__ import annotations

import hashlib
import io
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from ringtrain.prepared import Manifest, ShardInfo, SourceInfo, TokenizerInfo, shard_paths, token_dtype_for


def npy_bytes(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()


def random_documents(num_docs: int, *, vocab_size: int, eos_id: int, min_len: int, max_len: int, seed: int = 0) -> list[np.ndarray]:
    """Documents of random content (never EOS inside), each ending with EOS."""
    rng = np.random.default_rng(seed)
    docs = []
    for _ in range(num_docs):
        body = rng.integers(0, vocab_size - 1, size=int(rng.integers(min_len, max_len + 1)) - 1)
        body[body >= eos_id] += 1  # skip the EOS id
        docs.append(np.append(body, eos_id).astype(np.int64))
    return docs


def write_prepared(
    root: Path,
    docs: Sequence[np.ndarray],
    *,
    vocab_size: int,
    eos_id: int,
    docs_per_shard: int = 4,
    tokenizer_sha256: str = "0" * 64,
    tokenizer_name: str = "test",
) -> Manifest:
    """Write ``docs`` (each already ending with EOS) as a prepared dataset under ``root``."""
    dtype = token_dtype_for(vocab_size)
    shards = []
    for index, first in enumerate(range(0, len(docs), docs_per_shard)):
        group = docs[first : first + docs_per_shard]
        tokens = np.concatenate(group).astype(dtype)
        offsets = np.concatenate(([0], np.cumsum([len(d) for d in group]))).astype(np.int64)
        tokens_rel, docs_rel = shard_paths(index)
        blobs = {tokens_rel: npy_bytes(tokens), docs_rel: npy_bytes(offsets)}
        for rel, blob in blobs.items():
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            (root / rel).write_bytes(blob)
        shards.append(ShardInfo(tokens_rel, docs_rel, len(group), int(tokens.size),
                                hashlib.sha256(blobs[tokens_rel]).hexdigest(), hashlib.sha256(blobs[docs_rel]).hexdigest()))
    num_tokens = sum(s.num_tokens for s in shards)
    manifest = Manifest(
        dtype=dtype,
        num_documents=len(docs),
        num_tokens=num_tokens,
        tokenizer=TokenizerInfo(tokenizer_name, tokenizer_sha256, vocab_size, eos_id),
        sources=[SourceInfo("test.jsonl", len(docs), num_tokens)],
        shards=shards,
        command=["test"],
    )
    (root / "manifest.json").write_text(manifest.dumps())
    return manifest
