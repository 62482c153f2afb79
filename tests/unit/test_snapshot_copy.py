"""The snapshot copy: its ordering on the GPU path, driven on CPU through stand-in streams and a
stand-in executor that runs jobs only when the test says so; and its host buffers, which are
the blobs themselves and are reused from step to step, and which the side stream's copies land in
page-locked (registered with a stand-in CUDA runtime here) for exactly as long as a blob lives."""

from __future__ import annotations

import gc
import logging
from concurrent.futures import Executor, Future
from typing import Any, Callable, Iterator, Optional

import numpy as np
import pytest
import torch

from ringtrain.checkpoint.wire import SCALARS_ROOM, STATE_KEYS, decode, encode, verify
from ringtrain.train.copy_stream import CopyEvent, Hold
from ringtrain.train.snapshot import STAGE_ALWAYS, HostBuffer, Snapshotter
from ringtrain.train.zero_state import Fragment
from tests.unit.cudart_fake import RecordingCudart


class FakeEvent:
    def __init__(self, name: str, log: list[str]) -> None:
        self.name = name
        self.log = log

    def synchronize(self) -> None:
        self.log.append(f"sync {self.name}")

    def seconds(self) -> Optional[float]:
        return None


class FakeHold:
    def seconds(self) -> Optional[float]:
        return None


class FakeStreams:
    """Records what the GPU path asks of its streams, in order; the copies run as they are queued."""

    def __init__(self) -> None:
        self.log: list[str] = []
        self.recorded = 0

    def enqueue(self, copies: Callable[[], None]) -> CopyEvent:
        self.recorded += 1
        self.log.append(f"copy e{self.recorded}")
        copies()
        return FakeEvent(f"e{self.recorded}", self.log)

    def hold_compute(self, event: CopyEvent) -> Hold:
        assert isinstance(event, FakeEvent)
        self.log.append(f"hold {event.name}")
        return FakeHold()


class ManualExecutor(Executor):
    """Queues jobs and runs them on ``run_all``: the copy thread at its most delayed."""

    def __init__(self) -> None:
        self.jobs: list[tuple[Future[Any], Callable[..., Any], tuple[Any, ...], dict[str, Any]]] = []

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        future: Future[Any] = Future()
        self.jobs.append((future, fn, args, kwargs))
        return future

    def run_all(self) -> None:
        jobs, self.jobs = self.jobs, []
        for future, fn, args, kwargs in jobs:
            future.set_result(fn(*args, **kwargs))

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        self.run_all()


class FakeZero:
    """One parameter's state as live tensors the test mutates between steps."""

    def __init__(self) -> None:
        self.tensors = {key: torch.zeros(4) for key in ("param", "exp_avg", "exp_avg_sq")}

    def fragments(self) -> Iterator[Fragment]:
        yield Fragment("w", (4,), 0, dict(self.tensors))


def _snapshotter(zero: FakeZero, streams: FakeStreams, executor: ManualExecutor) -> Snapshotter:
    return Snapshotter(
        zero,  # type: ignore[arg-type]
        rank=0,
        world_size=1,
        device=torch.device("cpu"),
        streams=streams,
        executor=executor,
    )


def test_each_copy_job_waits_on_its_own_event() -> None:
    zero, streams, executor = FakeZero(), FakeStreams(), ManualExecutor()
    snap = _snapshotter(zero, streams, executor)
    for step in (1, 2):
        for t in zero.tensors.values():
            t.fill_(float(step))
        snap.capture(step, {"step": step})
    # Both captures were queued before either job ran: the first job must still wait for the
    # first copy, not for whatever event is newest when it runs.
    executor.run_all()
    assert [line for line in streams.log if line.startswith("sync")] == ["sync e1", "sync e2"]
    # The second capture held training's stream on the first copy before reading the state.
    assert streams.log[:3] == ["copy e1", "hold e1", "copy e2"]
    for step in (1, 2):
        got = snap.get(step)
        assert got is not None
        shard = decode(got.blob)
        for entry in shard.entries:
            np.testing.assert_array_equal(shard.array(entry), np.full(4, float(step), dtype=np.float32))
    snap.close()


