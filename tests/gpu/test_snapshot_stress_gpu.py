"""The snapshotter on CUDA under stress: a capture every step, a slow consumer, and the state
overwritten right after each fence.

On CUDA the copy of step N is queued on a side stream into page-locked host buffers (registered
with CUDA at the blob's exact size, not taken from torch's pinned pool), and ``fence()``
makes the training stream wait for it before the next optimizer step writes the state; staged
(``checkpoint.snapshot_staging=auto`` where the device has room; forced here), the fence waits for
the copy into a device buffer, and the copy into host memory reads that buffer while the next
step writes the live state. Each
snapshot must hold exactly the state of its own step: not a later step's values (the copy
overtaken by the next write), not a mix of two steps (a host buffer reused while its checksum
still reads it, or while a snapshot still holds it), and none may be lost or reordered while
delivery lags behind training. The consumer keeps copies, as a holder does, so the few host
buffers are reused for step after step.

The state is a stand-in for ZeRO's (fragments of fp32 tensors on the device); step s writes
``base + s`` into it, which is exact in fp32, so every snapshot can be checked bit for bit. Its
63 MB take milliseconds to copy to the host while the next step's writes are queued within
microseconds, so a write that did not wait for the copy would land in the middle of it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from ringtrain.checkpoint.wire import STATE_KEYS, decode
from ringtrain.train.copy_stream import device_has_room
from ringtrain.train.snapshot import PROFILES_KEPT, STAGE_ALWAYS, Snapshot, Snapshotter
from ringtrain.train.zero_state import Fragment

from .support import MARKS

pytestmark = MARKS

STEPS = 24
SIZES = {"layer.w": (1024, 2048), "layer.b": (4099,), "head.w": (3, 1024, 1024)}  # odd sizes too
DELIVERY_S = 0.03  # a holder slower than the step


class _State:
    """What ``Snapshotter`` reads from ZeroState: fragments of live device tensors."""

    def __init__(self, device: torch.device) -> None:
        gen = torch.Generator().manual_seed(0)
        self.base = {
            (name, key): torch.randn(int(np.prod(shape)), generator=gen)
            for name, shape in SIZES.items()
            for key in STATE_KEYS
        }
        self.base_on_device = {k: v.to(device, copy=True) for k, v in self.base.items()}
        self.live = {k: v.to(device, copy=True) for k, v in self.base.items()}

    def fragments(self) -> Iterator[Fragment]:
        for name, shape in SIZES.items():
            yield Fragment(name, shape, 0, {key: self.live[(name, key)] for key in STATE_KEYS})

    def write_step(self, step: int) -> None:
        """The optimizer step: every tensor becomes ``base + step``, on the current stream."""
        for key, tensor in self.live.items():
            torch.add(self.base_on_device[key], float(step), out=tensor)

    def expected(self, step: int) -> dict[tuple[str, str], bytes]:
        return {k: (v + float(step)).numpy().astype("<f4").tobytes() for k, v in self.base.items()}


@pytest.mark.parametrize("staging", [STAGE_ALWAYS, "none"])
def test_every_capture_holds_its_own_step_under_slow_delivery(staging: str) -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    state = _State(device)
    delivered: list[tuple[int, bytes]] = []
    lock = threading.Lock()

    def deliver(snap: Snapshot) -> None:
        time.sleep(DELIVERY_S)
        with lock:
            delivered.append((snap.step, bytes(snap.blob)))

    snapshotter = Snapshotter(
        state, rank=0, world_size=1, device=device, deliver=deliver, keep=3, staging=staging  # type: ignore[arg-type]
    )
    try:
        state.write_step(0)
        for step in range(1, STEPS + 1):
            snapshotter.fence()
            state.write_step(step)  # right after the fence: the previous copy must be out already
            snapshotter.capture(step, {"trainer_step": step})
        snapshotter.wait()
        # What CUDA sees of each host buffer: page-locked, at the blob's exact size.
        buffers = [(b.page_locked, b.data.is_pinned(), b.bytes.nbytes, b.layout.num_bytes) for b in snapshotter.buffers]
    finally:
        snapshotter.close()  # waits for the last deliveries
    assert not snapshotter.errors, snapshotter.errors

    steps = [step for step, _ in delivered]
    assert steps == list(range(1, STEPS + 1)), f"delivered out of order or lost: {steps}"
    wrong: list[str] = []
    for step, blob in delivered:
        shard = decode(blob)
        assert shard.step == step and shard.scalars["trainer_step"] == step
        want = state.expected(step)
        got: dict[tuple[str, str], Any] = {(e["name"], e["key"]): shard.array(e).tobytes() for e in shard.entries}
        assert got.keys() == want.keys()
        wrong += [f"step {step} {key}" for key in want if got[key] != want[key]]
    assert not wrong, f"{len(wrong)} tensors hold another step's values, e.g. {wrong[:4]}"
    # The newest ``keep`` stay in memory for recovery.
    assert snapshotter.steps() == list(range(STEPS - 2, STEPS + 1))
    # The host buffers were allocated once, the kept snapshots', the one in flight and the one
    # still checksummed, and then reused: the slow delivery held the captures back instead of
    # costing new ones.
    assert snapshotter.num_allocations == 3 + 2
    assert len(buffers) == 3 + 2 and all(locked and pinned and size == want for locked, pinned, size, want in buffers), buffers
    # Each snapshot left the device as it was asked to, from the staging buffer or not, and its
    # profile reads the device's clock: the copies' times, and every fence's wait once passed.
    newest = snapshotter.newest()
    assert newest is not None and newest.profile is not None
    profile = newest.profile
    assert profile.staged == (staging == STAGE_ALWAYS) and (profile.stage_s is not None) == profile.staged
    assert profile.page_locked
    assert profile.copy_s > 0 and profile.host_write_gbps > 0
    torch.cuda.synchronize(device)
    waits = [snapshotter.fence_wait_s(step) for step in range(STEPS - PROFILES_KEPT, STEPS)]  # the kept ones
    assert all(w is not None and w >= 0 for w in waits), waits


def test_the_device_has_room_for_a_small_buffer_and_not_for_its_whole_memory() -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.reset_peak_memory_stats(device)  # an earlier test's peak is not this one's step
    assert device_has_room(device, 1 << 20)
    assert not device_has_room(device, total)
