"""The on-disk format of a prepared dataset (``ringtrain prepare``'s output): names, manifest, checks.

A prepared dataset is a folder (or an ``s3://`` prefix)::

    <root>/manifest.json              written last: its presence means the dataset is complete
    <root>/shards/00000.tokens.npy    1-D token ids, uint16 when the vocabulary fits, else uint32
    <root>/shards/00000.docs.npy      1-D int64 document start offsets into that shard's tokens,
                                      num_documents + 1 long, first 0, last num_tokens
    <root>/shards/00000.mask.npy      a chat dataset's only (manifest "content": "chat"): 1-D
                                      uint8 as long as the tokens, 1 where a token is a trained
                                      target (its prediction from the token before counts)

A chat dataset's documents are whole conversations as the tokenizer's chat template renders
them (no EOS appended; the template's end-of-turn tokens end each turn), and its manifest's
``chat`` section says how they were rendered and masked. A text document's tokens end with the
tokenizer's EOS id (prepare appends it), and a document
never spans two shards, so a reader can pack or split documents shard by shard. The manifest
holds no timestamps: the same input and options give the same bytes, manifest included.

This module is the format and its checks (stdlib only; the one file it reads is a local
manifest, or a tokenizer file to hash): the writer (``prepare/``, Ray) and the reader
(``train/``, numpy) both build on it, and neither imports the other.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

from ringtrain.errors import DataError
from ringtrain.jsonfile import TOO_DEEP, TOO_LARGE, JsonFileError, parse_json
from ringtrain.uris import local_path

FORMAT = "ringtrain-dataset/1"
MANIFEST_NAME = "manifest.json"
# A dataset's manifest is ~300 bytes a shard (40,000 shards of 256 MiB: 10T tokens, 12 MB) plus
# the skipped records it lists (at most 1,000, prepare/pipeline.py): one larger is not a manifest.
MAX_MANIFEST_BYTES = 256 << 20
# What a manifest the parser refused is, by the limit that failed (None: not JSON at all).
MANIFEST_REFUSED: dict[Optional[str], str] = {
    TOO_LARGE: f"over {MAX_MANIFEST_BYTES:,} bytes, not a manifest: not read",
    TOO_DEEP: "nests too deeply to be a manifest",
    None: "not valid JSON ({detail})",
}
SHARD_DIR = "shards"
TOKENS_SUFFIX = ".tokens.npy"
DOCS_SUFFIX = ".docs.npy"
MASK_SUFFIX = ".mask.npy"
# What a dataset's documents are: text (each ends with EOS) or conversations with a loss mask.
CONTENTS = ("text", "chat", "preference")
# Contents whose shards carry a loss mask and whose manifest a chat section (the template's).
MASKED_CONTENTS = ("chat", "preference")
# A preference dataset's documents come in threes: a pair's prompt, chosen and rejected completion.
PAIR_DOCUMENTS = 3
CHAT_TRAIN_ON = ("assistant", "last", "all")
# The roles of a conversation's messages, the turns --roles-to-train picks from.
CHAT_ROLES = ("system", "user", "assistant", "tool")
# Whether a trained turn's end-of-turn token trains: every turn's, the last trained turn's, none.
CHAT_TRAIN_ON_EOS = ("turn", "last", "none")
# Where a chat dataset's assistant masks came from: the template's {% generation %} markers, or
# the character spans between its renderings of the conversation's prefixes.
CHAT_MASK_SOURCES = ("generation", "prefix")
DOCS_DTYPE = "int64"
TOKEN_DTYPES = ("uint16", "uint32")
# Largest vocabulary whose ids (0 .. vocab_size - 1) all fit in a uint16.
UINT16_VOCAB_LIMIT = 1 << 16

# The byte-level tokenizer (``--tokenizer bytes``): one token per UTF-8 byte. EOS is the NUL
# byte: valid UTF-8 text never needs it (JSON and text corpora do not carry it), so it cannot be
# confused with content, and the vocabulary stays 256, what a byte-level model already has.
BYTES_TOKENIZER = "bytes"
BYTES_VOCAB_SIZE = 256
BYTES_EOS_ID = 0

PathLike = Union[str, Path]


def shard_paths(index: int) -> tuple[str, str]:
    """(tokens, docs) paths of shard ``index``, relative to the dataset root."""
    if index < 0:
        raise ValueError(f"shard index must be >= 0, got {index}")
    stem = f"{SHARD_DIR}/{index:05d}"
    return stem + TOKENS_SUFFIX, stem + DOCS_SUFFIX


def mask_path(index: int) -> str:
    """The loss mask of chat shard ``index``, relative to the dataset root."""
    return shard_paths(index)[0].removesuffix(TOKENS_SUFFIX) + MASK_SUFFIX


def token_dtype_for(vocab_size: int) -> str:
    """The narrowest token dtype of the format that holds every id below ``vocab_size``."""
    if vocab_size <= 0:
        raise ValueError(f"vocab_size must be positive, got {vocab_size}")
    return "uint16" if vocab_size <= UINT16_VOCAB_LIMIT else "uint32"


def sha256_file(path: PathLike, chunk_bytes: int = 8 << 20) -> str:
    """The sha256 of a file, read in chunks (shards are large)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()


