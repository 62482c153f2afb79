"""The snapshot wire format: one rank's state fragments as a self-describing blob, and the
index that reads every rank's blobs of one step by parameter coordinates.

A blob is a magic tag, a JSON header (step, rank, world size, the scalars, and per fragment its
parameter name, state key, shape, flat start and length) and the raw little-endian float32
payload: no pickle, and numpy only, so holders and exporters read snapshots without torch.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from dataclasses import dataclass
from typing import Any, Mapping, Protocol, Sequence

import numpy as np

# The state each parameter element carries: its fp32 master value and Adam's two moments.
STATE_KEYS = ("param", "exp_avg", "exp_avg_sq")
_MAGIC = b"RTSNAP01"


class FragmentPlace(Protocol):
    """Where a fragment sits: parameter ``name`` of ``shape``, flat elements from ``start``."""

    name: str
    shape: tuple[int, ...]
    start: int


def checksum(blob: bytes) -> str:
    # sha256: with the SHA extensions of current x86 and Arm CPUs it runs about twice as fast
    # as blake2b here, and the checksum is most of the snapshot thread's work.
    return hashlib.sha256(blob).hexdigest()


def encode(step: int, rank: int, world_size: int, scalars: dict[str, Any], arrays: Sequence[tuple[FragmentPlace, Mapping[str, np.ndarray]]]) -> bytes:
    """Header (JSON) + raw little-endian float32 payload; self-describing, no pickle."""
    entries, chunks, offset = [], [], 0
    for frag, values in arrays:
        for key, arr in values.items():
            data = np.ascontiguousarray(arr, dtype="<f4").tobytes()
            entries.append(
                {"name": frag.name, "key": key, "shape": list(frag.shape), "start": frag.start,
                 "numel": int(arr.size), "offset": offset}
            )
            chunks.append(data)
            offset += len(data)
    header = json.dumps(
        {"format": 1, "step": step, "rank": rank, "world_size": world_size, "scalars": scalars, "arrays": entries}
    ).encode()
    return b"".join([_MAGIC, struct.pack("<Q", len(header)), header, *chunks])


@dataclass(frozen=True)
class DecodedShard:
    step: int
    rank: int
    world_size: int
    scalars: dict[str, Any]
    entries: list[dict[str, Any]]
    payload: memoryview

    def array(self, entry: dict[str, Any]) -> np.ndarray:
        start = entry["offset"]
        return np.frombuffer(self.payload[start : start + 4 * entry["numel"]], dtype="<f4")


class SnapshotFormatError(ValueError):
    pass


def decode(blob: bytes) -> DecodedShard:
    if len(blob) < 16 or blob[:8] != _MAGIC:
        raise SnapshotFormatError("not a ringtrain snapshot (bad magic)")
    (header_len,) = struct.unpack("<Q", blob[8:16])
    if 16 + header_len > len(blob):
        raise SnapshotFormatError("truncated snapshot header")
    header = json.loads(blob[16 : 16 + header_len])
    payload = memoryview(blob)[16 + header_len :]
    need = sum(4 * e["numel"] for e in header["arrays"])
    if len(payload) != need:
        raise SnapshotFormatError(f"payload is {len(payload)} bytes, the header describes {need}")
    return DecodedShard(header["step"], header["rank"], header["world_size"], header["scalars"], header["arrays"], payload)


class FragmentIndex:
    """All ranks' fragments of one step, readable by (name, key, element range)."""

    def __init__(self, shards: list[DecodedShard]) -> None:
        if not shards:
            raise SnapshotFormatError("no shards")
        steps = {s.step for s in shards}
        if len(steps) != 1:
            raise SnapshotFormatError(f"shards from different steps {sorted(steps)}")
        self.step = shards[0].step
        self.scalars = shards[0].scalars
        self.shapes: dict[str, tuple[int, ...]] = {}
        self._pieces: dict[tuple[str, str], list[tuple[int, int, DecodedShard, dict[str, Any]]]] = {}
        for shard in shards:
            for e in shard.entries:
                self.shapes[e["name"]] = tuple(e["shape"])
                self._pieces.setdefault((e["name"], e["key"]), []).append((e["start"], e["numel"], shard, e))
        for (name, key), pieces in self._pieces.items():
            pieces.sort(key=lambda piece: piece[0])
            expected = 0
            for start, numel, _, _ in pieces:
                if start != expected:
                    raise SnapshotFormatError(f"{name}/{key}: elements [{expected}, {start}) missing or overlapping")
                expected = start + numel
            total = math.prod(self.shapes[name])
            if expected != total:
                raise SnapshotFormatError(f"{name}/{key}: covers {expected} of {total} elements")

    @property
    def names(self) -> list[str]:
        return sorted(self.shapes)

    def read(self, name: str, key: str, start: int, stop: int) -> np.ndarray:
        out = np.empty(stop - start, dtype=np.float32)
        for p_start, numel, shard, entry in self._pieces[(name, key)]:
            lo, hi = max(start, p_start), min(stop, p_start + numel)
            if lo < hi:
                out[lo - start : hi - start] = shard.array(entry)[lo - p_start : hi - p_start]
        return out

    def full(self, name: str, key: str = "param") -> np.ndarray:
        return self.read(name, key, 0, math.prod(self.shapes[name])).reshape(self.shapes[name])
