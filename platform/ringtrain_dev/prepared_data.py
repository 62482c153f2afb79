"""Small prepared datasets (text, and chat with its loss masks) written directly with numpy and the
manifest dataclasses, so reader tests do not depend on the Ray pipeline that ``ringtrain prepare`` runs."""

from __future__ import annotations

import hashlib
import io
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Optional

import numpy as np

from ringtrain.prepared import (
    ChatInfo,
    Manifest,
    ShardInfo,
    SourceInfo,
    TokenizerInfo,
    mask_path,
    shard_paths,
    token_dtype_for,
)


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
    return _write(root, docs, None, None, vocab_size=vocab_size, eos_id=eos_id, docs_per_shard=docs_per_shard,
                  tokenizer_sha256=tokenizer_sha256, tokenizer_name=tokenizer_name)


def chat_info(train_on: str = "assistant", mask_source: str = "generation") -> ChatInfo:
    """A manifest's chat section for a dataset written without a template (the hash is a placeholder)."""
    return ChatInfo("0" * 64, "chat_template.jinja", train_on, mask_source, "messages")


def write_chat_prepared(
    root: Path,
    conversations: Sequence[tuple[np.ndarray, np.ndarray]],
    *,
    vocab_size: int,
    eos_id: int = 2,
    docs_per_shard: int = 4,
    chat: Optional[ChatInfo] = None,
    tokenizer_sha256: str = "0" * 64,
    tokenizer_name: str = "test",
) -> Manifest:
    """Write ``conversations`` ((tokens, mask) pairs, mask 1 where a token is a trained target) as a
    chat dataset under ``root``: a mask beside every shard, ``content: chat`` and the chat section
    (``chat``, else ``chat_info()``) with the trained-token count."""
    for i, (tokens, mask) in enumerate(conversations):
        assert len(tokens) == len(mask) and len(tokens) > 0, f"conversation {i}: tokens and mask differ in length"
    info = replace(chat or chat_info(), num_trained_tokens=int(sum(int(np.count_nonzero(m)) for _, m in conversations)))
    return _write(root, [t for t, _ in conversations], [m for _, m in conversations], info, vocab_size=vocab_size,
                  eos_id=eos_id, docs_per_shard=docs_per_shard, tokenizer_sha256=tokenizer_sha256,
                  tokenizer_name=tokenizer_name)


def _write(
    root: Path,
    docs: Sequence[np.ndarray],
    masks: Optional[Sequence[np.ndarray]],
    chat: Optional[ChatInfo],
    *,
    vocab_size: int,
    eos_id: int,
    docs_per_shard: int,
    tokenizer_sha256: str,
    tokenizer_name: str,
) -> Manifest:
    dtype = token_dtype_for(vocab_size)
    shards = []
    for index, first in enumerate(range(0, len(docs), docs_per_shard)):
        group = docs[first : first + docs_per_shard]
        tokens = np.concatenate(group).astype(dtype)
        offsets = np.concatenate(([0], np.cumsum([len(d) for d in group]))).astype(np.int64)
        tokens_rel, docs_rel = shard_paths(index)
        blobs = {tokens_rel: npy_bytes(tokens), docs_rel: npy_bytes(offsets)}
        if masks is not None:
            blobs[mask_path(index)] = npy_bytes(np.concatenate(masks[first : first + docs_per_shard]).astype(np.uint8))
        for rel, blob in blobs.items():
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            (root / rel).write_bytes(blob)
        sums = {rel: hashlib.sha256(blob).hexdigest() for rel, blob in blobs.items()}
        mask = mask_path(index) if masks is not None else None
        shards.append(ShardInfo(tokens_rel, docs_rel, len(group), int(tokens.size), sums[tokens_rel], sums[docs_rel],
                                mask, sums[mask] if mask is not None else None))  # fmt: skip
    num_tokens = sum(s.num_tokens for s in shards)
    manifest = Manifest(
        dtype=dtype,
        num_documents=len(docs),
        num_tokens=num_tokens,
        tokenizer=TokenizerInfo(tokenizer_name, tokenizer_sha256, vocab_size, eos_id),
        sources=[SourceInfo("test.jsonl", len(docs), num_tokens)],
        shards=shards,
        command=["test"],
        content="chat" if chat is not None else "text",
        chat=chat,
    )
    (root / "manifest.json").write_text(manifest.dumps())
    return manifest
