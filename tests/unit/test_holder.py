"""SnapshotHolder as a plain object: what it keeps, what it hands back, and when it refuses to."""

from __future__ import annotations

import threading
import time

import pytest

from ringtrain.actors.holder import SnapshotHolder
from ringtrain.checkpoint.wire import checksum


def blob_of(rank: int, step: int, size: int = 64) -> bytes:
    return bytes([rank, step % 256]) + bytes((rank * 31 + step + i) % 256 for i in range(size - 2))


def put(holder: SnapshotHolder, rank: int, step: int, world_size: int = 2) -> bytes:
    blob = blob_of(rank, step)
    holder.put(rank, step, world_size, blob, checksum(blob))
    return blob


def test_get_returns_what_was_put() -> None:
    holder = SnapshotHolder(keep=2)
    blob = put(holder, rank=1, step=7)

    assert holder.get(1, 7) == blob


@pytest.mark.parametrize("rank, step", [(0, 7), (1, 6), (3, 7)], ids=["other-rank", "other-step", "unknown-rank"])
def test_get_of_a_snapshot_never_put_is_none(rank: int, step: int) -> None:
    holder = SnapshotHolder(keep=2)
    put(holder, rank=1, step=7)

    assert holder.get(rank, step) is None


@pytest.mark.parametrize("keep", [1, 2, 3])
def test_keeps_the_newest_k_steps_of_each_rank(keep: int) -> None:
    holder = SnapshotHolder(keep=keep)
    for step in range(1, 6):
        for rank in (0, 1):
            put(holder, rank, step)

    kept = list(range(6 - keep, 6))
    assert sorted(holder.inventory()) == kept
    for rank in (0, 1):
        assert [s for s in range(1, 6) if holder.get(rank, s) is not None] == kept


def test_one_ranks_puts_never_evict_another_ranks_snapshots() -> None:
    holder = SnapshotHolder(keep=1)
    old = put(holder, rank=1, step=1)
    for step in range(2, 5):
        put(holder, rank=0, step=step)

    assert holder.get(1, 1) == old
    assert holder.inventory() == {1: (2, [1]), 4: (2, [0])}


def test_an_older_step_arriving_late_does_not_displace_newer_ones() -> None:
    holder = SnapshotHolder(keep=1)
    newest = put(holder, rank=0, step=5)
    put(holder, rank=0, step=3)

    assert holder.get(0, 5) == newest
    assert holder.get(0, 3) is None


def test_inventory_maps_step_to_world_size_and_sorted_ranks() -> None:
    holder = SnapshotHolder(keep=2)
    for rank in (3, 0, 2):
        put(holder, rank, step=4, world_size=4)
    put(holder, rank=1, step=5, world_size=2)

    assert holder.inventory() == {4: (4, [0, 2, 3]), 5: (2, [1])}


def test_inventory_of_an_empty_holder_is_empty() -> None:
    assert SnapshotHolder(keep=2).inventory() == {}


def test_a_stored_blob_that_no_longer_matches_its_checksum_is_not_handed_out() -> None:
    holder = SnapshotHolder(keep=2)
    blob = put(holder, rank=0, step=3)
    world, stored, digest = holder._snaps[(0, 3)]
    flipped = bytes([stored[10] ^ 0x01])
    holder._snaps[(0, 3)] = (world, stored[:10] + flipped + stored[11:], digest)

    assert holder.get(0, 3) is None
    assert checksum(blob) == digest, "the original bytes still match: only the stored copy changed"


def test_a_blob_put_with_a_wrong_checksum_is_not_handed_out() -> None:
    holder = SnapshotHolder(keep=2)
    blob = blob_of(0, 3)
    holder.put(0, 3, 2, blob, checksum(blob + b"x"))

    assert holder.get(0, 3) is None


def test_put_keeps_a_private_copy_of_a_mutable_buffer() -> None:
    holder = SnapshotHolder(keep=2)
    buffer = bytearray(blob_of(0, 3))
    original = bytes(buffer)
    holder.put(0, 3, 2, buffer, checksum(original))
    buffer[:8] = b"\xff" * 8

    assert holder.get(0, 3) == original


