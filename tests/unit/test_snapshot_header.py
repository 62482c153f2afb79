"""A snapshot blob from a store is read only when its header is what the encoder writes: each
field of the wrong type or range, or a header that is not JSON or nests too deep, is a
SnapshotFormatError naming it (the store then skips that checkpoint), never an IndexError,
a KeyError, a RecursionError or a read outside the blob."""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import pytest

from ringtrain.checkpoint.wire import FragmentIndex, SnapshotFormatError, decode, encode

MAGIC, PREFIX = b"RTSNAP01", 16


@dataclass(frozen=True)
class Place:
    name: str
    shape: tuple[int, ...]
    start: int


def blob(rank: int = 0, world: int = 1, shape: tuple[int, ...] = (2, 3)) -> bytes:
    values = np.arange(6, dtype=np.float32)
    return encode(5, rank, world, {"lr": 0.1}, [(Place("w", shape, 0), {"param": values, "exp_avg": values * 2})])


def with_header(change: Callable[[dict[str, Any]], Any]) -> bytes:
    """``blob()`` with its header rewritten by ``change`` (which may return a whole new value)."""
    data = blob()
    (length,) = struct.unpack("<Q", data[8:PREFIX])
    header = json.loads(data[PREFIX : PREFIX + length])
    header = change(header) or header
    text = json.dumps(header).encode() if not isinstance(header, bytes) else header
    return MAGIC + struct.pack("<Q", len(text)) + text + data[PREFIX + length :]


def set_entry(field: str, value: Any) -> Callable[[dict[str, Any]], None]:
    return lambda h: h["arrays"][1].__setitem__(field, value)


HOSTILE: dict[str, tuple[Callable[[dict[str, Any]], Any], str]] = {
    "not an object": (lambda h: [1, 2], "not a JSON object"),
    "not JSON": (lambda h: b"{half", "not JSON"),
    "nested too deep": (lambda h: b"[" * 100_000, "nests too deeply"),
    "step missing": (lambda h: h.pop("step") and None, "'step'"),
    "rank negative": (lambda h: h.__setitem__("rank", -1), "'rank'"),
    "rank a bool": (lambda h: h.__setitem__("rank", True), "'rank'"),
    "rank outside the world": (lambda h: h.__setitem__("rank", 3), "outside a world of 1"),
    "arrays not a list": (lambda h: h.__setitem__("arrays", {}), "arrays (a list)"),
    "entry not an object": (lambda h: h["arrays"].__setitem__(0, 7), "arrays[0] is not a fragment entry"),
    "numel a string": (set_entry("numel", "6"), "arrays[1] is not a fragment entry"),
    "shape negative": (set_entry("shape", [-2, 3]), "arrays[1] is not a fragment entry"),
    "offset elsewhere": (set_entry("offset", 0), "arrays[1] (w/exp_avg) starts at byte 0, not 24"),
    "offset past the blob": (set_entry("offset", 1 << 40), "starts at byte 1099511627776, not 24"),
    "fragment past its tensor": (set_entry("start", 4), "runs past its tensor of shape [2, 3]"),
}


def test_the_encoders_blob_decodes() -> None:
    shard = decode(blob())
    assert (shard.step, shard.rank, shard.world_size) == (5, 0, 1)
    np.testing.assert_array_equal(FragmentIndex([shard]).full("w", "exp_avg"), np.arange(6, dtype=np.float32).reshape(2, 3) * 2)


@pytest.mark.parametrize("case", HOSTILE, ids=list(HOSTILE))
def test_a_hostile_header_is_refused_naming_the_field(case: str) -> None:
    change, message = HOSTILE[case]
    with pytest.raises(SnapshotFormatError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        decode(with_header(change))


def test_shards_that_disagree_on_a_tensors_shape_are_refused() -> None:
    with pytest.raises(SnapshotFormatError, match=r"w: shape \[3, 2\] in rank 1's shard, \[2, 3\] in another's"):
        FragmentIndex([decode(blob(0, 2)), decode(blob(1, 2, shape=(3, 2)))])
