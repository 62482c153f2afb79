"""Per-step snapshots of one rank's training state, copied off the critical path.

Optimizer state only changes inside the optimizer step, so the copy of step N runs in the
background (a side CUDA stream into pinned host memory on GPU, a background thread on CPU) while
step N+1's forward and backward run, and ``fence()`` holds the next optimizer step until the copy
is done. The copy lands where the snapshot's blob keeps it: each host buffer is laid out as a
``checkpoint.wire`` blob, the header is written at capture (microseconds), and the copy thread
then only checksums the blob, a tree hash on all cores. The buffers are allocated once and
reused, each leased to one snapshot at a time. What is copied are ``train.zero_state``'s
fragments, in coordinates that do not depend on dp.
"""

from __future__ import annotations

import collections
import threading
import time
import traceback
import weakref
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol

import numpy as np
import torch

from ringtrain.checkpoint.retention import retained
from ringtrain.checkpoint.wire import BlobLayout, checksum, header_room
from ringtrain.train.zero_state import Fragment, ZeroState


@dataclass(frozen=True)
class Snapshot:
    """One rank's encoded state at the end of optimizer step ``step``.

    ``blob`` is a read-only view of the Snapshotter's host buffer, not a copy: the buffer is not
    reused while the view, or anything made from it, lives, so holding a blob holds a buffer.
    Pickling needs a copy, ``bytes(blob)``: the standard pickler refuses a view.
    """

    step: int
    rank: int
    world_size: int
    blob: memoryview
    checksum: str  # checkpoint.wire.checksum of blob (a named tree hash)
    copy_s: float  # device-to-host copy (the part the next optimizer step waits for)
    total_s: float  # copy + encode + checksum
    scalars: dict[str, Any] = field(default_factory=dict)  # the non-tensor state encoded in blob

    @property
    def num_bytes(self) -> int:
        return len(self.blob)


DeliverFn = Callable[[Snapshot], None]


class CopyEvent(Protocol):
    """A point in the copy stream's queue (``torch.cuda.Event``)."""

    def synchronize(self) -> None: ...


class CopyStreams(Protocol):
    """Where the device-to-host copies of a snapshot are queued, and how they are ordered
    against training's own stream."""

    def copying(self) -> AbstractContextManager[Any]:
        """Queue the copies issued inside on the side stream, after the work queued so far."""
        ...

    def record(self) -> CopyEvent:
        """An event recorded on the side stream now: it completes when the copies are done."""
        ...

    def hold_compute(self, event: CopyEvent) -> None:
        """Make training's stream wait for ``event`` before its next kernel."""
        ...


class CudaCopyStreams:
    """The copy on a side CUDA stream of ``device``."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)

    def copying(self) -> AbstractContextManager[Any]:
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        return torch.cuda.stream(self.stream)

    def record(self) -> CopyEvent:
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    def hold_compute(self, event: CopyEvent) -> None:
        assert isinstance(event, torch.cuda.Event)
        torch.cuda.current_stream(self.device).wait_event(event)


class HostBuffer:
    """One snapshot-sized host buffer laid out as a blob, and the float32 views into it that the
    state's arrays are copied into. Reused from step to step, leased to one snapshot at a time."""

    def __init__(self, layout: BlobLayout, *, pin: bool) -> None:
        self.layout = layout
        self.data = torch.empty(layout.num_bytes, dtype=torch.uint8, pin_memory=pin)
        self.bytes = self.data.numpy()
        # The layout starts each array on a 4-byte boundary, so these are plain views.
        self.arrays = [self.data[offset : offset + 4 * numel].view(torch.float32) for offset, numel in layout.spans]
        self._lease: Optional[weakref.ReferenceType[np.ndarray]] = None

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