def tokenizer_sha256(tokenizer_file: PathLike) -> str:
    """A tokenizer's identity as a manifest records it: the sha256 of its ``tokenizer.json``.
    ``ringtrain prepare`` records it and ``ringtrain run`` compares it with ``model.hf``'s."""
    return sha256_file(tokenizer_file)


def join(root: str, relative: str) -> str:
    """``relative`` (a manifest path) under dataset root ``root``, for local paths and URIs alike."""
    return f"{root.rstrip('/')}/{relative}"


def manifest_uri(root: PathLike) -> str:
    return join(str(root), MANIFEST_NAME)


def is_prepared(root: PathLike) -> bool:
    """Whether local folder ``root`` holds a published dataset (a stat, no read).

    Always False for ``s3://`` (no I/O here): a reader checks the remote manifest itself.
    """
    path = local_path(root)
    return path is not None and (path / MANIFEST_NAME).is_file()


# ---- the manifest ---------------------------------------------------------------------------


class _Fields:
    """Typed access to one JSON object of a manifest; errors name the file and the field."""

    def __init__(self, obj: Any, where: str, prefix: str) -> None:
        if not isinstance(obj, dict):
            raise DataError(f"{where}: {prefix or 'the manifest'} must be a JSON object")
        self.obj, self.where, self.prefix = obj, where, prefix

    def _fail(self, key: str, reason: str) -> DataError:
        return DataError(f"{self.where}: field {self.prefix}{key} {reason}")

    def raw(self, key: str) -> Any:
        if key not in self.obj:
            raise self._fail(key, "is missing")
        return self.obj[key]

    def str(self, key: str) -> str:
        value = self.raw(key)
        if not isinstance(value, str):
            raise self._fail(key, f"must be a string, got {value!r}")
        return value

    def int(self, key: str, minimum: int = 0) -> int:
        value = self.raw(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise self._fail(key, f"must be an integer >= {minimum}, got {value!r}")
        return value

    def list(self, key: str) -> list[Any]:
        value = self.raw(key)
        if not isinstance(value, list):
            raise self._fail(key, f"must be a list, got {type(value).__name__}")
        return value

    def sub(self, value: Any, name: str) -> "_Fields":
        return _Fields(value, self.where, f"{self.prefix}{name}.")


@dataclass(frozen=True)
class TokenizerInfo:
    name: str  # the tokenizer folder's name, or "bytes"
    sha256: str  # of tokenizer.json's bytes; "bytes" for the byte-level tokenizer
    vocab_size: int
    eos_id: int

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "sha256": self.sha256, "vocab_size": self.vocab_size, "eos_id": self.eos_id}

    @classmethod
    def from_json(cls, obj: Any, where: str = MANIFEST_NAME, prefix: str = "tokenizer.") -> "TokenizerInfo":
        f = _Fields(obj, where, prefix)
        info = cls(f.str("name"), f.str("sha256"), f.int("vocab_size", 1), f.int("eos_id"))
        if info.eos_id >= info.vocab_size:
            raise f._fail("eos_id", f"{info.eos_id} is outside the vocabulary of {info.vocab_size}")
        return info


@dataclass(frozen=True)
class SourceInfo:
    uri: str  # one input file, as given or expanded from a folder, glob or prefix
    num_documents: int
    num_tokens: int

    def to_json(self) -> dict[str, Any]:
        return {"uri": self.uri, "num_documents": self.num_documents, "num_tokens": self.num_tokens}

    @classmethod
    def from_json(cls, obj: Any, where: str = MANIFEST_NAME, prefix: str = "sources[]." ) -> "SourceInfo":
        f = _Fields(obj, where, prefix)
        return cls(f.str("uri"), f.int("num_documents"), f.int("num_tokens"))


