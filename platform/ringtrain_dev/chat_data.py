"""Small chat datasets for the training side's tests: random conversations with assistant-turn
loss masks, written as a prepared dataset in the chat format (docs/data.md), without the
tokenizer or the Ray pipeline that ``ringtrain prepare --format chat`` runs."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from ringtrain_dev.prepared_data import npy_bytes, write_prepared


def random_conversations(
    num: int, *, vocab_size: int, min_len: int, max_len: int, seed: int = 0
) -> list[tuple[np.ndarray, np.ndarray]]:
    """(tokens, mask) pairs: alternating user (mask 0) and assistant (mask 1) turns of random
    lengths; the first token is never a target."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(num):
        length = int(rng.integers(min_len, max_len + 1))
        tokens = rng.integers(3, vocab_size, size=length).astype(np.int64)
        mask = np.zeros(length, dtype=np.uint8)
        pos, assistant = 1, False
        while pos < length:
            turn = int(rng.integers(2, 7))
            mask[pos : pos + turn] = assistant
            pos, assistant = pos + turn, not assistant
        out.append((tokens, mask))
    return out


def write_chat(
    root: Path, conversations: Sequence[tuple[np.ndarray, np.ndarray]], *, vocab_size: int, eos_id: int = 2,
    docs_per_shard: int = 4,
) -> None:
    """Write ``conversations`` as a chat dataset: the text layout, a mask beside every shard, and
    the manifest's chat fields."""
    write_prepared(root, [t for t, _ in conversations], vocab_size=vocab_size, eos_id=eos_id,
                   docs_per_shard=docs_per_shard)
    manifest = json.loads((root / "manifest.json").read_text())
    for index, shard in enumerate(manifest["shards"]):
        group = conversations[index * docs_per_shard : (index + 1) * docs_per_shard]
        blob = npy_bytes(np.concatenate([m for _, m in group]).astype(np.uint8))
        relative = shard["tokens"].replace(".tokens.npy", ".mask.npy")
        (root / relative).write_bytes(blob)
        shard["mask"] = relative
        shard["sha256"]["mask"] = hashlib.sha256(blob).hexdigest()
    manifest["content"] = "chat"
    manifest["chat"] = {"template_sha256": "0" * 64, "template_file": "chat_template.jinja", "train_on": "assistant",
                        "mask_source": "generation", "messages_field": "messages"}
    (root / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True))


def chat_samples(root: Path, *, seq_len: int, seed: int, overlong: str = "drop", packing: str = "next_fit") -> object:
    """The dataset at ``root`` read as the trainer reads it (``MixedSamples``, doc packing)."""
    from ringtrain.train.corpus import PreparedCorpus
    from ringtrain.train.mixture import MixedSamples, SourceSpec

    corpus = PreparedCorpus(str(root))
    assert corpus.is_chat, f"{root} does not read as a chat dataset"
    return MixedSamples([corpus], [SourceSpec(str(root))], seq_len=seq_len, seed=seed, packing="doc",
                        chat_overlong=overlong, chat_packing=packing)


def conversation_lengths(num: int, *, seed: int, low: int = 47, high: int = 1018) -> np.ndarray:
    """Conversation lengths drawn log-uniformly from ``low`` to ``high`` tokens: many short ones,
    a long tail, as chat corpora have."""
    rng = np.random.default_rng(seed)
    return np.exp(rng.uniform(np.log(low), np.log(high), size=num)).astype(np.int64)