def test_put_accepts_a_memoryview_and_copies_it() -> None:
    holder = SnapshotHolder(keep=2)
    buffer = bytearray(blob_of(0, 3))
    original = bytes(buffer)
    holder.put(0, 3, 2, memoryview(buffer), checksum(original))
    buffer[-1] ^= 0xFF

    got = holder.get(0, 3)
    assert isinstance(got, bytes) and got == original


def test_drop_after_forgets_every_ranks_snapshots_newer_than_the_step() -> None:
    holder = SnapshotHolder(keep=5)
    for step in range(1, 6):
        for rank in (0, 1):
            put(holder, rank, step)

    holder.drop_after(3)

    assert holder.inventory() == {1: (2, [0, 1]), 2: (2, [0, 1]), 3: (2, [0, 1])}
    assert holder.get(0, 4) is None and holder.get(1, 5) is None


def test_a_step_put_again_after_drop_after_is_the_new_one() -> None:
    holder = SnapshotHolder(keep=2)
    put(holder, rank=0, step=4)
    holder.drop_after(3)
    replacement = b"retrained step 4"
    holder.put(0, 4, 2, replacement, checksum(replacement))

    assert holder.get(0, 4) == replacement


def test_num_bytes_counts_the_blobs_held() -> None:
    holder = SnapshotHolder(keep=1)
    assert holder.num_bytes() == 0
    holder.put(0, 1, 2, b"a" * 100, checksum(b"a" * 100))
    holder.put(1, 1, 2, b"b" * 30, checksum(b"b" * 30))
    assert holder.num_bytes() == 130

    holder.put(0, 2, 2, b"c" * 10, checksum(b"c" * 10))  # evicts rank 0's step 1
    assert holder.num_bytes() == 40

    holder.drop_after(1)
    assert holder.num_bytes() == 30


def test_a_pinned_step_outlives_the_keep_window_until_the_next_pin() -> None:
    holder = SnapshotHolder(keep=2)
    for step in range(1, 4):
        holder.put(0, step, 1, b"x", checksum(b"x"))
    holder.pin(3)
    for step in range(4, 8):
        holder.put(0, step, 1, b"x", checksum(b"x"))
    assert sorted(holder.inventory()) == [3, 6, 7]
    holder.pin(7)
    assert sorted(holder.inventory()) == [6, 7]


def test_a_pin_between_snapshots_holds_the_newest_before_it() -> None:
    holder = SnapshotHolder(keep=1)
    for step in (2, 4, 6, 8):
        holder.put(1, step, 1, b"x", checksum(b"x"))
        if step == 4:
            holder.pin(5)
    assert sorted(holder.inventory()) == [4, 8]


def test_wait_for_answers_once_every_rank_holds_the_step_or_a_newer_one() -> None:
    holder = SnapshotHolder(keep=1)
    put(holder, rank=0, step=4)
    put(holder, rank=1, step=5)  # newer than asked: as safe (keep=1 dropped nothing of step 4's rank 0)

    assert holder.wait_for([0, 1], 4, timeout_s=0.0)
    assert not holder.wait_for([0, 1], 5, timeout_s=0.0)
    assert not holder.wait_for([0, 2], 4, timeout_s=0.0)  # rank 2 never sent anything


def test_wait_for_wakes_when_the_missing_snapshot_arrives() -> None:
    holder = SnapshotHolder(keep=2)
    put(holder, rank=0, step=3)
    timer = threading.Timer(0.05, put, args=(holder, 1, 3))
    timer.start()
    try:
        t0 = time.monotonic()
        assert holder.wait_for([0, 1], 3, timeout_s=10.0)
        assert time.monotonic() - t0 < 5.0
    finally:
        timer.cancel()


def test_a_newer_question_ends_an_older_wait_at_once() -> None:
    # The controller asks one question at a time: an older one belongs to a world given up,
    # and must not keep one of the holder's few threads until its timeout.
    holder = SnapshotHolder(keep=2)
    answers: list[bool] = []
    older = threading.Thread(target=lambda: answers.append(holder.wait_for([0], 9, timeout_s=30.0)))
    older.start()
    time.sleep(0.05)
    t0 = time.monotonic()
    assert not holder.wait_for([0], 1, timeout_s=0.0)
    older.join(timeout=5.0)

    assert answers == [False] and time.monotonic() - t0 < 5.0