@dataclass(frozen=True)
class ShardInfo:
    tokens: str  # path relative to the dataset root, e.g. shards/00000.tokens.npy
    docs: str
    num_documents: int
    num_tokens: int
    tokens_sha256: str  # of the whole .npy file, header included
    docs_sha256: str
    # A chat shard's loss mask: uint8 a token, 1 where the token is a trained target.
    mask: Optional[str] = None
    mask_sha256: Optional[str] = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "tokens": self.tokens,
            "docs": self.docs,
            "num_documents": self.num_documents,
            "num_tokens": self.num_tokens,
            "sha256": {"tokens": self.tokens_sha256, "docs": self.docs_sha256},
        }
        if self.mask is not None:
            out["mask"] = self.mask
            out["sha256"]["mask"] = self.mask_sha256
        return out

    @classmethod
    def from_json(cls, obj: Any, where: str = MANIFEST_NAME, prefix: str = "shards[]." ) -> "ShardInfo":
        f = _Fields(obj, where, prefix)
        sums = f.sub(f.raw("sha256"), "sha256")
        has_mask = isinstance(obj, dict) and "mask" in obj
        shard = cls(f.str("tokens"), f.str("docs"), f.int("num_documents", 1), f.int("num_tokens", 1),
                    sums.str("tokens"), sums.str("docs"),
                    f.str("mask") if has_mask else None, sums.str("mask") if has_mask else None)  # fmt: skip
        for key in ("tokens", "docs", "mask") if has_mask else ("tokens", "docs"):
            path = getattr(shard, key)
            # Paths stay inside the dataset: a manifest must not point a reader elsewhere.
            if path.startswith("/") or ".." in path.split("/") or "://" in path:
                raise f._fail(key, f"must be a path inside the dataset, got {path!r}")
        return shard


@dataclass(frozen=True)
class SkippedRecord:
    uri: str
    line: int  # 1-based line of a JSONL file, row of a Parquet file; 0 for a whole file
    reason: str

    def to_json(self) -> dict[str, Any]:
        return {"uri": self.uri, "line": self.line, "reason": self.reason}

    @classmethod
    def from_json(cls, obj: Any, where: str = MANIFEST_NAME, prefix: str = "skipped[]." ) -> "SkippedRecord":
        f = _Fields(obj, where, prefix)
        return cls(f.str("uri"), f.int("line"), f.str("reason"))


@dataclass(frozen=True)
class ChatInfo:
    """How a chat dataset's conversations were rendered and masked."""

    template_sha256: str  # of the chat template's text
    template_file: str  # tokenizer_config.json or chat_template.jinja
    train_on: str  # CHAT_TRAIN_ON: which tokens are targets
    mask_source: str  # CHAT_MASK_SOURCES: generation (the template's markers) or prefix (rendered prefixes)
    messages_field: str
    # Tokens whose mask is 1, over the whole dataset; None in a manifest written without it.
    num_trained_tokens: Optional[int] = None
    roles_to_train: tuple[str, ...] = ("assistant",)  # CHAT_ROLES whose turns train
    train_on_eos: str = "turn"  # CHAT_TRAIN_ON_EOS

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"template_sha256": self.template_sha256, "template_file": self.template_file,
                               "train_on": self.train_on, "mask_source": self.mask_source,
                               "messages_field": self.messages_field, "roles_to_train": list(self.roles_to_train),
                               "train_on_eos": self.train_on_eos}  # fmt: skip
        if self.num_trained_tokens is not None:
            out["num_trained_tokens"] = self.num_trained_tokens
        return out

    @classmethod
    def from_json(cls, obj: Any, where: str = MANIFEST_NAME, prefix: str = "chat.") -> "ChatInfo":
        f = _Fields(obj, where, prefix)
        has = obj.__contains__ if isinstance(obj, dict) else (lambda key: False)
        trained = f.int("num_trained_tokens") if has("num_trained_tokens") else None
        # A manifest written before the roles and the EOS policy were recorded trained the
        # assistant's turns, end-of-turn tokens included.
        roles = tuple(f.list("roles_to_train")) if has("roles_to_train") else ("assistant",)
        info = cls(f.str("template_sha256"), f.str("template_file"), f.str("train_on"), f.str("mask_source"),
                   f.str("messages_field"), trained, roles, f.str("train_on_eos") if has("train_on_eos") else "turn")  # fmt: skip
        if info.train_on not in CHAT_TRAIN_ON:
            raise f._fail("train_on", f"must be one of {', '.join(CHAT_TRAIN_ON)}, got {info.train_on!r}")
        if info.mask_source not in CHAT_MASK_SOURCES:
            raise f._fail("mask_source", f"must be one of {', '.join(CHAT_MASK_SOURCES)}, got {info.mask_source!r}")
        if not roles or any(r not in CHAT_ROLES for r in roles):
            raise f._fail("roles_to_train", f"must name some of {', '.join(CHAT_ROLES)}, got {list(roles)!r}")
        if info.train_on_eos not in CHAT_TRAIN_ON_EOS:
            raise f._fail("train_on_eos", f"must be one of {', '.join(CHAT_TRAIN_ON_EOS)}, got {info.train_on_eos!r}")
        return info


