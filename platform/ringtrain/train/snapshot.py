"""Per-step snapshots of one rank's training state, copied off the critical path.

Optimizer state only changes inside the optimizer step, so the copy of step N runs in the
background (on a side CUDA stream on GPU, a background thread on CPU) while step N+1's forward
and backward run, and ``fence()`` holds the next optimizer step until the copy has read what that
step changes. On GPU, where the device has room, the state is first copied into a device buffer
(milliseconds at the device's memory bandwidth: all the optimizer step waits for), and leaves the
device from there in one copy into page-locked host memory, which may then take until the next
snapshot; without that room it is copied straight from the live tensors, and the optimizer step
waits for the whole copy (``checkpoint.snapshot_staging``); the state of an optimizer offloaded
to the host is copied by a thread, as on CPU. The copy lands where the snapshot's blob keeps it:
each host buffer is a blob's exact size (page-locked for the side stream by registering it with
CUDA, ``train.page_locked``: torch's pinned pool would round it up to a power of two), laid out
as a ``checkpoint.wire`` blob, the header is written at capture (microseconds), and the copy
thread then only checksums the blob, a tree hash on all cores, whose threads run below the
training thread's priority on GPU: the thread that queues the device's work wins a core over them.
A snapshot is of one step, whole, or is not taken: a copy that fails part-way leaves no snapshot
of its step. The buffers are allocated once and reused, each leased to one snapshot at a time.
What is copied are ``train.zero_state``'s fragments, this rank's own part of the state, in
coordinates that do not depend on dp. Each snapshot says where its time went (``CopyProfile``),
and the snapshotter how long each fence held training (``fence_wait_s``).
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
import traceback
import weakref
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Optional, Union

import numpy as np
import torch

from ringtrain.checkpoint.retention import retained
from ringtrain.config import SNAPSHOT_STAGINGS
from ringtrain.checkpoint.wire import BlobLayout, checksum, header_room
from ringtrain.train.copy_stream import CopyEvent, CopyStreams, CudaCopyStreams, Hold, device_has_room
from ringtrain.train.page_locked import Cudart, HostRegistrar, RegistrationError
from ringtrain.train.zero_state import Fragment, ZeroState

_log = logging.getLogger(__name__)

# The checksum's threads, on GPU: below the training thread, which must get a core the moment it
# has kernels to queue (Linux: a thread's nice value is its own).
BACKGROUND_NICE = 10
# Beyond checkpoint.snapshot_staging's values: staged whatever the device's room (which a job
# cannot ask for: the planner does not count the buffer, and ``auto`` stages only where it fits).
STAGE_ALWAYS = "always"
PROFILES_KEPT = 16  # the newest snapshots whose profile and fence wait can still be asked for


@dataclass(frozen=True)
class CopyProfile:
    """Where one snapshot's time went, in seconds. Device times are the device's own clock (None
    on CPU, where the copy thread's wall time is ``copy_s``)."""

    issue_s: float  # the capture on the host: layout, header, the copies queued (allocation and waits aside)
    alloc_s: float  # buffers allocated by this capture: host (page-locked on GPU) and device staging
    buffer_wait_s: float  # the capture waiting for a host buffer the copy thread had not yet freed
    staged: bool  # the state was copied into a device buffer first
    # The host buffer is page-locked, so the side stream's copy into it was asynchronous: False
    # where a thread copied, or where CUDA would not lock the buffer (the copy then ran pageable).
    page_locked: bool
    # That device-side copy: what the next optimizer step waits for (behind what was queued before it).
    stage_s: Optional[float]
    copy_s: float  # into host memory (the copy itself): what the optimizer step waits for when not staged
    checksum_s: float
    num_bytes: int

    @property
    def host_write_gbps(self) -> float:
        """The rate the state was written into host memory (GB/s)."""
        return self.num_bytes / self.copy_s / 1e9 if self.copy_s > 0 else float("inf")


@dataclass(frozen=True)
class Snapshot:
    """One rank's encoded state at the end of optimizer step ``step``.

    ``blob`` is a read-only view of the Snapshotter's host buffer, not a copy: the buffer is not
    reused while the view, or anything made from it, lives, so holding a blob holds a buffer (and
    keeps a page-locked one registered with CUDA, after the Snapshotter itself is gone).
    Pickling needs a copy, ``bytes(blob)``: the standard pickler refuses a view.
    """

    step: int
    rank: int
    world_size: int
    blob: memoryview
    checksum: str  # checkpoint.wire.checksum of blob (a named tree hash)
    copy_s: float  # from the capture until the copy into host memory was seen done
    total_s: float  # from the capture until the checksum was done (delivery aside)
    scalars: dict[str, Any] = field(default_factory=dict)  # the non-tensor state encoded in blob
    profile: Optional[CopyProfile] = None

    @property
    def num_bytes(self) -> int:
        return len(self.blob)


DeliverFn = Callable[[Snapshot], None]


class HostBuffer:
    """One snapshot-sized host buffer laid out as a blob, and the float32 views into it that the
    state's arrays are copied into. Reused from step to step, leased to one snapshot at a time.

    ``memory`` is the buffer's own array, of the layout's exact size; every view here and every
    blob leased from it holds that array, so page-locked memory stays registered while any of
    them lives (``train.page_locked``), whether or not this object does."""

    def __init__(self, layout: BlobLayout, memory: np.ndarray, *, for_stream: bool, page_locked: bool) -> None:
        assert memory.dtype == np.uint8 and memory.shape == (layout.num_bytes,)
        self.layout = layout
        # Made for the side stream's copies from the device (page-locked where CUDA would lock
        # it), or for a thread's copies between host tensors (never locked): each serves its own.
        self.for_stream = for_stream
        self.page_locked = page_locked
        self.bytes = memory
        self.data = torch.from_numpy(memory)
        # The layout starts each array on a 4-byte boundary, so these are plain views.
        self.arrays = [self.data[offset : offset + 4 * numel].view(torch.float32) for offset, numel in layout.spans]
        # Every array's bytes, back to back: what a staged copy writes at once.
        self.payload = self.data[layout.payload_start :].view(torch.float32)
        self._lease: Optional[weakref.ReferenceType[np.ndarray]] = None

    def serves(self, layout: BlobLayout, *, for_stream: bool) -> bool:
        return self.layout is layout and self.for_stream == for_stream

    def leased(self) -> bool:
        return self._lease is not None and self._lease() is not None

    def lease(self) -> memoryview:
        """A read-only view of the whole buffer for one snapshot. The view holds a fresh array,
        which every slice or array made from the view holds in turn: once it is gone, nothing
        reads this buffer and it may be written again."""
        holder = self.bytes.view()
        holder.flags.writeable = False
        self._lease = weakref.ref(holder)
        return holder.data


class DeviceStaging:
    """A device buffer holding one layout's arrays back to back, as the blob's payload holds them:
    the state is copied in at the device's memory bandwidth, and leaves for host memory from here
    in one copy while training goes on changing the live tensors."""

    def __init__(self, layout: BlobLayout, device: torch.device) -> None:
        self.layout = layout
        base = layout.payload_start
        self.data = torch.empty((layout.num_bytes - base) // 4, dtype=torch.float32, device=device)
        starts = [(offset - base) // 4 for offset, _ in layout.spans]
        self.arrays = [self.data[start : start + numel] for start, (_, numel) in zip(starts, layout.spans)]


class Snapshotter:
    """Copies this rank's state off the critical path after each optimizer step.

    Each capture takes a host buffer no snapshot holds, so a copy never writes into memory that
    a kept snapshot, a job still checksumming, or a caller holding a blob reads. ``keep + 1``
    buffers serve the ``keep`` newest snapshots and the one being taken, and on the side stream
    one more, for the snapshot still checksumming (``_buffers_needed``); when all are held, the
    capture waits for the oldest job still running (its trim frees one: the copy thread fell a
    step behind, and training waits for it as it would at the fence), and only allocates another
    when a pin or a caller still holds them all. ``fence()`` is the only synchronisation
    the training loop sees: before the next optimizer step mutates state, the pending copy must
    have read it. On GPU the copy is queued on a side stream and the fence is a stream-to-stream
    wait, so the host does not block (unless the state is offloaded to the host); staged, the
    fence waits only for the device-side copy, and the copy into host memory, queued behind it on
    the same stream, has until the next capture's staging (which the stream runs after it) to
    finish. On CPU a background thread copies.
    """

    def __init__(
        self,
        zero: ZeroState,
        *,
        rank: int,
        world_size: int,
        device: torch.device,
        deliver: Optional[Callable[[Snapshot], None]] = None,
        keep: int = 2,
        staging: str = "auto",
        streams: Optional[CopyStreams] = None,
        executor: Optional[Executor] = None,
        hash_threads: Optional[int] = None,
        cudart: Optional[Cudart] = None,
    ) -> None:
        """``streams`` defaults to a side CUDA stream on a CUDA device (none on CPU), and
        ``executor`` to one background thread; tests pass stand-ins for either. ``staging``:
        ``checkpoint.snapshot_staging``'s ``auto`` copies the state into a device buffer first
        where the device has room for it beside a step's peak, ``none`` never; ``STAGE_ALWAYS``
        (tests, benches) stages whatever the room. Without streams there is nothing to stage.
        ``hash_threads``: threads the checksum uses (default: every CPU this process may use).
        ``cudart`` page-locks the host buffers the side stream copies into (default: torch's CUDA
        runtime on a CUDA device; none elsewhere, where they stay pageable); tests pass a stand-in."""
        self.zero = zero
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.deliver = deliver
        self.keep = keep
        if staging not in (*SNAPSHOT_STAGINGS, STAGE_ALWAYS):
            raise ValueError(f"staging={staging!r}: expected one of {', '.join((*SNAPSHOT_STAGINGS, STAGE_ALWAYS))}")
        self.staging = staging
        self.hash_threads = hash_threads
        if streams is None and device.type == "cuda":
            streams = CudaCopyStreams(device)
        self._streams = streams
        self._registrar = HostRegistrar(cudart, device) if cudart is not None else HostRegistrar.for_device(device)
        # One worker: jobs finish in capture order, so ``recent`` and deliveries stay ordered.
        self._pool = executor or ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"snapshot-r{rank}")
        self._fence_on: Optional[tuple[int, CopyEvent]] = None  # (step, the copy the next fence holds on)
        self._copied = threading.Event()
        self._copied.set()
        self._copying_step: Optional[int] = None  # the step the CPU copy thread is copying
        # The newest snapshots' fence waits and profiles, by step (the snapshots themselves go by ``keep``).
        self.fence_waits: collections.OrderedDict[int, Union[Hold, float]] = collections.OrderedDict()
        self.profiles: collections.OrderedDict[int, CopyProfile] = collections.OrderedDict()
        self._pending: Optional[Future[Snapshot]] = None
        self._running: collections.deque[Future[Snapshot]] = collections.deque()  # jobs not done, oldest first
        self._layout: Optional[BlobLayout] = None
        self._layout_sizes: Optional[tuple[int, list[tuple[Any, ...]]]] = None  # what the layout was made for
        self._staging: Optional[DeviceStaging] = None  # for ``self._layout``, once it is decided
        self._staging_decided: Optional[BlobLayout] = None
        self._last_copied: Optional[CopyEvent] = None  # the newest copy queued on the side stream
        self.buffers: list[HostBuffer] = []
        self.num_allocations = 0  # host buffers allocated so far: none per step once warm
        self._lock = threading.Lock()
        self.recent: dict[int, Snapshot] = {}  # step -> snapshot: the newest ``keep``, and the pinned one
        self.pinned: Optional[int] = None
        self.errors: list[BaseException] = []

    def capture(self, step: int, scalars: dict[str, Any], *, after_step: bool = True) -> None:
        """Start snapshotting the state as it is now (call right after an optimizer step).
        ``after_step``: a training step ran since the device's peak was last reset, so its peak
        says whether a staging buffer has room (a restore's capture has no step behind it)."""
        t0 = time.perf_counter()
        self.fence()
        fragments = list(self.zero.fragments())
        layout, header = self._layout_for(fragments, step, scalars)
        sources = [tensor.detach() for frag in fragments for tensor in frag.tensors.values()]
        # An optimizer offloaded to the host keeps the state there: a thread copies it, as on a
        # CPU, rather than the capture itself (a copy between host tensors is no stream's).
        on_device = bool(sources) and all(t.device.type == self.device.type for t in sources)
        streams = self._streams if on_device else None
        allocations = self.num_allocations
        t_acquire = time.perf_counter()
        buffer = self._free_buffer(layout, for_stream=streams is not None)
        staging, staging_allocated = self._staging_for(layout, after_step) if streams is not None else (None, False)
        acquire_s = time.perf_counter() - t_acquire
        allocated = staging_allocated or self.num_allocations > allocations
        blob = buffer.lease()
        layout.write_header(buffer.bytes, header)
        t_copy = time.perf_counter()
        staged: Optional[CopyEvent] = None
        copied: Optional[CopyEvent] = None
        if streams is None:
            self._copied.clear()
            self._copying_step = step
        elif staging is None:
            copied = streams.enqueue(lambda: _copy_each(buffer.arrays, sources, non_blocking=True))
            self._fence_on = (step, copied)
        else:
            staged = streams.enqueue(lambda: torch._foreach_copy_(staging.arrays, sources))
            # Before the next copy is queued: should queuing it fail, the next optimizer step
            # must still wait for the staging copy, which CUDA runs whatever comes after it.
            self._fence_on = (step, staged)
            copied = streams.enqueue(lambda: buffer.payload.copy_(staging.data, non_blocking=True))
        if copied is not None:
            self._last_copied = copied
        timing = _CaptureTiming(
            issue_s=time.perf_counter() - t0 - acquire_s,
            alloc_s=acquire_s if allocated else 0.0,
            buffer_wait_s=0.0 if allocated else acquire_s,
            staged=staging is not None,
            page_locked=buffer.page_locked,
        )
        # The job holds the sources until the copy has read them, on either path: the side
        # stream reads them after the capture returns, and nothing else may free them first.
        copy = _Copy(sources, buffer.arrays if streams is None else None, staged, copied)
        # The job gets its own events: ``self._fence_on`` may already be the next capture's by
        # the time the job runs, and its buffer would then be read before this copy lands.
        self._pending = self._pool.submit(self._run, step, scalars, blob, t_copy, copy, timing)
        self._running.append(self._pending)

    def fence(self) -> None:
        """Hold the next state change until the pending copy has read the live tensors."""
        if self._fence_on is not None:
            # The side stream runs its copies in order: the newest one done means all are.
            step, event = self._fence_on
            assert self._streams is not None
            _keep_newest(self.fence_waits, step, self._streams.hold_compute(event))
            self._fence_on = None  # held once: a second fence before the next capture waits for nothing
        if self._copying_step is not None:
            t0 = time.perf_counter()
            self._copied.wait()
            _keep_newest(self.fence_waits, self._copying_step, time.perf_counter() - t0)
            self._copying_step = None

    def fence_wait_s(self, step: int) -> Optional[float]:
        """How long the fence after snapshot ``step`` held training (0: the copy had read the
        state already); None when no fence held on it, or, on GPU, until training's stream has
        passed the hold."""
        wait = self.fence_waits.get(step)
        return wait if wait is None or isinstance(wait, float) else wait.seconds()

    def wait(self) -> Optional[Snapshot]:
        """The pending snapshot, finished (tests and persistence use this)."""
        if self._pending is None:
            return None
        return self._pending.result()

    def settle(self) -> None:
        """Wait until no copy reads the live state, whether the pending one succeeded or not (a
        copy that failed part-way leaves no snapshot: its error is the pending one's)."""
        if self._pending is not None:
            self._pending.exception()

    def get(self, step: int) -> Optional[Snapshot]:
        with self._lock:
            return self.recent.get(step)

    def newest(self) -> Optional[Snapshot]:
        with self._lock:
            return self.recent[max(self.recent)] if self.recent else None

    def steps(self) -> list[int]:
        with self._lock:
            return sorted(self.recent)

    def pin(self, step: int) -> None:
        """Hold the newest snapshot at or before ``step`` beyond the ``keep`` newest, until the
        next pin (see ``retained``)."""
        with self._lock:
            self.pinned = step
            self._trim()

    def _trim(self) -> None:
        keep = retained(self.recent, keep=self.keep, pin=self.pinned)
        for old in [s for s in self.recent if s not in keep]:
            del self.recent[old]

    def forget_after(self, step: int) -> None:
        """Drop snapshots newer than ``step``: after a rollback they describe an abandoned future."""
        self.settle()
        with self._lock:
            for newer in [s for s in self.recent if s > step]:
                del self.recent[newer]

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._running.clear()
        self.buffers = []  # each goes once no snapshot still holds it
        self._staging = self._staging_decided = None

    def _layout_for(self, fragments: list[Fragment], step: int, scalars: dict[str, Any]) -> tuple[BlobLayout, bytes]:
        """The layout of this state's blob (the last one while the fragments keep their sizes
        and the scalars their room) and this step's header in it."""
        sizes = (
            header_room(scalars),
            [(f.name, f.shape, f.start, tuple((k, t.numel()) for k, t in f.tensors.items())) for f in fragments],
        )
        if self._layout is None or sizes != self._layout_sizes:
            room, places = sizes
            self._layout = BlobLayout([(f, dict(numels)) for f, (*_, numels) in zip(fragments, places)], room=room)
            self._layout_sizes = sizes
        return self._layout, self._layout.header(step, self.rank, self.world_size, scalars)

    def _free_buffer(self, layout: BlobLayout, *, for_stream: bool) -> HostBuffer:
        """A buffer of ``layout`` that nothing reads, for the side stream's copies or a thread's:
        one of the kept ones when it can be."""
        # A former layout's go, and the other copier's (an optimizer offloaded since, or back).
        self.buffers = [b for b in self.buffers if b.serves(layout, for_stream=for_stream) or b.leased()]
        while True:
            while self._running and self._running[0].done():
                self._running.popleft()  # a finished job's future would hold its snapshot's buffer
            mine = [b for b in self.buffers if b.serves(layout, for_stream=for_stream)]
            free = next((b for b in mine if not b.leased()), None)
            if free is not None:
                return free
            if not mine or not self._running:
                break
            # Every buffer is kept or in flight: the copy thread is a step behind, and its
            # oldest job's trim frees the buffer of the snapshot that falls out of ``keep``.
            self._running[0].exception()  # waits; a failed job reports through its own future
        # The first capture allocates every buffer the pipeline needs at once (locking the pages
        # of a large state takes seconds); after that only a pin or a caller holding blobs costs one.
        for _ in range(max(1, self._buffers_needed(for_stream) - len(mine))):
            self.buffers.append(self._new_buffer(layout, for_stream=for_stream))
            self.num_allocations += 1
        return self.buffers[-1]

    def _buffers_needed(self, for_stream: bool) -> int:
        """Host buffers a layout's snapshots take: the ``keep`` newest and the one being taken,
        and, on the side stream, one more. There the copy into host memory (the device's DMA)
        and the checksum (the host's cores) run apart, so a snapshot may still be checksummed
        while the next one is copied: the next capture then waits only for a checksum that takes
        longer than a step, not for the copy and the checksum together (on one H100's node, 0.24 s
        and about 0.75 s for TinyLlama's 13.2 GB; at those rates Qwen3-1.7B's 20.65 GB would take
        about 1.55 s for both, against its 1.46 s step on one H200). A thread's copy (a CPU, an
        offloaded optimizer) is its job's own first half: nothing to overlap."""
        return self.keep + (2 if for_stream else 1)

    def _new_buffer(self, layout: BlobLayout, *, for_stream: bool) -> HostBuffer:
        """A buffer of the layout's exact size, page-locked for the side stream's copies where
        there is CUDA to lock it: a thread's copy between host tensors gains nothing from locked
        pages. Where CUDA refuses, the buffer stays pageable: the copies into it run synchronously
        and slower, but the snapshots are whole (the warning, and their profiles, say so)."""
        if for_stream and self._registrar is not None:
            try:
                memory = self._registrar.page_locked(layout.num_bytes)
                return HostBuffer(layout, memory, for_stream=True, page_locked=True)
            except RegistrationError as exc:
                # The message, not the error: a log record kept (as a test's) would keep the
                # error's frames, the capture's among them, and the blob it leased with them.
                _log.warning("rank %d: a snapshot buffer is not page-locked, copies into it from the device run "
                             "synchronously: %s", self.rank, str(exc))  # fmt: skip
        memory = np.empty(layout.num_bytes, dtype=np.uint8)
        return HostBuffer(layout, memory, for_stream=for_stream, page_locked=False)

    def _staging_for(self, layout: BlobLayout, after_step: bool) -> tuple[Optional[DeviceStaging], bool]:
        """The device buffer this layout's state is staged in (None: copied from the live
        tensors), decided once per layout, at a capture right after a step under ``auto``; and
        whether it was allocated now."""
        if self._staging_decided is layout:
            return self._staging, False
        if self._staging is not None and self._last_copied is not None:
            self._last_copied.synchronize()  # the former buffer goes: nothing may still read it
        self._staging, self._staging_decided = None, None
        if self.staging == "auto" and not after_step:
            return None, False  # decided at the next capture, with a step's peak to go by
        self._staging_decided = layout
        num_bytes = layout.num_bytes - layout.payload_start
        if not (self.staging == STAGE_ALWAYS or (self.staging == "auto" and device_has_room(self.device, num_bytes))):
            return None, False
        try:
            self._staging = DeviceStaging(layout, self.device)
        except torch.OutOfMemoryError:
            if self.staging == STAGE_ALWAYS:
                raise
            return None, False  # the room was there but not in one piece: copied from the live state
        return self._staging, True

    def _run(self, step: int, scalars: dict[str, Any], blob: memoryview, t0: float, copy: _Copy,
             timing: _CaptureTiming) -> Snapshot:  # fmt: skip
        try:
            if copy.hosts is not None:
                t_thread = time.perf_counter()
                try:
                    _copy_each(copy.hosts, copy.sources)  # releases the GIL: overlaps the step
                finally:
                    self._copied.set()
                thread_copy_s: Optional[float] = time.perf_counter() - t_thread
            else:
                assert copy.copied is not None
                copy.copied.synchronize()
                thread_copy_s = None
        except BaseException as exc:
            # A snapshot is of one step, whole, or is not taken: this one is not. Its buffer is
            # free again once this frame, which the error's traceback keeps, lets go of the blob.
            del blob
            _log.warning("rank %d: the snapshot of step %d is not taken, its copy failed: %s", self.rank, step, exc)
            raise
        copy_s = time.perf_counter() - t0
        device_copy_s = copy.copied.seconds() if copy.copied is not None else None
        t_hash = time.perf_counter()
        digest = checksum(blob, threads=self.hash_threads, thread_setup=_below_training if self._streams else None)
        profile = CopyProfile(
            **asdict(timing),
            stage_s=copy.staged.seconds() if copy.staged is not None else None,
            copy_s=next(s for s in (device_copy_s, thread_copy_s, copy_s) if s is not None),
            checksum_s=time.perf_counter() - t_hash,
            num_bytes=len(blob),
        )
        total_s = time.perf_counter() - t0
        snap = Snapshot(step, self.rank, self.world_size, blob, digest, copy_s, total_s, scalars, profile)
        with self._lock:
            self.recent[step] = snap
            self._trim()
            _keep_newest(self.profiles, step, profile)
        if self.deliver is not None:
            try:
                self.deliver(snap)
            except Exception as exc:  # a holder being away must not stop training
                self.errors.append(_without_frames(exc))
        return snap


@dataclass(frozen=True)
class _Copy:
    """What one snapshot's job copies, or waits for: the live tensors it reads, the host arrays
    its thread copies them into (None: the side stream copies), and the side stream's events."""

    sources: list[torch.Tensor]
    hosts: Optional[list[torch.Tensor]]
    staged: Optional[CopyEvent]
    copied: Optional[CopyEvent]


@dataclass(frozen=True)
class _CaptureTiming:
    """What a capture measured on the host: its snapshot's ``CopyProfile`` fields of the same names."""

    issue_s: float
    alloc_s: float
    buffer_wait_s: float
    staged: bool
    page_locked: bool


def _keep_newest(table: collections.OrderedDict[int, Any], step: int, value: Any) -> None:
    table[step] = value
    while len(table) > PROFILES_KEPT:
        table.popitem(last=False)


def _copy_each(hosts: list[torch.Tensor], sources: list[torch.Tensor], *, non_blocking: bool = False) -> None:
    for host, source in zip(hosts, sources, strict=True):
        host.copy_(source, non_blocking=non_blocking)


def _below_training() -> None:
    """Run the calling thread below the training thread's priority (a checksum thread, as it starts)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_NICE)
    except (AttributeError, OSError):  # not Linux, or not allowed: the default priority serves
        pass


def _without_frames(exc: BaseException) -> BaseException:
    """``exc`` with its traceback kept as text: a traceback holds its frames, and a frame of the
    delivery holds the snapshot, whose buffer could then never be reused."""
    exc.add_note("".join(traceback.format_exception(exc)).rstrip())
    seen: set[int] = set()
    link: Optional[BaseException] = exc
    while link is not None and id(link) not in seen:
        seen.add(id(link))
        link.__traceback__ = None
        link = link.__cause__ or link.__context__
    return exc
