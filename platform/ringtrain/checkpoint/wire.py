"""The snapshot wire format: one rank's state fragments as a self-describing blob, its checksum,
and the index that reads every rank's blobs of one step by parameter coordinates.

A blob is a magic tag, the header's length, a JSON header (step, rank, world size, the scalars,
and per fragment its parameter name, state key, shape, flat start, length and payload offset),
padded with spaces to a page boundary, and the raw little-endian float32 payload: no pickle, and
numpy only, so holders and exporters read snapshots without torch. A ``BlobLayout`` fixes where
every array's bytes go before any are copied, so a rank copies its state straight into the blob
(``train.snapshot``) and encoding only writes the header; the padding leaves the header room to
change from step to step without moving the payload. JSON allows trailing whitespace, so the
padding needs nothing of the reader.

The checksum is a tree of sha256 digests, named by its chunk size ("sha256x64m:<hex>": sha256
over the sha256 digests of consecutive 64 MiB chunks), so its chunks hash on all cores at once;
``verify`` reads that name, and a bare hex digest as the sha256 of the whole blob that earlier
snapshots carry.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import struct
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Protocol, Sequence, Union

import numpy as np

from ringtrain.jsonfile import JsonFileError, parse_json

# The state each parameter element carries: its fp32 master value and Adam's two moments.
STATE_KEYS = ("param", "exp_avg", "exp_avg_sq")
FORMAT = 1
_MAGIC = b"RTSNAP01"
_PREFIX = len(_MAGIC) + 8  # the magic and the header's length
# The payload starts on a page: the device-to-host copies land aligned, and every float32 view
# into the blob is aligned.
PAYLOAD_ALIGN = 4096
# The header's room for the scalars (RNG state, scheduler: about 10 KiB): they change a little
# from step to step, and a header that outgrew its room would cost a new layout (new buffers).
SCALARS_ROOM = 64 << 10

TREE_CHUNK_MIB = 64
_TREE_NAME = re.compile(r"sha256x([1-9][0-9]{0,5})m")

Buffer = Union[bytes, bytearray, memoryview, np.ndarray]


class FragmentPlace(Protocol):
    """Where a fragment sits: parameter ``name`` of ``shape``, flat elements from ``start``."""

    name: str
    shape: tuple[int, ...]
    start: int


class SnapshotFormatError(ValueError):
    pass


# --- the checksum -------------------------------------------------------------------------------


def checksum(
    blob: Buffer, *, threads: Optional[int] = None, chunk_mib: int = TREE_CHUNK_MIB,
    thread_setup: Optional[Callable[[], None]] = None,
) -> str:
    """The tree checksum of ``blob``, named: ``sha256x<chunk_mib>m:<hex>``. ``threads``: how
    many chunks hash at once (default: the CPUs this process may run on); ``thread_setup`` runs
    in each hashing thread as it starts (a lower priority, say)."""
    return f"sha256x{chunk_mib}m:{_tree_sha256(_bytes_view(blob), chunk_mib << 20, threads, thread_setup)}"


def verify(blob: Buffer, digest: str, *, threads: Optional[int] = None) -> bool:
    """Whether ``blob`` matches ``digest``: a tree checksum as ``checksum`` names it, or a bare
    (or ``sha256:``) hex digest of the whole blob. A digest of an unknown kind never matches: a
    snapshot that cannot be checked is not handed out."""
    kind, _, hexdigest = digest.rpartition(":")
    view = _bytes_view(blob)
    if kind in ("", "sha256"):
        return hashlib.sha256(view).hexdigest() == hexdigest
    tree = _TREE_NAME.fullmatch(kind)
    if tree is None:
        return False
    return _tree_sha256(view, int(tree.group(1)) << 20, threads) == hexdigest


def _tree_sha256(
    view: memoryview, chunk_bytes: int, threads: Optional[int], thread_setup: Optional[Callable[[], None]] = None
) -> str:
    # hashlib releases the GIL while it hashes a large buffer, so threads use every core.
    starts = range(0, len(view), chunk_bytes)

    def leaf(start: int) -> bytes:
        return hashlib.sha256(view[start : start + chunk_bytes]).digest()

    workers = min(len(starts), threads or _num_cpus())
    if workers <= 1:
        leaves = [leaf(s) for s in starts]
    else:
        with ThreadPoolExecutor(workers, thread_name_prefix="snapshot-hash", initializer=thread_setup) as pool:
            leaves = list(pool.map(leaf, starts))
    return hashlib.sha256(b"".join(leaves)).hexdigest()


def _num_cpus() -> int:
    """The CPUs this process may run on (its affinity mask: a container's cpuset, say)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _bytes_view(blob: Buffer) -> memoryview:
    view = blob.data if isinstance(blob, np.ndarray) else memoryview(blob)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


# --- the blob -----------------------------------------------------------------------------------


def header_room(scalars: Mapping[str, Any]) -> int:
    """The room a layout keeps for ``scalars``' JSON: ``SCALARS_ROOM`` while they take at most
    half of it, else the next power of two above twice their size. A step function of their
    size, so the room stays put from step to step, and a blob encoded anywhere from the same
    state and scalars is the same bytes (a survivor rebuilds a lost rank's shard exactly)."""
    need = 2 * len(json.dumps(scalars))
    return SCALARS_ROOM if need <= SCALARS_ROOM else 1 << (need - 1).bit_length()


class BlobLayout:
    """Where every byte of one rank's blob goes: the header's room, then each array's payload in
    order. It depends only on the fragments' places and sizes, so one layout (and one buffer per
    kept snapshot) serves every step of a run; ``room`` is what the scalars' JSON may take."""

    def __init__(self, places: Sequence[tuple[FragmentPlace, Mapping[str, int]]], *, room: int) -> None:
        entries: list[dict[str, Any]] = []
        offset = 0
        for frag, sizes in places:
            for key, numel in sizes.items():
                entries.append({"name": frag.name, "key": key, "shape": [int(d) for d in frag.shape],
                                "start": int(frag.start), "numel": int(numel), "offset": offset})
                offset += 4 * int(numel)
        self._arrays_json = json.dumps(entries)
        # The header without scalars is under 200 bytes besides the arrays' entries.
        self.header_bytes = _round_up(_PREFIX + len(self._arrays_json) + 256 + room, PAYLOAD_ALIGN) - _PREFIX
        self.payload_start = _PREFIX + self.header_bytes
        self.num_bytes = self.payload_start + offset
        # (blob offset, numel) of each array, in the order ``places`` lists them.
        self.spans = [(self.payload_start + e["offset"], e["numel"]) for e in entries]

    def header(self, step: int, rank: int, world_size: int, scalars: Mapping[str, Any]) -> bytes:
        """The JSON header of one step's blob; SnapshotFormatError if it outgrows the room."""
        head = json.dumps({"format": FORMAT, "step": step, "rank": rank, "world_size": world_size, "scalars": scalars})
        # The arrays' entries are the bulk of the header and fixed by the layout: spliced in, not
        # serialised again each step.
        header = f'{head[:-1]}, "arrays": {self._arrays_json}}}'.encode()
        if len(header) > self.header_bytes:
            raise SnapshotFormatError(f"the header takes {len(header)} bytes, its room is {self.header_bytes}")
        return header

    def write_header(self, blob: Buffer, header: bytes) -> None:
        """Write the magic, the header and its padding into the start of ``blob`` (writable, this
        layout's size); the payload bytes are left as they are."""
        view = _bytes_view(blob)
        if len(view) != self.num_bytes or len(header) > self.header_bytes:
            raise SnapshotFormatError(f"a {len(view)}-byte blob or a {len(header)}-byte header does not fit this layout")
        view[:_PREFIX] = _MAGIC + struct.pack("<Q", self.header_bytes)
        view[_PREFIX : _PREFIX + len(header)] = header
        view[_PREFIX + len(header) : self.payload_start] = b" " * (self.header_bytes - len(header))


def encode(step: int, rank: int, world_size: int, scalars: dict[str, Any], arrays: Sequence[tuple[FragmentPlace, Mapping[str, np.ndarray]]]) -> bytes:
    """One blob from arrays in memory (any float dtype, stored as little-endian float32): for
    one-off blobs; a rank's per-step snapshot is copied into its layout in place instead."""
    layout = BlobLayout([(frag, {key: int(arr.size) for key, arr in values.items()}) for frag, values in arrays],
                        room=header_room(scalars))
    out = bytearray(layout.num_bytes)
    layout.write_header(out, layout.header(step, rank, world_size, scalars))
    flat = (arr for _, values in arrays for arr in values.values())
    for (offset, numel), arr in zip(layout.spans, flat, strict=True):
        np.frombuffer(out, dtype="<f4", count=numel, offset=offset)[:] = np.asarray(arr).reshape(-1)
    return bytes(out)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


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


def decode(blob: Buffer) -> DecodedShard:
    """Read a blob (any bytes-like object; its arrays are views of it, not copies)."""
    view = _bytes_view(blob)
    if len(view) < _PREFIX or view[: len(_MAGIC)] != _MAGIC:
        raise SnapshotFormatError("not a ringtrain snapshot (bad magic)")
    (header_len,) = struct.unpack("<Q", view[len(_MAGIC) : _PREFIX])
    if _PREFIX + header_len > len(view):
        raise SnapshotFormatError("truncated snapshot header")
    try:
        header = parse_json(view[_PREFIX : _PREFIX + header_len], max_bytes=None)  # bounded by the blob
    except JsonFileError as exc:
        # The parser words a limit that failed; text that is simply not JSON the format words itself.
        raise SnapshotFormatError(f"the header is not JSON ({exc.detail})" if exc.limit is None else f"the header {exc}") from None
    need = _check_header(header)
    payload = view[_PREFIX + header_len :]
    if len(payload) != need:
        raise SnapshotFormatError(f"payload is {len(payload)} bytes, the header describes {need}")
    return DecodedShard(header["step"], header["rank"], header["world_size"], header["scalars"], header["arrays"], payload)


def _check_header(header: Any) -> int:
    """The payload bytes a decoded header describes, once every field has the type and range
    the encoder writes: a blob from a store may come from anywhere, and a field the readers
    index with (an offset, a count, a shape) must not send them outside the blob or a tensor.
    SnapshotFormatError naming the first field that is wrong."""
    if not isinstance(header, dict):
        raise SnapshotFormatError("the header is not a JSON object")
    for field in ("step", "rank", "world_size"):
        if not _count(header.get(field)):
            raise SnapshotFormatError(f"header field {field!r} is {header.get(field)!r}, not a count")
    if header["rank"] >= max(header["world_size"], 1):
        raise SnapshotFormatError(f"rank {header['rank']} is outside a world of {header['world_size']}")
    if not isinstance(header.get("scalars"), dict) or not isinstance(header.get("arrays"), list):
        raise SnapshotFormatError("the header lacks its scalars (an object) or arrays (a list)")
    offset = 0
    for i, entry in enumerate(header["arrays"]):
        shape = entry.get("shape") if isinstance(entry, dict) else None
        if (not isinstance(entry, dict) or not isinstance(entry.get("name"), str) or not isinstance(entry.get("key"), str)
                or not isinstance(shape, list) or not all(_count(d) for d in shape)
                or not all(_count(entry.get(f)) for f in ("start", "numel", "offset"))):  # fmt: skip
            raise SnapshotFormatError(f"arrays[{i}] is not a fragment entry (name, key, shape, start, numel, offset)")
        if entry["offset"] != offset:
            raise SnapshotFormatError(f"arrays[{i}] ({entry['name']}/{entry['key']}) starts at byte {entry['offset']}, not {offset}")
        if entry["start"] + entry["numel"] > math.prod(shape):
            raise SnapshotFormatError(f"arrays[{i}] ({entry['name']}/{entry['key']}) runs past its tensor of shape {shape}")
        offset += 4 * entry["numel"]
    return offset


def _count(value: Any) -> bool:
    """A JSON integer >= 0 (not a bool, which Python counts as one)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


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
                shape = self.shapes.setdefault(e["name"], tuple(e["shape"]))
                if shape != tuple(e["shape"]):
                    raise SnapshotFormatError(f"{e['name']}: shape {e['shape']} in rank {shard.rank}'s shard, {list(shape)} in another's")
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
