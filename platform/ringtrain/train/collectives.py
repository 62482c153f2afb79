"""The collective recorder: every torch.distributed call of this process, in a bounded ring buffer.

A hang is diagnosed by comparing what each rank was doing when the job stopped moving; this
module is the per-rank half of that (``ringtrain.policies.hangs`` is the other). ``install()``
wraps the ``torch.distributed`` functions that the platform (attention ring P2P, Ulysses
all-to-all, ``mesh.all_reduce_mean``) and DeepSpeed's ``TorchBackend`` call, in both namespaces
they are reached through (``torch.distributed`` and ``torch.distributed.distributed_c10d``,
whose functions call each other through module globals). Each call becomes one record:

    group        the group's name (the same on every member: groups are created collectively,
                 in one order) and ``group_ranks``, its global ranks
    seq          1-based count of this process's calls on that group
    index        0-based count of this process's calls on any group
    op, shapes, dtype, peers (P2P: the global ranks sent to / received from)
    start, end   wall-clock seconds; ``end`` is None while in flight. For async ops and P2P
                 handles the call ends when ``wait()`` has returned on every handle.
    device_done  CUDA only: whether the GPU has finished it (None on CPU). NCCL calls return
                 to the host at once, so a rank stuck on a collective blocks later, in a
                 synchronisation; this says which collective that is.
    site         the caller, "path:line function": the first frame outside torch, DeepSpeed,
                 this module and the attention package's transport (``transport.py``)
    thread, error

Calls nested inside a recorded call (``batch_isend_irecv`` posting ``isend``s,
``all_gather_object`` gathering sizes) are not recorded again, so every member of a group counts
the same calls. Records leave as plain dicts; a diagnostic thread may read (``records()``,
``state()``, ``diagnostics()``) while the training thread writes: the buffer is guarded by a lock
and readers get copies.

Install before DeepSpeed's engine is built if you can: its ``TorchBackend`` keeps references to
``all_gather_into_tensor`` / ``reduce_scatter_tensor`` from its construction (``install()``
rebinds an existing backend, and calling it again after the engine is built does the same).
Call ``reset()`` whenever the process group is recreated (an elastic resize): group names and
sequence numbers start again with it.
"""

from __future__ import annotations

import collections
import functools
import inspect
import sys
import threading
import time
import weakref
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from ringtrain.train.collective_calls import OPS, OpSpec, describe, site_file
from ringtrain.train.forensics import flight_recorder_dump, snapshot_stacks

Record = dict[str, Any]
DEFAULT_CAPACITY = 4096
_ERROR_CHARS = 300


class _Record:
    __slots__ = ("group", "group_ranks", "seq", "index", "op", "shapes", "dtype", "peers", "start", "end",
                 "site", "thread", "error", "event")
    EXPORTED = __slots__[:-1]

    def __init__(
        self, group: str, group_ranks: list[int], seq: int, index: int, op: str, shapes: list[Any],
        dtype: str, peers: list[int], start: float, site: str, thread: str,
    ) -> None:
        self.group, self.group_ranks, self.seq, self.index, self.op = group, group_ranks, seq, index, op
        self.shapes, self.dtype, self.peers = shapes, dtype, peers
        self.start, self.site, self.thread = start, site, thread
        self.end: Optional[float] = None
        self.error: Optional[str] = None
        self.event: Any = None  # torch.cuda.Event once a CUDA call has returned

    def device_done(self) -> Optional[bool]:
        return None if self.event is None else bool(self.event.query())

    def as_dict(self) -> Record:
        out = {name: getattr(self, name) for name in self.EXPORTED}
        out["shapes"] = [list(shape) for shape in self.shapes]
        out["device_done"] = self.device_done()
        return out


def _timing_event() -> Any:
    """A CUDA event recorded now on the current stream, able to time the span to another."""
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