def test_fence_holds_compute_on_the_newest_copy() -> None:
    zero, streams, executor = FakeZero(), FakeStreams(), ManualExecutor()
    snap = _snapshotter(zero, streams, executor)
    snap.fence()  # nothing copied yet: nothing to wait for
    assert streams.log == []
    snap.capture(1, {})
    snap.capture(2, {})
    snap.fence()
    assert streams.log[-1] == "hold e2"
    snap.close()
    assert snap.steps() == [1, 2]


def test_cpu_path_needs_no_streams() -> None:
    """Without streams the copy thread itself copies, and ``fence`` waits for it."""
    zero = FakeZero()
    snap = Snapshotter(zero, rank=0, world_size=1, device=torch.device("cpu"))  # type: ignore[arg-type]
    zero.tensors["param"].fill_(3.0)
    snap.capture(7, {})
    snap.fence()
    zero.tensors["param"].fill_(4.0)  # the next optimizer step, after the fence
    got = snap.wait()
    assert got is not None
    shard = decode(got.blob)
    param = next(e for e in shard.entries if e["key"] == "param")
    np.testing.assert_array_equal(shard.array(param), np.full(4, 3.0, dtype=np.float32))
    snap.close()


def test_a_state_offloaded_to_the_host_is_copied_by_the_thread_not_on_the_stream() -> None:
    """An offloaded optimizer keeps the state in host memory, off the device the streams serve:
    the copy thread copies it, and the fence waits for that thread."""
    zero, streams = FakeZero(), FakeStreams()
    snap = Snapshotter(zero, rank=0, world_size=1, device=torch.device("meta"), streams=streams)  # type: ignore[arg-type]
    zero.tensors["param"].fill_(3.0)
    snap.capture(7, {})
    snap.fence()
    zero.tensors["param"].fill_(4.0)
    got = snap.wait()
    assert got is not None and streams.log == []
    shard = decode(got.blob)
    param = next(e for e in shard.entries if e["key"] == "param")
    np.testing.assert_array_equal(shard.array(param), np.full(4, 3.0, dtype=np.float32))
    assert snap.fence_wait_s(7) is not None
    snap.close()


# --- the blob is the copy's buffer, and the buffers are reused ----------------------------------


class RandomZero:
    """Three parameters' state (odd sizes, one fragment starting mid-parameter) with values that
    change every step, special floats included, so a blob can be checked bit for bit."""

    SIZES = {"a.w": ((6, 5), 0, 30), "b.b": ((7,), 0, 7), "c.w": ((4, 100), 37, 363)}

    def __init__(self) -> None:
        self.tensors = {
            (name, key): torch.zeros(numel) for name, (_, _, numel) in self.SIZES.items() for key in STATE_KEYS
        }

    def set_step(self, step: int) -> None:
        gen = torch.Generator().manual_seed(step)
        for t in self.tensors.values():
            t.copy_(torch.randn(t.numel(), generator=gen))
            t[:4] = torch.tensor([-0.0, float("inf"), float("nan"), 1e-45])  # -0, inf, nan, a subnormal

    def fragments(self) -> Iterator[Fragment]:
        for name, (shape, start, _) in self.SIZES.items():
            yield Fragment(name, shape, start, {key: self.tensors[(name, key)] for key in STATE_KEYS})

    def expected(self) -> dict[tuple[str, str], bytes]:
        return {key: t.numpy().astype("<f4").tobytes() for key, t in self.tensors.items()}


def _arrays(blob: Any) -> dict[tuple[str, str], bytes]:
    shard = decode(blob)
    return {(e["name"], e["key"]): shard.array(e).tobytes() for e in shard.entries}


def _taken(zero: RandomZero, snapshotter: Snapshotter, steps: range) -> dict[int, dict[tuple[str, str], bytes]]:
    """Capture ``steps`` as training does (state written after each fence); each step's state."""
    states = {}
    for step in steps:
        snapshotter.fence()
        zero.set_step(step)
        states[step] = zero.expected()
        snapshotter.capture(step, {"trainer_step": step})
    snapshotter.wait()
    return states


