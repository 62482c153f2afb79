"""A snapshot is of one step, whole: the optimizer step racing the copy, the copy staged in a device
buffer first, and a copy that fails part-way.

The GPU path runs here on a stand-in for the side stream that is as asynchronous as a CUDA stream:
one thread runs the queued copies in order, and holding training's stream blocks the training
thread until the copy it waits for is done. A gate in the copy into host memory stops it half-way,
at the moment the training thread's next optimizer step would land in the middle of it.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Iterator, Optional

import numpy as np
import pytest
import torch

from ringtrain.checkpoint.wire import STATE_KEYS, decode, verify
from ringtrain.train import snapshot as snapshot_module
from ringtrain.train.copy_stream import CopyEvent, Hold, device_has_room
from ringtrain.train.snapshot import STAGE_ALWAYS, Snapshotter
from ringtrain.train.zero_state import Fragment

RACE_WINDOW_S = 0.05  # how long a copy stopped half-way gives a training step that must be held to land


class ThreadEvent:
    def __init__(self, future: Future[float]) -> None:
        self.future = future

    def synchronize(self) -> None:
        self.future.result()

    def seconds(self) -> Optional[float]:
        return self.future.result() if self.future.done() else None


class ThreadHold:
    def __init__(self, seconds: float) -> None:
        self._seconds = seconds

    def seconds(self) -> Optional[float]:
        return self._seconds


STREAMS_MADE: list[ThreadStreams] = []


class ThreadStreams:
    """A side stream: the queued copies run in order on a thread of their own. Training's stream
    is the calling thread, so holding it blocks the caller until the copy is done."""

    def __init__(self) -> None:
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="side-stream")
        self.queued = 0
        STREAMS_MADE.append(self)

    def enqueue(self, copies: Callable[[], None]) -> CopyEvent:
        def run() -> float:
            t0 = time.perf_counter()
            copies()
            return time.perf_counter() - t0

        self.queued += 1
        return ThreadEvent(self.pool.submit(run))

    def hold_compute(self, event: CopyEvent) -> Hold:
        t0 = time.perf_counter()
        event.synchronize()
        return ThreadHold(time.perf_counter() - t0)


@pytest.fixture(autouse=True)
def side_streams_stopped() -> Iterator[None]:
    """Every stand-in side stream a test makes is stopped when it ends."""
    yield
    while STREAMS_MADE:
        STREAMS_MADE.pop().pool.shutdown(wait=True)


class SteppedZero:
    """Three parameters' state; step s writes values drawn from seed s (special floats
    included), so a blob tells bit for bit which step each of its arrays holds."""

    SIZES = {"a.w": ((6, 5), 0, 30), "b.b": ((7,), 0, 7), "c.w": ((4, 100), 37, 363)}

    def __init__(self) -> None:
        self.tensors = {(name, key): torch.zeros(numel) for name, (_, _, numel) in self.SIZES.items() for key in STATE_KEYS}

    def optimizer_step(self, step: int) -> None:
        gen = torch.Generator().manual_seed(step)
        for t in self.tensors.values():
            t.copy_(torch.randn(t.numel(), generator=gen))
            t[:3] = torch.tensor([-0.0, float("inf"), float("nan")])

    def fragments(self) -> Iterator[Fragment]:
        for name, (shape, start, _) in self.SIZES.items():
            yield Fragment(name, shape, start, {key: self.tensors[(name, key)] for key in STATE_KEYS})

    def state(self) -> dict[tuple[str, str], bytes]:
        return {key: t.numpy().astype("<f4").tobytes() for key, t in self.tensors.items()}


def _arrays(blob: Any) -> dict[tuple[str, str], bytes]:
    shard = decode(blob)
    return {(e["name"], e["key"]): shard.array(e).tobytes() for e in shard.entries}


def _steps_held(blob: Any, states: dict[int, dict[tuple[str, str], bytes]]) -> set[int]:
    """The steps whose values the blob's arrays hold (one for a whole snapshot)."""
    return {step for key, data in _arrays(blob).items() for step, state in states.items() if state[key] == data}