class _AsyncCall:
    """The handles one async call returned; the record ends when the last one has been waited."""

    __slots__ = ("recorder", "record", "pending", "cuda")

    def __init__(self, recorder: CollectiveRecorder, record: _Record, pending: int, cuda: bool) -> None:
        self.recorder, self.record, self.pending, self.cuda = recorder, record, pending, cuda

    def one_done(self) -> None:
        self.pending -= 1
        if self.pending == 0:
            self.recorder._complete(self.record, self.cuda)


class _TrackedWork:
    """A ``Work`` handle whose ``wait()`` is recorded; everything else passes through."""

    __slots__ = ("_work", "_call", "_waited")

    def __init__(self, work: Any, call: _AsyncCall) -> None:
        self._work, self._call, self._waited = work, call, False

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        record, recorder = self._call.record, self._call.recorder
        tid = threading.get_ident()
        recorder._inside[tid] = record
        before = _timing_event() if self._call.cuda else None
        entered = time.perf_counter()
        try:
            result = self._work.wait(*args, **kwargs)
        except BaseException as exc:
            record.error, record.end = repr(exc)[:_ERROR_CHARS], time.time()
            raise
        finally:
            recorder._left(tid, time.perf_counter() - entered)
        if before is not None:
            recorder._stalled(tid, before, _timing_event())
        if not self._waited:
            self._waited = True
            self._call.one_done()
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