def test_the_blob_is_the_buffer_the_copy_wrote_and_decodes_bit_for_bit() -> None:
    zero = RandomZero()
    snapshotter = Snapshotter(zero, rank=0, world_size=1, device=torch.device("cpu"))  # type: ignore[arg-type]
    states = _taken(zero, snapshotter, range(1, 2))
    snap = snapshotter.get(1)
    assert snap is not None
    blob = np.frombuffer(snap.blob, dtype=np.uint8)
    owner = [b for b in snapshotter.buffers if np.shares_memory(blob, b.bytes)]
    assert len(owner) == 1 and blob.size == owner[0].bytes.size, "the blob is not the copy's buffer"
    # Every array decoded from the blob is the very memory the copy wrote.
    shard = decode(snap.blob)
    for entry, host in zip(shard.entries, owner[0].arrays, strict=True):
        assert np.shares_memory(shard.array(entry), host.numpy())
    assert _arrays(snap.blob) == states[1]
    # Byte for byte the blob the copying encoder makes of the same state: one format.
    arrays = [(f, {k: t.numpy() for k, t in f.tensors.items()}) for f in zero.fragments()]
    assert bytes(snap.blob) == encode(1, 0, 1, {"trainer_step": 1}, arrays)
    assert verify(snap.blob, snap.checksum) and snap.checksum.startswith("sha256x64m:")
    assert snap.blob.readonly
    snapshotter.close()


def test_buffers_are_allocated_once_and_reused_for_every_step() -> None:
    zero = RandomZero()
    snapshotter = Snapshotter(zero, rank=0, world_size=1, device=torch.device("cpu"), keep=2)  # type: ignore[arg-type]
    states = _taken(zero, snapshotter, range(1, 13))
    assert snapshotter.num_allocations == 3  # the two kept snapshots and the one being taken
    assert snapshotter.steps() == [11, 12]
    for step in (11, 12):
        got = snapshotter.get(step)
        assert got is not None and _arrays(got.blob) == states[step] and verify(got.blob, got.checksum)
    snapshotter.close()


def test_a_blob_held_outside_keeps_its_buffer_from_being_reused() -> None:
    zero = RandomZero()
    snapshotter = Snapshotter(zero, rank=0, world_size=1, device=torch.device("cpu"), keep=1)  # type: ignore[arg-type]
    states = _taken(zero, snapshotter, range(1, 2))
    first = snapshotter.get(1)
    assert first is not None
    held = first.blob[10:]  # a slice outlives the snapshot object: it must hold the buffer too
    del first
    states.update(_taken(zero, snapshotter, range(2, 8)))
    assert snapshotter.steps() == [7]
    assert bytes(held) == _blob_of(states[1], 1)[10:]
    assert snapshotter.num_allocations == 2 + 1  # keep + 1, then one more for the held blob
    del held
    _taken(zero, snapshotter, range(8, 14))
    assert snapshotter.num_allocations == 3, "a freed buffer is taken again before a new one is made"
    snapshotter.close()


def _blob_of(state: dict[tuple[str, str], bytes], step: int) -> bytes:
    arrays = [
        (Fragment(name, shape, start, {}), {key: np.frombuffer(state[(name, key)], dtype="<f4") for key in STATE_KEYS})
        for name, (shape, start, _) in RandomZero.SIZES.items()
    ]
    return encode(step, 0, 1, {"trainer_step": step}, arrays)


def test_a_failing_delivery_holds_no_buffer() -> None:
    """A delivery error is kept for the caller, but not its frames: they hold the snapshot."""

    def deliver(snap: Any) -> None:
        raise ConnectionError(f"holder away at step {snap.step}")

    zero = RandomZero()
    snapshotter = Snapshotter(zero, rank=0, world_size=1, device=torch.device("cpu"), deliver=deliver, keep=1)  # type: ignore[arg-type]
    _taken(zero, snapshotter, range(1, 9))
    assert snapshotter.num_allocations == 2
    assert len(snapshotter.errors) == 8
    assert "holder away at step 8" in str(snapshotter.errors[-1])
    assert "in deliver" in snapshotter.errors[-1].__notes__[0]  # the traceback, as text
    snapshotter.close()


