"""Per-step snapshots of one rank's training state, copied off the critical path.

Optimizer state only changes inside the optimizer step, so the copy of step N runs in a
background thread (a side CUDA stream into pinned buffers on GPU) while step N+1's forward and
backward run, and ``fence()`` holds the next optimizer step until the copy is done. Encoding
(``checkpoint.wire``) and checksumming happen after the fence, on the copy thread. What is
copied are ``train.zero_state``'s fragments, in coordinates that do not depend on dp.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol

import torch

from ringtrain.checkpoint.retention import retained
from ringtrain.checkpoint.wire import checksum, encode
from ringtrain.train.zero_state import Fragment, ZeroState


@dataclass(frozen=True)
class Snapshot:
    """One rank's encoded state at the end of optimizer step ``step``."""

    step: int
    rank: int
    world_size: int
    blob: bytes
    checksum: str  # sha256 of blob
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


class Snapshotter:
    """Copies this rank's state off the critical path after each optimizer step.

    Two host buffers alternate, so the copy of step N+1 never writes into memory that the
    encoder of step N is still reading. ``fence()`` is the only synchronisation the training
    loop sees: before the next optimizer step mutates state, the pending copy must be done.
    On GPU the copy is queued on a side stream into pinned buffers and the fence is a
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
    ) -> None:
        """``streams`` defaults to a side CUDA stream on a CUDA device (none on CPU), and
        ``executor`` to one background thread; tests pass stand-ins for either."""
        self.zero = zero
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.deliver = deliver
        self.keep = keep
        # One worker: jobs finish in capture order, so ``recent`` and deliveries stay ordered.
        self._pool = executor or ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"snapshot-r{rank}")
        if streams is None and device.type == "cuda":
            streams = CudaCopyStreams(device)
        self._streams = streams
        self._copy_done: Optional[CopyEvent] = None  # the newest capture's copy, for ``fence``
        self._copied = threading.Event()
        self._copied.set()
        self._pending: Optional[Future[Snapshot]] = None
        self._slot_jobs: list[Optional[Future[Snapshot]]] = [None, None]  # the last job per buffer
        self._buffers: list[Optional[list[dict[str, torch.Tensor]]]] = [None, None]
        self._turn = 0
        self._lock = threading.Lock()
        self.recent: dict[int, Snapshot] = {}  # step -> snapshot: the newest ``keep``, and the pinned one
        self.pinned: Optional[int] = None
        self.errors: list[BaseException] = []

    def capture(self, step: int, scalars: dict[str, Any]) -> None:
        """Start snapshotting the state as it is now (call right after an optimizer step)."""
        self.fence()
        slot = self._turn
        self._turn ^= 1
        previous = self._slot_jobs[slot]
        if previous is not None:
            previous.result()  # only the job that last used this buffer must be done with it
        fragments = list(self.zero.fragments())
        buffers = self._host_buffers(slot, fragments)
        t0 = time.perf_counter()
        copy_done: Optional[CopyEvent] = None
        if self._streams is not None:
            with self._streams.copying():
                for frag, host in zip(fragments, buffers):
                    for key, tensor in frag.tensors.items():
                        host[key].copy_(tensor.detach(), non_blocking=True)
            copy_done = self._copy_done = self._streams.record()
        else:
            self._copied.clear()
        # The job gets its own event: ``self._copy_done`` may already be the next capture's by
        # the time the job runs, and its host buffers would then be read before this copy lands.
        self._pending = self._slot_jobs[slot] = self._pool.submit(
            self._run, step, scalars, fragments, buffers, t0, copy_done
        )

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

    def _host_buffers(self, slot: int, fragments: list[Fragment]) -> list[dict[str, torch.Tensor]]:
        cached = self._buffers[slot]
        sizes = [{k: t.numel() for k, t in f.tensors.items()} for f in fragments]
        if cached is None or [{k: b.numel() for k, b in host.items()} for host in cached] != sizes:
            pin = self.device.type == "cuda"
            cached = [{k: torch.empty(n, dtype=torch.float32, pin_memory=pin) for k, n in s.items()} for s in sizes]
            self._buffers[slot] = cached
        return cached

    def _run(
        self,
        step: int,
        scalars: dict[str, Any],
        fragments: list[Fragment],
        buffers: list[dict[str, torch.Tensor]],
        t0: float,
        copy_done: Optional[CopyEvent],
    ) -> Snapshot:
        try:
            if copy_done is not None:
                copy_done.synchronize()
            else:
                for frag, host in zip(fragments, buffers):
                    for key, tensor in frag.tensors.items():
                        host[key].copy_(tensor.detach())  # releases the GIL: overlaps the step
        finally:
            copy_s = time.perf_counter() - t0
            self._copied.set()
        arrays = [(frag, {k: b.numpy() for k, b in host.items()}) for frag, host in zip(fragments, buffers)]
        blob = encode(step, self.rank, self.world_size, scalars, arrays)
        snap = Snapshot(step, self.rank, self.world_size, blob, checksum(blob), copy_s, time.perf_counter() - t0, scalars)
        with self._lock:
            self.recent[step] = snap
            self._trim()
        if self.deliver is not None:
            try:
                self.deliver(snap)
            except Exception as exc:  # a holder being away must not stop training
                self.errors.append(exc)
        return snap