class HalfwayGate:
    """Stops the copy into host memory half-way (after its first array, or, staged, before the one
    copy), until the training thread has had its chance to take the next optimizer step.

    Where the step must not wait for this copy (``free_step``: staged), the gate waits for the step
    itself, however long a loaded machine takes to run it; where it must wait, the gate gives it a
    window to land in, which a held step never does."""

    def __init__(self) -> None:
        self.armed = False
        self.free_step = False
        self.halfway = threading.Event()
        self.training_at_fence = threading.Event()
        self.stepped = threading.Event()
        self.stepped_while_stopped: Optional[bool] = None

    def wait_for_training(self) -> None:
        self.halfway.set()
        assert self.training_at_fence.wait(10), "the training thread never came to its fence"
        self.stepped_while_stopped = self.stepped.wait(10 if self.free_step else RACE_WINDOW_S)


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> HalfwayGate:
    gate = HalfwayGate()
    real_copy_each = snapshot_module._copy_each

    def copy_each(hosts: list[torch.Tensor], sources: list[torch.Tensor], *, non_blocking: bool = False) -> None:
        real_copy_each(hosts[:1], sources[:1], non_blocking=non_blocking)
        if gate.armed:
            gate.wait_for_training()
        real_copy_each(hosts[1:], sources[1:], non_blocking=non_blocking)

    monkeypatch.setattr(snapshot_module, "_copy_each", copy_each)
    return gate


def _snapshotter(zero: SteppedZero, staging: str) -> Snapshotter:
    """The CPU path (``host``: a background thread copies) or the GPU path on the stand-in stream."""
    streams = None if staging == "host" else ThreadStreams()
    return Snapshotter(zero, rank=0, world_size=1, device=torch.device("cpu"), staging=staging if streams else "none",  # type: ignore[arg-type]
                       streams=streams)  # fmt: skip


def _two_steps_taken(zero: SteppedZero, snapshotter: Snapshotter) -> dict[int, dict[tuple[str, str], bytes]]:
    """Steps 1 and 2 trained and snapshotted as training does; each one's state."""
    states = {}
    for step in (1, 2):
        snapshotter.fence()
        zero.optimizer_step(step)
        states[step] = zero.state()
        snapshotter.capture(step, {"trainer_step": step})
        snapshotter.wait()
    return states