def test_scalars_that_outgrow_the_header_room_get_a_new_layout() -> None:
    zero = RandomZero()
    snapshotter = Snapshotter(zero, rank=0, world_size=1, device=torch.device("cpu"), keep=1)  # type: ignore[arg-type]
    _taken(zero, snapshotter, range(1, 3))
    small = snapshotter.buffers[0].layout
    big = {"notes": "x" * SCALARS_ROOM}
    for step in (3, 4):
        snapshotter.fence()
        zero.set_step(step)
        snapshotter.capture(step, {**big, "trainer_step": step})
        got = snapshotter.wait()
        assert got is not None and decode(got.blob).scalars == {**big, "trainer_step": step}
        assert _arrays(got.blob) == zero.expected()
    # The former layout's buffers went once no snapshot held them; two of the new one serve.
    assert [b.layout.header_bytes > small.header_bytes for b in snapshotter.buffers] == [True, True]
    assert snapshotter.num_allocations == 4
    snapshotter.close()


# --- the side stream's buffers are page-locked at the blob's exact size ----------------------------


def _locking(zero: RandomZero, cudart: RecordingCudart, *, keep: int = 2, device: str = "cpu",
             staging: str = "none") -> Snapshotter:  # fmt: skip
    """The GPU path, its copies on stand-in streams, its host buffers registered with a stand-in
    CUDA runtime (``device="meta"``: the state is off the device, as an offloaded optimizer's)."""
    return Snapshotter(zero, rank=0, world_size=1, device=torch.device(device), streams=FakeStreams(),  # type: ignore[arg-type]
                       keep=keep, staging=staging, cudart=cudart)  # fmt: skip


def _whole(snapshotter: Snapshotter, states: dict[int, dict[tuple[str, str], bytes]]) -> None:
    for step in snapshotter.steps():
        got = snapshotter.get(step)
        assert got is not None and _arrays(got.blob) == states[step] and verify(got.blob, got.checksum), step


def _buffer_of(snapshotter: Snapshotter, blob: memoryview) -> HostBuffer:
    return next(b for b in snapshotter.buffers if np.shares_memory(np.frombuffer(blob, np.uint8), b.bytes))


@pytest.mark.parametrize("staging", ["none", STAGE_ALWAYS])
def test_the_side_streams_buffers_are_registered_once_at_the_blobs_exact_size(staging: str) -> None:
    zero, cudart = RandomZero(), RecordingCudart()
    snapshotter = _locking(zero, cudart, staging=staging)
    states = _taken(zero, snapshotter, range(1, 13))
    num_bytes = snapshotter.buffers[0].layout.num_bytes
    assert num_bytes & (num_bytes - 1), "a power of two would not tell the exact size from torch's rounding"
    # The two kept snapshots', the one being taken and the one still checksummed: registered as
    # they were made, then reused.
    assert [size for _, size, _ in cudart.registered] == [num_bytes] * 4 and cudart.attempts == 4
    assert cudart.addresses() == [b.bytes.ctypes.data for b in snapshotter.buffers]
    assert all(b.page_locked and b.for_stream for b in snapshotter.buffers)
    _whole(snapshotter, states)
    newest = snapshotter.newest()
    assert newest is not None and newest.profile is not None and newest.profile.page_locked
    assert newest.profile.staged == (staging == STAGE_ALWAYS)
    snapshotter.close()


def test_a_page_locked_buffer_is_unregistered_once_after_its_last_blob_is_gone() -> None:
    """A caller keeps a slice of a blob after the snapshotter and its buffers are gone: that
    buffer stays registered until the slice goes, and every buffer is unregistered once."""
    zero, cudart = RandomZero(), RecordingCudart()
    snapshotter = _locking(zero, cudart, keep=1)
    _taken(zero, snapshotter, range(1, 4))
    snap = snapshotter.newest()
    assert snap is not None
    held = snap.blob[10:]
    held_at = _buffer_of(snapshotter, held).bytes.ctypes.data
    expected_ends = bytes(snap.blob[:4]) + bytes(snap.blob[-4:])
    snapshotter.close()
    del snapshotter, snap
    gc.collect()
    assert len(cudart.registered) == 3
    assert sorted(cudart.unregistered) == sorted(set(cudart.addresses()) - {held_at}), "the held blob's buffer went"
    del held
    gc.collect()
    assert sorted(cudart.unregistered) == sorted(cudart.addresses())
    assert cudart.ends_at_unregister[held_at] == expected_ends  # still the blob's memory when unregistered


