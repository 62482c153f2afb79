"""The manifest: a checkpoint's commit record, listing every shard with its size and checksum.

A checkpoint exists once its manifest does, so the manifest is the one object whose write must
be atomic. It also carries a checksum of its own canonical JSON: the ``meta`` it holds decides
whether a checkpoint fits the model at all, so a damaged manifest must not parse as a good one.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ringtrain.checkpoint.layout import check_shard_names
from ringtrain.errors import RingtrainError
from ringtrain.jsonfile import JsonFileError, parse_json

FORMAT_VERSION = 1
# sha256 runs on the CPU's SHA extensions (x86 SHA-NI, ARMv8 crypto) where present and is then
# about twice as fast as blake2b; blake2b is the faster one on CPUs without them.
CHECKSUM_ALGOS = ("sha256", "blake2b")
DEFAULT_CHECKSUM_ALGO = "sha256"
# A manifest lists one entry (about 120 bytes) per shard besides the job's meta: one past this is
# not a manifest this code wrote, and is refused rather than read whole.
MAX_MANIFEST_BYTES = 16 << 20


class CheckpointCorrupt(RingtrainError):
    """A checkpoint cannot be used as stored; ``uri`` names it and ``reason`` says what is wrong."""

    def __init__(self, uri: str, reason: str) -> None:
        super().__init__(f"checkpoint {uri}: {reason}")
        self.uri = uri
        self.reason = reason

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.uri, self.reason))


class ManifestInvalid(ValueError):
    """The bytes read as a manifest do not describe a checkpoint; the message says why."""


def check_checksum_algo(algo: str) -> str:
    if algo not in CHECKSUM_ALGOS:
        raise ValueError(f"checksum algorithm {algo!r} is not one of {', '.join(CHECKSUM_ALGOS)}")
    return algo


def checksum(algo: str, data: bytes | memoryview) -> str:
    """Hex digest of ``data``; hashlib releases the GIL on large buffers, so threads overlap."""
    if algo == "sha256":
        return hashlib.sha256(data).hexdigest()
    if algo == "blake2b":
        return hashlib.blake2b(data, digest_size=32).hexdigest()
    raise ValueError(f"checksum algorithm {algo!r} is not one of {', '.join(CHECKSUM_ALGOS)}")


@dataclass(frozen=True)
class ShardEntry:
    size: int
    checksum: str


@dataclass(frozen=True)
class Manifest:
    step: int
    created_at: float
    meta: Mapping[str, Any]
    shards: Mapping[str, ShardEntry]
    checksum_algo: str
    format_version: int = FORMAT_VERSION

    @property
    def num_bytes(self) -> int:
        return sum(entry.size for entry in self.shards.values())

    def _body(self) -> dict[str, Any]:
        return {
            "format_version": self.format_version,
            "step": self.step,
            "created_at": self.created_at,
            "checksum_algo": self.checksum_algo,
            "meta": dict(self.meta),
            "shards": {name: {"size": e.size, "checksum": e.checksum} for name, e in self.shards.items()},
        }

    def encode(self) -> bytes:
        body = self._body()
        document = dict(body, manifest_checksum=checksum(self.checksum_algo, _canonical(body)))
        return (json.dumps(document, indent=1, sort_keys=True, allow_nan=False) + "\n").encode("utf-8")

    @classmethod
    def decode(cls, data: bytes, *, step: int) -> Manifest:
        """Parse and check a manifest read from step ``step``'s folder; ManifestInvalid says why not."""
        try:
            document = parse_json(data, MAX_MANIFEST_BYTES)
        except JsonFileError as exc:
            raise ManifestInvalid(f"manifest {exc}") from None
        if not isinstance(document, dict):
            raise ManifestInvalid("manifest is not a JSON object")
        version = document.get("format_version")
        if version != FORMAT_VERSION:
            raise ManifestInvalid(f"manifest format_version {version!r} is not {FORMAT_VERSION}, the one this code reads")
        algo = document.get("checksum_algo")
        if algo not in CHECKSUM_ALGOS:
            raise ManifestInvalid(f"manifest checksum_algo {algo!r} is not one of {', '.join(CHECKSUM_ALGOS)}")
        stated = document.pop("manifest_checksum", None)
        if stated != checksum(algo, _canonical(document)):
            raise ManifestInvalid("manifest checksum does not match its content")
        if document.get("step") != step:
            raise ManifestInvalid(f"manifest says step {document.get('step')!r} but lies in the folder of step {step}")
        created_at, meta, shards = document.get("created_at"), document.get("meta"), document.get("shards")
        if not isinstance(created_at, (int, float)) or not isinstance(meta, dict) or not isinstance(shards, dict):
            raise ManifestInvalid("manifest lacks created_at, meta or shards")
        entries: dict[str, ShardEntry] = {}
        for name, entry in shards.items():
            size = entry.get("size") if isinstance(entry, dict) else None
            digest = entry.get("checksum") if isinstance(entry, dict) else None
            if isinstance(size, bool) or not isinstance(size, int) or size < 0 or not isinstance(digest, str):
                raise ManifestInvalid(f"manifest entry of shard {name!r} lacks a valid size or checksum")
            entries[name] = ShardEntry(size=size, checksum=digest)
        try:
            check_shard_names(entries)
        except ValueError as exc:
            raise ManifestInvalid(f"manifest lists an unsafe {exc}") from None
        return cls(step=step, created_at=float(created_at), meta=meta, shards=entries, checksum_algo=algo)


def check_meta(meta: Mapping[str, Any]) -> dict[str, Any]:
    """``meta`` as the manifest will store it (JSON), or ValueError before any shard is written."""
    try:
        text = json.dumps(dict(meta), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"checkpoint meta must be JSON-serializable without NaN or inf: {exc}") from None
    stored: dict[str, Any] = json.loads(text)
    return stored


def _canonical(body: Mapping[str, Any]) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False).encode("utf-8")
