"""The snapshot copy's ordering on the GPU path, driven on CPU through stand-in streams and a
stand-in executor that runs jobs only when the test says so."""

from __future__ import annotations

import contextlib
from concurrent.futures import Executor, Future
from contextlib import AbstractContextManager
from typing import Any, Callable, Iterator

import numpy as np
import torch

from ringtrain.checkpoint.wire import decode
from ringtrain.train.snapshot import CopyEvent, Snapshotter
from ringtrain.train.zero_state import Fragment


class FakeEvent:
    def __init__(self, name: str, log: list[str]) -> None:
        self.name = name
        self.log = log

    def synchronize(self) -> None:
        self.log.append(f"sync {self.name}")


class FakeStreams:
    """Records what the GPU path asks of its streams, in order."""

    def __init__(self) -> None:
        self.log: list[str] = []
        self.recorded = 0

    @contextlib.contextmanager
    def _copying(self) -> Iterator[None]:
        self.log.append("copy")
        yield

    def copying(self) -> AbstractContextManager[Any]:
        return self._copying()

    def record(self) -> CopyEvent:
        self.recorded += 1
        self.log.append(f"record e{self.recorded}")
        return FakeEvent(f"e{self.recorded}", self.log)

    def hold_compute(self, event: CopyEvent) -> None:
        assert isinstance(event, FakeEvent)
        self.log.append(f"hold {event.name}")


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
    assert streams.log[:4] == ["copy", "record e1", "hold e1", "copy"]
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