@dataclass(frozen=True)
class PreferenceInfo:
    """A preference dataset's pairs (each ``PAIR_DOCUMENTS`` documents)."""

    num_pairs: int

    def to_json(self) -> dict[str, Any]:
        return {"num_pairs": self.num_pairs}

    @classmethod
    def from_json(cls, obj: Any, where: str = MANIFEST_NAME, prefix: str = "preference.") -> "PreferenceInfo":
        return cls(_Fields(obj, where, prefix).int("num_pairs"))


@dataclass(frozen=True)
class Manifest:
    dtype: str
    num_documents: int
    num_tokens: int
    tokenizer: TokenizerInfo
    sources: list[SourceInfo]
    shards: list[ShardInfo]
    skipped: list[SkippedRecord] = field(default_factory=list)
    num_skipped: int = 0  # may exceed len(skipped): the list is capped, the count is not
    command: list[str] = field(default_factory=list)
    content: str = "text"  # CONTENTS
    chat: Optional[ChatInfo] = None  # with MASKED_CONTENTS
    preference: Optional[PreferenceInfo] = None  # with content "preference"

    def to_json(self) -> dict[str, Any]:
        chat = {"content": self.content, "chat": self.chat.to_json()} if self.chat is not None else {}
        if self.preference is not None:
            chat["preference"] = self.preference.to_json()
        return {
            "format": FORMAT,
            "dtype": self.dtype,
            "num_documents": self.num_documents,
            "num_tokens": self.num_tokens,
            "tokenizer": self.tokenizer.to_json(),
            "sources": [s.to_json() for s in self.sources],
            "shards": [s.to_json() for s in self.shards],
            "skipped": [s.to_json() for s in self.skipped],
            "num_skipped": self.num_skipped,
            "command": list(self.command),
            **chat,
        }

    def dumps(self) -> str:
        """The manifest file's text: fixed key order and indentation, so equal manifests are equal bytes."""
        return json.dumps(self.to_json(), indent=1, ensure_ascii=False) + "\n"

    def digest(self) -> str:
        """The sha256 of the manifest's text: the dataset's identity (every shard's sha256 is in it)."""
        return hashlib.sha256(self.dumps().encode()).hexdigest()

    @classmethod
    def from_json(cls, obj: Any, where: str = MANIFEST_NAME) -> "Manifest":
        """Parse and check a manifest; ``where`` (its file or URI) is named in every error."""
        f = _Fields(obj, where, "")
        fmt = f.raw("format")
        if fmt != FORMAT:
            raise DataError(f"{where}: format {fmt!r} is not {FORMAT!r} (written by another ringtrain version?)")
        dtype = f.str("dtype")
        if dtype not in TOKEN_DTYPES:
            raise f._fail("dtype", f"must be one of {', '.join(TOKEN_DTYPES)}, got {dtype!r}")
        manifest = cls(
            dtype=dtype,
            num_documents=f.int("num_documents"),
            num_tokens=f.int("num_tokens"),
            tokenizer=TokenizerInfo.from_json(f.raw("tokenizer"), where),
            sources=[SourceInfo.from_json(s, where, f"sources[{i}].") for i, s in enumerate(f.list("sources"))],
            shards=[ShardInfo.from_json(s, where, f"shards[{i}].") for i, s in enumerate(f.list("shards"))],
            skipped=[SkippedRecord.from_json(s, where, f"skipped[{i}].") for i, s in enumerate(f.list("skipped"))],
            num_skipped=f.int("num_skipped"),
            command=[str(a) for a in f.list("command")],
            content=f.str("content") if isinstance(obj, dict) and "content" in obj else "text",
            chat=ChatInfo.from_json(f.raw("chat"), where) if isinstance(obj, dict) and "chat" in obj else None,
            preference=PreferenceInfo.from_json(f.raw("preference"), where) if isinstance(obj, dict) and "preference" in obj else None,
        )
        manifest._check(where)
        return manifest

    @classmethod
    def loads(cls, text: Union[str, bytes], where: str = MANIFEST_NAME) -> "Manifest":
        try:
            obj = parse_json(text, MAX_MANIFEST_BYTES)
        except JsonFileError as exc:
            raise DataError(f"{where}: {MANIFEST_REFUSED[exc.limit].format(detail=exc.detail)}") from None
        return cls.from_json(obj, where)

    @classmethod
    def load(cls, root: PathLike) -> "Manifest":
        """The manifest of local dataset ``root`` (a folder, or ``file://``)."""
        path = local_path(root)
        if path is None:
            raise DataError(f"{root}: an s3:// dataset is read through its store, not as a local file")
        file = path / MANIFEST_NAME
        try:
            with open(file, "rb") as f:
                text = f.read(MAX_MANIFEST_BYTES + 1)  # loads refuses one past the bound
        except FileNotFoundError:
            raise DataError(f"{file}: no manifest; {path} is not a prepared dataset (run `ringtrain prepare`)") from None
        except OSError as exc:
            raise DataError(f"{file}: cannot read ({exc.strerror})") from None
        return cls.loads(text, str(file))

    def _check(self, where: str) -> None:
        """The totals agree with their parts, and the dtype with the vocabulary."""
        if self.dtype != token_dtype_for(self.tokenizer.vocab_size):
            raise DataError(f"{where}: dtype {self.dtype} does not match vocab_size {self.tokenizer.vocab_size}")
        for what, parts in (("shards", self.shards), ("sources", self.sources)):
            docs = sum(p.num_documents for p in parts)
            tokens = sum(p.num_tokens for p in parts)
            if (docs, tokens) != (self.num_documents, self.num_tokens):
                raise DataError(
                    f"{where}: {what} add up to {docs} documents and {tokens} tokens, the manifest says "
                    f"{self.num_documents} and {self.num_tokens}"
                )
        if self.num_skipped < len(self.skipped):
            raise DataError(f"{where}: num_skipped {self.num_skipped} is less than the {len(self.skipped)} listed")
        for i, shard in enumerate(self.shards):
            if (shard.tokens, shard.docs) != shard_paths(i):
                raise DataError(f"{where}: shards[{i}] names {shard.tokens}, expected {shard_paths(i)[0]}")
        if self.content not in CONTENTS:
            raise DataError(f"{where}: content must be one of {', '.join(CONTENTS)}, got {self.content!r}")
        masked = self.content in MASKED_CONTENTS
        if masked != (self.chat is not None):
            raise DataError(f"{where}: content {self.content!r} {'needs' if self.chat is None else 'takes no'} a chat section")
        if (self.content == "preference") != (self.preference is not None):
            raise DataError(f"{where}: content {self.content!r} {'takes no' if self.preference else 'needs a'} preference section")
        if self.preference is not None and self.num_documents != PAIR_DOCUMENTS * self.preference.num_pairs:
            raise DataError(f"{where}: {self.preference.num_pairs} pairs are {PAIR_DOCUMENTS * self.preference.num_pairs} "
                            f"documents, the manifest says {self.num_documents}")  # fmt: skip
        for i, shard in enumerate(self.shards):
            if (shard.mask is not None) != masked:
                raise DataError(f"{where}: shards[{i}] {'lacks' if shard.mask is None else 'has'} a loss mask, "
                                f"but the dataset holds {self.content}")  # fmt: skip
            if shard.mask is not None and shard.mask != mask_path(i):
                raise DataError(f"{where}: shards[{i}] names mask {shard.mask}, expected {mask_path(i)}")
        trained = self.chat.num_trained_tokens if self.chat is not None else None
        # A conversation's first token is never a target (a pair's prompt's neither; its
        # completions follow the prompt, so their first tokens can be).
        sequences = self.preference.num_pairs if self.preference is not None else self.num_documents
        if trained is not None and trained > self.num_tokens - sequences:
            raise DataError(f"{where}: chat.num_trained_tokens {trained} exceeds the {self.num_tokens - sequences} "
                            "tokens that can be targets (all but each conversation's first)")