class CollectiveRecorder:
    """Records this process's collectives while installed; one per process (see ``install``)."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        self.capacity = capacity
        self._lock = threading.Lock()
        self._local = threading.local()
        self._buffer: collections.deque[_Record] = collections.deque(maxlen=capacity)
        # CUDA records the GPU may not have finished, oldest first (done ones are dropped lazily).
        self._on_device: collections.deque[_Record] = collections.deque(maxlen=capacity)
        self._seqs: dict[str, int] = {}
        self._num_issued = 0
        self._inside: dict[int, _Record] = {}  # thread ident -> the record it is blocked in
        # Seconds each thread has spent blocked in collectives and wait(): a step's time minus
        # its growth is the step's compute, which tells a straggler from the ranks waiting on it.
        self._blocked_s: dict[int, float] = {}
        # CUDA only: (before, after) timing events around each stall of a thread's stream.
        self._stalls: dict[int, list[tuple[Any, Any]]] = {}
        self._last_progress = time.time()
        self._last_thread = ""
        self._groups: weakref.WeakKeyDictionary[Any, tuple[str, tuple[int, ...]]] = weakref.WeakKeyDictionary()
        self._site_files: dict[str, Optional[str]] = {}  # code file -> its short path, None: skipped
        self._originals: dict[tuple[Any, str], Callable[..., Any]] = {}

    # --- installing ---------------------------------------------------------------------------

    def _install(self) -> None:
        wrappers: dict[Callable[..., Any], Callable[..., Any]] = {}
        for name, spec in OPS.items():
            if not hasattr(c10d, name):  # an op this torch version does not have
                continue
            original: Callable[..., Any] = getattr(c10d, name)
            if original not in wrappers:
                wrappers[original] = self._wrap(name, spec, original)
            for module in (dist, c10d):
                if getattr(module, name, None) is original:
                    self._originals[(module, name)] = original
                    setattr(module, name, wrappers[original])
        self.rebind_deepspeed()

    def _uninstall(self) -> None:
        unwrap = {getattr(module, name): original for (module, name), original in self._originals.items()}
        for (module, name), original in self._originals.items():
            setattr(module, name, original)
        _rebind_deepspeed(unwrap)
        self._originals.clear()

    def rebind_deepspeed(self) -> None:
        """Point DeepSpeed's backend, if built, at the wrappers (it caches two functions)."""
        _rebind_deepspeed({original: getattr(module, name) for (module, name), original in self._originals.items()})

    def _wrap(self, name: str, spec: OpSpec, fn: Callable[..., Any]) -> Callable[..., Any]:
        positions = {p: i for i, p in enumerate(inspect.signature(fn).parameters)}

        def arg(args: tuple[Any, ...], kwargs: dict[str, Any], key: str) -> Any:
            if key in kwargs:
                return kwargs[key]
            i = positions.get(key, len(args))
            return args[i] if i < len(args) else None

        @functools.wraps(fn)
        def recorded(*args: Any, **kwargs: Any) -> Any:
            if getattr(self._local, "depth", 0):
                return fn(*args, **kwargs)
            if name == "batch_isend_irecv":
                ops = arg(args, kwargs, "p2p_op_list") or []
                group = ops[0].group if ops else None
            else:
                group = arg(args, kwargs, "group")
            shapes, dtype, peers, cuda = describe([arg(args, kwargs, t) for t in spec.tensors])
            peer = arg(args, kwargs, spec.peer) if spec.peer is not None else None
            if peer is not None:
                peers.append(int(peer))
            record = self._begin(name, group, shapes, dtype, peers)
            tid = threading.get_ident()
            self._inside[tid] = record
            self._local.depth = 1
            before = _timing_event() if cuda else None
            entered = time.perf_counter()
            try:
                result = fn(*args, **kwargs)
            except BaseException as exc:
                record.error, record.end = repr(exc)[:_ERROR_CHARS], time.time()
                raise
            finally:
                self._local.depth = 0
                self._left(tid, time.perf_counter() - entered)
            if isinstance(result, dist.Work):
                return _TrackedWork(result, _AsyncCall(self, record, 1, cuda))
            if isinstance(result, list) and result and all(isinstance(w, dist.Work) for w in result):
                call = _AsyncCall(self, record, len(result), cuda)
                return [_TrackedWork(w, call) for w in result]
            if before is not None:
                # A blocking call made this stream wait for the collective: time that stall.
                self._stalled(tid, before, _timing_event())
            self._complete(record, cuda)
            return result

        return recorded

    # --- recording (the calling thread) -------------------------------------------------------

    def _group(self, group: Any) -> tuple[str, tuple[int, ...]]:
        pg = group if group is not None else c10d._get_default_group()
        found = self._groups.get(pg)
        if found is None:
            found = (str(pg.group_name), tuple(dist.get_process_group_ranks(pg)))
            self._groups[pg] = found
        return found

    def _begin(self, name: str, group: Any, shapes: list[Any], dtype: str, peers: list[int]) -> _Record:
        try:
            group_name, group_ranks = self._group(group)
        except Exception:  # a group this rank is not in, or no process group at all
            group_name, group_ranks = "?", ()
        thread = threading.current_thread().name
        site = self._site()
        with self._lock:
            seq = self._seqs.get(group_name, 0) + 1
            self._seqs[group_name] = seq
            record = _Record(group_name, list(group_ranks), seq, self._num_issued, name, shapes, dtype, peers,
                             time.time(), site, thread)
            self._num_issued += 1
            self._buffer.append(record)
            self._last_thread = thread
        return record

    def _left(self, tid: int, blocked_s: float = 0.0) -> None:
        """The thread ``tid`` returned from a blocking call or ``wait()`` after ``blocked_s``."""
        self._inside.pop(tid, None)
        self._blocked_s[tid] = self._blocked_s.get(tid, 0.0) + blocked_s
        self._last_progress = time.time()

    def _stalled(self, tid: int, before: Any, after: Any) -> None:
        """The thread's stream waited for a collective between events ``before`` and ``after``."""
        self._stalls.setdefault(tid, []).append((before, after))

    def blocked_s(self) -> float:
        """Seconds the calling thread has spent blocked in collectives so far (a running total:
        take the difference over a step).

        On gloo the thread itself blocks, and the host clock measures it. A CUDA collective
        returns at once and its stream waits instead, so the host would see the wait later, at
        the next synchronisation, and count it as compute: there the stream's stalls are timed
        with CUDA events around each blocking call and ``wait()``, and added here once done
        (the caller has synchronised: a step ends by reading its loss).
        """
        tid = threading.get_ident()
        stalls = self._stalls.pop(tid, [])
        if stalls:
            stalls[-1][1].synchronize()
            device_s = sum(before.elapsed_time(after) for before, after in stalls) / 1000.0
            self._blocked_s[tid] = self._blocked_s.get(tid, 0.0) + device_s
        return self._blocked_s.get(tid, 0.0)

    def _complete(self, record: _Record, cuda: bool) -> None:
        record.end = time.time()
        if cuda:
            # Recorded on the caller's stream, which the collective's stream has been joined to.
            event = torch.cuda.Event()
            event.record()
            record.event = event
            with self._lock:
                self._drop_finished()
                self._on_device.append(record)

    def _drop_finished(self) -> None:
        while self._on_device and self._on_device[0].device_done():
            self._on_device.popleft()

    def _site(self) -> str:
        frame: Any = sys._getframe(2)
        while frame is not None:
            filename = frame.f_code.co_filename
            try:
                short = self._site_files[filename]
            except KeyError:
                short = self._site_files[filename] = site_file(filename)
            if short is not None:
                return f"{short}:{frame.f_lineno} {frame.f_code.co_name}"
            frame = frame.f_back
        return "?"

    # --- reading (any thread) -----------------------------------------------------------------

    def reset(self) -> None:
        """Forget every record and counter: the process group was recreated."""
        with self._lock:
            self._buffer.clear()
            self._on_device.clear()
            self._seqs.clear()
            self._num_issued = 0
            self._inside.clear()
            self._groups = weakref.WeakKeyDictionary()
            self._last_progress = time.time()

    def records(self) -> list[Record]:
        """A copy of the buffer, oldest first."""
        with self._lock:
            return [r.as_dict() for r in self._buffer]

    def state(self) -> dict[str, Any]:
        """Where this process is now.

        ``in_collective``: the call a thread is blocked in (the oldest if several), else on
        CUDA the oldest call the GPU has not finished, else None. ``last_progress``: when a
        blocking call or ``wait()`` last returned. ``group_seqs``, ``num_issued``: the counters,
        which survive the buffer's eviction. ``last_thread``: who issued the latest call.
        """
        with self._lock:
            self._drop_finished()
            inside = sorted(self._inside.copy().values(), key=lambda r: r.start)
            current = inside[0] if inside else (self._on_device[0] if self._on_device else None)
            return {
                "in_collective": current.as_dict() if current is not None else None,
                "last_progress": self._last_progress,
                "group_seqs": dict(self._seqs),
                "num_issued": self._num_issued,
                "last_thread": self._last_thread,
            }

    def diagnostics(self, *, flight_recorder: bool = False) -> dict[str, Any]:
        """Everything a hang diagnosis needs from this rank, as plain (picklable) data.

        Safe to call from a second thread while the training thread is blocked in a collective.
        """
        out: dict[str, Any] = {"records": self.records(), "state": self.state(), "stacks": snapshot_stacks()}
        if flight_recorder:
            out["flight_recorder"] = flight_recorder_dump()
        return out


def _rebind_deepspeed(mapping: dict[Callable[..., Any], Callable[..., Any]]) -> None:
    comm = sys.modules.get("deepspeed.comm.comm")
    backend = getattr(comm, "cdb", None)
    for attr in ("all_gather_function", "reduce_scatter_function"):
        fn = getattr(backend, attr, None)
        if fn is not None and fn in mapping:
            setattr(backend, attr, mapping[fn])


_active: Optional[CollectiveRecorder] = None
_install_lock = threading.Lock()


def install(capacity: int = DEFAULT_CAPACITY) -> CollectiveRecorder:
    """Start recording this process's collectives; idempotent (returns the recorder installed).

    Calling it again (say, after DeepSpeed built its engine) rebinds DeepSpeed's backend.
    """
    global _active
    with _install_lock:
        if _active is None:
            _active = CollectiveRecorder(capacity)
            _active._install()
        else:
            _active.rebind_deepspeed()
        return _active


def uninstall() -> None:
    """Restore the original torch.distributed functions; a no-op when nothing is installed."""
    global _active
    with _install_lock:
        if _active is not None:
            _active._uninstall()
            _active = None


def active() -> Optional[CollectiveRecorder]:
    """The installed recorder, or None."""
    return _active
