"""The snapshot checksum: a named tree of sha256 digests over fixed-size chunks, checked against a
reference built from hashlib here, sensitive to every byte, and readers still accept the flat
sha256 of earlier snapshots."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from ringtrain.checkpoint.wire import checksum, encode, verify

MIB = 1 << 20
NUM_FLOATS = 3 * MIB // 4 + 1000


class _Place:
    def __init__(self, name: str, shape: tuple[int, ...]) -> None:
        self.name, self.shape, self.start = name, shape, 0


def _blob(num_floats: int = NUM_FLOATS) -> bytes:
    """A real snapshot blob of a little over three 1 MiB chunks."""
    values = np.random.default_rng(0).standard_normal(num_floats).astype(np.float32)
    return encode(7, 0, 1, {"trainer_step": 7}, [(_Place("w", (num_floats,)), {"param": values})])


def _reference_tree(blob: bytes, chunk: int) -> str:
    leaves = b"".join(hashlib.sha256(blob[i : i + chunk]).digest() for i in range(0, len(blob), chunk))
    return hashlib.sha256(leaves).hexdigest()


def _flipped(blob: bytes, at: int) -> bytes:
    return blob[:at] + bytes([blob[at] ^ 0x01]) + blob[at + 1 :]


def test_the_checksum_names_its_tree_and_matches_the_reference() -> None:
    blob = _blob()
    assert len(blob) > 3 * MIB
    assert checksum(blob, chunk_mib=1) == "sha256x1m:" + _reference_tree(blob, MIB)
    assert checksum(blob) == "sha256x64m:" + _reference_tree(blob, 64 * MIB)


def test_the_digest_does_not_depend_on_the_threads_or_the_buffer_type() -> None:
    blob = _blob()
    one = checksum(blob, threads=1, chunk_mib=1)
    assert checksum(blob, threads=4, chunk_mib=1) == one
    assert checksum(memoryview(blob), chunk_mib=1) == one
    assert checksum(np.frombuffer(blob, dtype=np.uint8), chunk_mib=1) == one


@pytest.mark.parametrize("where", ["magic", "header", "header-padding", "chunk-0-payload", "chunk-1", "chunk-2", "last-byte"])
def test_a_flipped_byte_anywhere_fails_verification(where: str) -> None:
    blob = _blob()
    payload_start = len(blob) - 4 * NUM_FLOATS
    assert 0 < payload_start < MIB and blob[payload_start - 1 : payload_start] == b" "
    at = {"magic": 0, "header": 20, "header-padding": payload_start - 1, "chunk-0-payload": payload_start + 5,
          "chunk-1": MIB + 123, "chunk-2": 2 * MIB + 7, "last-byte": len(blob) - 1}[where]
    digest = checksum(blob, chunk_mib=1)
    assert verify(blob, digest)
    assert not verify(_flipped(blob, at), digest)


@pytest.mark.parametrize("change", ["truncated", "extended", "last-chunk-dropped", "chunks-swapped"])
def test_a_blob_of_another_length_or_order_fails_verification(change: str) -> None:
    blob = _blob()
    digest = checksum(blob, chunk_mib=1)
    changed = {
        "truncated": blob[:-1],
        "extended": blob + b"\0",
        "last-chunk-dropped": blob[: 3 * MIB],
        "chunks-swapped": blob[MIB : 2 * MIB] + blob[:MIB] + blob[2 * MIB :],
    }[change]
    assert not verify(changed, digest)


def test_earlier_snapshots_flat_sha256_still_verifies() -> None:
    blob = _blob()
    flat = hashlib.sha256(blob).hexdigest()  # what snapshots carried before the tree
    assert verify(blob, flat)
    assert verify(blob, "sha256:" + flat)
    assert not verify(_flipped(blob, MIB + 5), flat)


@pytest.mark.parametrize("digest", ["md5:0123", "sha256x0m:00", "sha256xm:00", "blake2b:" + "0" * 64, ""])
def test_a_checksum_of_an_unknown_kind_never_verifies(digest: str) -> None:
    assert not verify(_blob(1000), digest)


def test_every_chunk_size_a_name_gives_verifies() -> None:
    blob = _blob()
    for chunk_mib in (1, 2, 64):
        assert verify(blob, checksum(blob, chunk_mib=chunk_mib))
    assert checksum(blob, chunk_mib=1) != checksum(blob, chunk_mib=2)


def test_an_empty_blob_has_a_checksum() -> None:
    assert verify(b"", checksum(b""))
    assert not verify(b"\0", checksum(b""))