class Snapshotter:
    """Copies this rank's state off the critical path after each optimizer step.

    Each capture takes a host buffer no snapshot holds, so a copy never writes into memory that
    a kept snapshot, a job still checksumming, or a caller holding a blob reads. ``keep + 1``
    buffers serve the ``keep`` newest snapshots and the one being taken; when all are held, the
    capture waits for the oldest job still running (its trim frees one: the copy thread fell a
    step behind, and training waits for it as it would at the fence), and only allocates another
    when a pin or a caller still holds them all. ``fence()`` is the only synchronisation
    the training loop sees: before the next optimizer step mutates state, the pending copy must
    be done. On GPU the copy is queued on a side stream into pinned buffers and the fence is a
    stream-to-stream wait, so the host never blocks; on CPU a background thread copies.
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
        streams: Optional[CopyStreams] = None,
        executor: Optional[Executor] = None,
        hash_threads: Optional[int] = None,
    ) -> None:
        """``streams`` defaults to a side CUDA stream on a CUDA device (none on CPU), and
        ``executor`` to one background thread; tests pass stand-ins for either.
        ``hash_threads``: threads the checksum uses (default: every CPU this process may use)."""
        self.zero = zero
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.deliver = deliver
        self.keep = keep
        self.hash_threads = hash_threads
        # One worker: jobs finish in capture order, so ``recent`` and deliveries stay ordered.
        self._pool = executor or ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"snapshot-r{rank}")
        if streams is None and device.type == "cuda":
            streams = CudaCopyStreams(device)
        self._streams = streams
        self._copy_done: Optional[CopyEvent] = None  # the newest capture's copy, for ``fence``
        self._copied = threading.Event()
        self._copied.set()
        self._pending: Optional[Future[Snapshot]] = None
        self._running: collections.deque[Future[Snapshot]] = collections.deque()  # jobs not done, oldest first
        self._layout: Optional[BlobLayout] = None
        self._layout_sizes: Optional[tuple[int, list[tuple[Any, ...]]]] = None  # what the layout was made for
        self.buffers: list[HostBuffer] = []
        self.num_allocations = 0  # host buffers allocated so far: none per step once warm
        self._lock = threading.Lock()
        self.recent: dict[int, Snapshot] = {}  # step -> snapshot: the newest ``keep``, and the pinned one
        self.pinned: Optional[int] = None
        self.errors: list[BaseException] = []

    def capture(self, step: int, scalars: dict[str, Any]) -> None:
        """Start snapshotting the state as it is now (call right after an optimizer step)."""
        self.fence()
        fragments = list(self.zero.fragments())
        layout, header = self._layout_for(fragments, step, scalars)
        buffer = self._free_buffer(layout)
        blob = buffer.lease()
        layout.write_header(buffer.bytes, header)
        sources = [tensor.detach() for frag in fragments for tensor in frag.tensors.values()]
        t0 = time.perf_counter()
        copy_done: Optional[CopyEvent] = None
        if self._streams is not None:
            with self._streams.copying():
                for host, source in zip(buffer.arrays, sources, strict=True):
                    host.copy_(source, non_blocking=True)
            copy_done = self._copy_done = self._streams.record()
        else:
            self._copied.clear()
        # The job gets its own event: ``self._copy_done`` may already be the next capture's by
        # the time the job runs, and its buffer would then be read before this copy lands.
        self._pending = self._pool.submit(self._run, step, scalars, sources, buffer.arrays, blob, t0, copy_done)
        self._running.append(self._pending)

    def fence(self) -> None:
        """Hold the next state change until the pending copy has left the live tensors."""
        if self._streams is not None and self._copy_done is not None:
            # The side stream runs its copies in order: the newest one done means all are.
            self._streams.hold_compute(self._copy_done)
        self._copied.wait()

    def wait(self) -> Optional[Snapshot]:
        """The pending snapshot, finished (tests and persistence use this)."""
        if self._pending is None:
            return None
        return self._pending.result()

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
        self.wait()
        with self._lock:
            for newer in [s for s in self.recent if s > step]:
                del self.recent[newer]

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._running.clear()
        self.buffers = []  # each goes once no snapshot still holds it

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

    def _free_buffer(self, layout: BlobLayout) -> HostBuffer:
        """A buffer of ``layout`` that nothing reads: one of the kept ones when it can be."""
        self.buffers = [b for b in self.buffers if b.layout is layout or b.leased()]  # a former layout's go
        while True:
            while self._running and self._running[0].done():
                self._running.popleft()  # a finished job's future would hold its snapshot's buffer
            mine = [b for b in self.buffers if b.layout is layout]
            free = next((b for b in mine if not b.leased()), None)
            if free is not None:
                return free
            if not mine or not self._running:
                break
            # Every buffer is kept or in flight: the copy thread is a step behind, and its
            # oldest job's trim frees the buffer of the snapshot that falls out of ``keep``.
            self._running[0].exception()  # waits; a failed job reports through its own future
        # The first capture allocates every buffer the pipeline needs at once (pinned memory of
        # a large state takes seconds); after that only a pin or a caller holding blobs costs one.
        for _ in range(max(1, self.keep + 1 - len(mine))):
            self.buffers.append(HostBuffer(layout, pin=self.device.type == "cuda"))
            self.num_allocations += 1
        return self.buffers[-1]

    def _run(
        self,
        step: int,
        scalars: dict[str, Any],
        sources: list[torch.Tensor],
        hosts: list[torch.Tensor],
        blob: memoryview,
        t0: float,
        copy_done: Optional[CopyEvent],
    ) -> Snapshot:
        try:
            if copy_done is not None:
                copy_done.synchronize()
            else:
                for host, source in zip(hosts, sources, strict=True):
                    host.copy_(source)  # releases the GIL: overlaps the step
        finally:
            copy_s = time.perf_counter() - t0
            self._copied.set()
        digest = checksum(blob, threads=self.hash_threads)
        snap = Snapshot(step, self.rank, self.world_size, blob, digest, copy_s, time.perf_counter() - t0, scalars)
        with self._lock:
            self.recent[step] = snap
            self._trim()
        if self.deliver is not None:
            try:
                self.deliver(snap)
            except Exception as exc:  # a holder being away must not stop training
                self.errors.append(_without_frames(exc))
        return snap


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