def test_a_buffer_cuda_will_not_lock_stays_pageable_and_its_snapshots_whole(caplog: pytest.LogCaptureFixture) -> None:
    zero, cudart = RandomZero(), RecordingCudart(refuse_from=1)  # the host locks one buffer, no more
    snapshotter = _locking(zero, cudart)
    with caplog.at_level(logging.WARNING, logger="ringtrain.train.snapshot"):
        states = _taken(zero, snapshotter, range(1, 8))
    assert [b.page_locked for b in snapshotter.buffers] == [True, False, False, False]
    assert cudart.attempts == 4, "each buffer is asked for, the refused ones too"
    refusals = [r.getMessage() for r in caplog.records if "not page-locked" in r.getMessage()]
    assert len(refusals) == 3 and all(m.startswith("rank 0:") and "cudaError 2" in m for m in refusals)
    _whole(snapshotter, states)
    # Each snapshot's profile says whether its buffer was locked, so the bench's JSON shows it.
    for step in snapshotter.steps():
        got = snapshotter.get(step)
        assert got is not None and got.profile is not None
        assert got.profile.page_locked is _buffer_of(snapshotter, got.blob).page_locked
    snapshotter.close()
    del snapshotter
    gc.collect()
    assert cudart.unregistered == cudart.addresses()  # only what was registered


def test_an_offloaded_state_is_copied_into_pageable_buffers() -> None:
    zero, cudart = RandomZero(), RecordingCudart()
    snapshotter = _locking(zero, cudart, device="meta")
    states = _taken(zero, snapshotter, range(1, 4))
    assert cudart.attempts == 0 and not any(b.page_locked or b.for_stream for b in snapshotter.buffers)
    _whole(snapshotter, states)
    newest = snapshotter.newest()
    assert newest is not None and newest.profile is not None and not newest.profile.page_locked
    snapshotter.close()


def test_buffers_serve_only_the_copier_they_were_made_for() -> None:
    """The state leaves the device and comes back (an optimizer offloaded, say; here the device
    moves instead, which the capture cannot tell apart): a thread's copies never take a locked
    buffer, the side stream's never a pageable one, and the locked buffers go once free."""
    zero, cudart = RandomZero(), RecordingCudart()
    snapshotter = _locking(zero, cudart)
    states = _taken(zero, snapshotter, range(1, 4))
    on_stream = list(snapshotter.buffers)
    snapshotter.device = torch.device("meta")
    for step in range(4, 10):
        states.update(_taken(zero, snapshotter, range(step, step + 1)))
        snap = snapshotter.get(step)
        assert snap is not None and snap.profile is not None and not snap.profile.page_locked
        assert not any(np.shares_memory(np.frombuffer(snap.blob, np.uint8), b.bytes) for b in on_stream)
    _whole(snapshotter, states)
    del on_stream
    gc.collect()
    assert sorted(cudart.unregistered) == sorted(cudart.addresses()), "the locked buffers outlived their use"
    snapshotter.device = torch.device("cpu")
    states.update(_taken(zero, snapshotter, range(10, 13)))
    _whole(snapshotter, states)
    assert len(cudart.registered) == 8 and all(b.page_locked for b in snapshotter.buffers if b.for_stream)
    newest = snapshotter.newest()
    assert newest is not None and newest.profile is not None and newest.profile.page_locked
    snapshotter.close()


def test_a_failure_queuing_the_copy_out_of_the_staging_buffer_still_fences_the_staging_copy() -> None:
    """On CUDA both copies are queued as the capture runs; should queuing the second fail, the
    staging copy is queued already and reads the live state: the next optimizer step waits."""
    zero, streams = FakeZero(), FakeStreams()
    snapshotter = Snapshotter(zero, rank=0, world_size=1, device=torch.device("cpu"), streams=streams,  # type: ignore[arg-type]
                              staging=STAGE_ALWAYS, executor=ManualExecutor())  # fmt: skip
    real_enqueue = streams.enqueue

    def enqueue(copies: Callable[[], None]) -> CopyEvent:
        if streams.recorded == 1:
            raise RuntimeError("CUDA error: launch failure")
        return real_enqueue(copies)

    streams.enqueue = enqueue  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="launch failure"):
        snapshotter.capture(1, {})
    snapshotter.fence()
    assert streams.log == ["copy e1", "hold e1"]