@pytest.mark.parametrize("staging", ["host", "none", STAGE_ALWAYS])
def test_the_optimizer_step_racing_the_copy_never_lands_in_the_snapshot(staging: str, gate: HalfwayGate,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    zero = SteppedZero()
    snapshotter = _snapshotter(zero, staging)
    if staging == STAGE_ALWAYS:  # the copy into host memory is the staging buffer's one copy: stop it before it
        real_enqueue = snapshotter._streams.enqueue  # type: ignore[union-attr]

        queued = []

        def enqueue(copies: Callable[[], None]) -> CopyEvent:
            queued.append(copies)
            into_host = len(queued) % 2 == 0  # the second of a capture's two copies

            def gated() -> None:
                if gate.armed and into_host:
                    gate.wait_for_training()
                copies()

            return real_enqueue(gated)

        monkeypatch.setattr(snapshotter._streams, "enqueue", enqueue)
    states = _two_steps_taken(zero, snapshotter)
    gate.armed, gate.free_step = True, staging == STAGE_ALWAYS
    snapshotter.fence()
    zero.optimizer_step(3)
    states[3] = zero.state()
    snapshotter.capture(3, {"trainer_step": 3})

    def next_step() -> None:  # the training thread: step 4's optimizer step, after its fence
        assert gate.halfway.wait(10)
        gate.training_at_fence.set()
        snapshotter.fence()
        zero.optimizer_step(4)
        gate.stepped.set()

    training = threading.Thread(target=next_step)
    training.start()
    snap = snapshotter.wait()
    training.join(10)
    assert snap is not None and snap.step == 3
    assert _steps_held(snap.blob, states | {4: zero.state()}) == {3}, "the snapshot mixes two steps"
    assert _arrays(snap.blob) == states[3] and verify(snap.blob, snap.checksum)
    assert snap.profile is not None and snap.profile.staged == (staging == STAGE_ALWAYS)
    # The fence after step 3's capture held training only where the copy into host memory reads
    # the live state: staged, step 4 landed while that copy was stopped, reading the staging buffer.
    assert gate.stepped_while_stopped is (staging == STAGE_ALWAYS)
    waited = snapshotter.fence_wait_s(3)
    assert waited is not None and waited > 0
    snapshotter.close()


@pytest.mark.parametrize("staging", ["host", STAGE_ALWAYS])
@pytest.mark.parametrize("point", ["before", "half-way", "after"])
def test_a_copy_that_fails_at_any_point_leaves_the_newest_whole_snapshot(point: str, staging: str,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The rank fails while it snapshots step 3: before the copy starts, half-way through it, or
    after it; what is left to restore from is step 2's snapshot, or step 3's, whole."""
    zero = SteppedZero()
    delivered: list[int] = []
    snapshotter = _snapshotter(zero, staging)
    snapshotter.deliver = lambda snap: delivered.append(snap.step)
    states = _two_steps_taken(zero, snapshotter)
    snapshotter.fence()
    zero.optimizer_step(3)
    states[3] = zero.state()
    real_copy_each = snapshot_module._copy_each

    def fails_half_way(hosts: list[torch.Tensor], sources: list[torch.Tensor], *, non_blocking: bool = False) -> None:
        real_copy_each(hosts[:1], sources[:1], non_blocking=non_blocking)
        raise RuntimeError("the rank failed half-way through the copy")

    if point == "half-way":
        if staging == STAGE_ALWAYS:  # the staged copy into host memory is one copy: it fails as it starts to land
            monkeypatch.setattr(torch.Tensor, "copy_", _fails_into_pinned_payload(snapshotter))
        else:
            monkeypatch.setattr(snapshot_module, "_copy_each", fails_half_way)
    if point != "before":
        snapshotter.capture(3, {"trainer_step": 3})
        if point == "half-way":
            with pytest.raises(RuntimeError, match="half-way"):
                snapshotter.wait()
        else:
            snapshotter.wait()
    monkeypatch.undo()
    newest = snapshotter.newest()
    survivor = 3 if point == "after" else 2
    assert newest is not None and newest.step == survivor and snapshotter.steps()[-1] == survivor
    assert _arrays(newest.blob) == states[survivor] and verify(newest.blob, newest.checksum)
    assert delivered[-1] == survivor, "a torn snapshot was handed to the holders"
    # Training goes on (restored from the survivor, or not): the next snapshots are whole again.
    snapshotter.fence()
    zero.optimizer_step(4)
    states[4] = zero.state()
    snapshotter.capture(4, {"trainer_step": 4})
    got = snapshotter.wait()
    assert got is not None and _arrays(got.blob) == states[4]
    # The failed copy's buffer served again: the newest two, the one being taken and, on the side
    # stream, the one still checksummed, as ever.
    assert snapshotter.num_allocations == snapshotter.keep + (2 if staging == STAGE_ALWAYS else 1)
    snapshotter.close()


def _fails_into_pinned_payload(snapshotter: Snapshotter) -> Callable[..., Any]:
    """``Tensor.copy_`` that lands the first half of a copy into a host buffer's payload, then fails."""
    real = torch.Tensor.copy_

    def copy_(self: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
        if any(self is b.payload for b in snapshotter.buffers):
            half = self.numel() // 2
            real(self[:half], src[:half])
            raise RuntimeError("the rank failed half-way through the copy")
        return real(self, src, non_blocking)

    return copy_


def test_staged_the_state_leaves_in_one_copy_from_the_staging_buffer() -> None:
    zero = SteppedZero()
    snapshotter = _snapshotter(zero, STAGE_ALWAYS)
    zero.optimizer_step(1)
    snapshotter.capture(1, {"trainer_step": 1})
    got = snapshotter.wait()
    assert got is not None and _arrays(got.blob) == zero.state()
    streams = snapshotter._streams
    assert isinstance(streams, ThreadStreams) and streams.queued == 2  # into the staging buffer, then out of it
    staging = snapshotter._staging
    assert staging is not None
    payload = np.frombuffer(got.blob, dtype=np.uint8)[got.num_bytes - 4 * staging.data.numel() :]
    assert payload.tobytes() == staging.data.numpy().tobytes()
    snapshotter.close()


def _staged(snapshotter: Snapshotter, step: int, **capture: Any) -> bool:
    snapshotter.capture(step, {}, **capture)
    got = snapshotter.wait()
    assert got is not None and got.profile is not None
    return got.profile.staged


def test_auto_stages_only_where_the_device_has_room() -> None:
    zero = SteppedZero()
    for staging, staged in (("auto", False), (STAGE_ALWAYS, True), ("none", False)):
        snapshotter = Snapshotter(zero, rank=0, world_size=1, device=torch.device("cpu"), staging=staging,  # type: ignore[arg-type]
                                  streams=ThreadStreams())  # fmt: skip
        assert _staged(snapshotter, 1) is staged, staging
        snapshotter.close()


def test_auto_decides_at_the_first_capture_after_a_step_not_at_a_restores() -> None:
    """A restore's capture has no step's peak behind it (its peak is the model's states alone):
    the room is judged at the first capture after a step, and then kept."""
    asked: list[int] = []

    def has_room(device: torch.device, num_bytes: int) -> bool:
        asked.append(num_bytes)
        return True

    zero = SteppedZero()
    snapshotter = Snapshotter(zero, rank=0, world_size=1, device=torch.device("cpu"), staging="auto",  # type: ignore[arg-type]
                              streams=ThreadStreams())  # fmt: skip
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(snapshot_module, "device_has_room", has_room)
        assert not _staged(snapshotter, 3, after_step=False) and asked == []
        assert _staged(snapshotter, 4) and _staged(snapshotter, 5)
    assert asked == [4 * sum(t.numel() for t in zero.tensors.values())]
    snapshotter.close()


def test_auto_copies_from_the_live_state_when_the_staging_buffer_cannot_be_had(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_memory(*args: Any) -> None:
        raise torch.OutOfMemoryError("no 4 KiB piece left")

    zero = SteppedZero()
    monkeypatch.setattr(snapshot_module, "device_has_room", lambda device, num_bytes: True)
    monkeypatch.setattr(snapshot_module, "DeviceStaging", no_memory)
    snapshotter = Snapshotter(zero, rank=0, world_size=1, device=torch.device("cpu"), staging="auto",  # type: ignore[arg-type]
                              streams=ThreadStreams())  # fmt: skip
    zero.optimizer_step(1)
    assert not _staged(snapshotter, 1)
    got = snapshotter.newest()
    assert got is not None and _arrays(got.blob) == zero.state()
    forced = Snapshotter(zero, rank=0, world_size=1, device=torch.device("cpu"), staging=STAGE_ALWAYS,  # type: ignore[arg-type]
                         streams=ThreadStreams())  # fmt: skip
    with pytest.raises(torch.OutOfMemoryError):
        forced.capture(1, {})
    snapshotter.close()
    forced.close()


def test_a_rank_without_state_snapshots_nothing_staged_or_not() -> None:
    class NoState:
        def fragments(self) -> Iterator[Fragment]:
            return iter(())

    snapshotter = Snapshotter(NoState(), rank=1, world_size=2, device=torch.device("cpu"), staging=STAGE_ALWAYS,  # type: ignore[arg-type]
                              streams=ThreadStreams())  # fmt: skip
    snapshotter.capture(1, {"trainer_step": 1})
    got = snapshotter.wait()
    assert got is not None and decode(got.blob).entries == []
    snapshotter.close()


def test_the_room_is_the_steps_peak_as_reserved_with_what_is_not_torchs(monkeypatch: pytest.MonkeyPatch) -> None:
    """80 GB: 70 GB reserved at the step's peak, 2 GB not torch's (the context, communication
    buffers), so a 4 GB buffer fits a 5% margin and a 5 GB one does not."""
    gb = 10**9
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (20 * gb, 80 * gb))  # 58 GB reserved now
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 58 * gb)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device: 70 * gb)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device: 60 * gb)  # not what the step took
    cuda = torch.device("cuda", 0)
    assert device_has_room(cuda, 4 * gb) and not device_has_room(cuda, 5 * gb)
    assert not device_has_room(torch.device("cpu"), 1)


@pytest.mark.parametrize("staging", ["none", STAGE_ALWAYS])
def test_a_snapshots_checksum_runs_beside_the_next_ones_copy(staging: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """On the side stream, step 3's snapshot is still being checksummed (on the host's cores)
    when step 4's is captured: the capture takes the spare buffer instead of waiting for it, the
    copy of step 4 goes on beside the checksum, and both snapshots are whole. Step 5's capture
    finds no buffer free until step 3's job ends."""
    zero = SteppedZero()
    snapshotter = Snapshotter(zero, rank=0, world_size=1, device=torch.device("cpu"), staging=staging,  # type: ignore[arg-type]
                              streams=ThreadStreams())  # fmt: skip
    states = _two_steps_taken(zero, snapshotter)
    hashing, release = threading.Event(), threading.Event()
    real_checksum = snapshot_module.checksum

    def slow_checksum(blob: Any, **kwargs: Any) -> str:
        hashing.set()
        assert release.wait(10), "the test never released the checksum"
        return real_checksum(blob, **kwargs)

    monkeypatch.setattr(snapshot_module, "checksum", slow_checksum)

    def step_and_capture(step: int) -> threading.Thread:
        snapshotter.fence()
        zero.optimizer_step(step)
        states[step] = zero.state()
        capture = threading.Thread(target=snapshotter.capture, args=(step, {"trainer_step": step}))
        capture.start()
        return capture

    try:
        step_and_capture(3).join(10)
        assert hashing.wait(10), "step 3's checksum never started"
        fourth = step_and_capture(4)
        fourth.join(10)
        assert not fourth.is_alive(), "step 4's capture waited for step 3's checksum"
        fifth = step_and_capture(5)
        fifth.join(RACE_WINDOW_S)
        assert fifth.is_alive(), "step 5's capture found a fifth buffer"
    finally:
        release.set()
    fifth.join(10)
    snapshotter.wait()
    assert snapshotter.steps() == [4, 5]
    for step in (4, 5):
        got = snapshotter.get(step)
        assert got is not None and _arrays(got.blob) == states[step] and verify(got.blob, got.checksum)
    assert snapshotter.num_allocations == snapshotter.keep + 2
    snapshotter.close()
