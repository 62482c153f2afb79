"""A CUDA collective's wait is on the device: the recorder times its stream's stall.

NCCL calls return at once and the stream waits instead, so host time in the call says nothing
about waiting on peers (a rank waiting for a straggler would look like the straggler). The
recorder brackets each blocking call and each ``wait()`` with CUDA timing events and adds the
stream's stalls to the thread's blocked time. Here the events are stand-ins with set times.
"""

from __future__ import annotations

from typing import Any, Iterator

import pytest

from ringtrain.train import collective_calls, collectives


class FakeEvent:
    """A timing event whose recorded time (ms) comes from a script."""

    times: Iterator[float] = iter(())
    made: list["FakeEvent"] = []

    def __init__(self) -> None:
        self.ms = next(FakeEvent.times)
        self.synchronized = False
        FakeEvent.made.append(self)

    def elapsed_time(self, other: "FakeEvent") -> float:
        return other.ms - self.ms

    def synchronize(self) -> None:
        self.synchronized = True


def _recorder(monkeypatch: pytest.MonkeyPatch, *, cuda: bool, times: list[float]) -> Any:
    FakeEvent.times, FakeEvent.made = iter(times), []
    monkeypatch.setattr(collectives, "_timing_event", FakeEvent)
    monkeypatch.setattr(collectives, "describe", lambda tensors: ([[4]], "float32", [], cuda))
    monkeypatch.setattr(collectives.CollectiveRecorder, "_complete", lambda self, record, on_cuda: None)
    recorder = collectives.CollectiveRecorder()

    def all_reduce(tensor: Any, op: Any = None, group: Any = None, async_op: bool = False) -> None:
        return None

    return recorder, recorder._wrap("all_reduce", collective_calls.OPS["all_reduce"], all_reduce)


def test_a_cuda_collective_adds_its_stream_stall_to_the_blocked_time(monkeypatch: pytest.MonkeyPatch) -> None:
    recorder, all_reduce = _recorder(monkeypatch, cuda=True, times=[0.0, 40.0, 100.0, 400.0])
    all_reduce(object())  # the stream stalled 40 ms
    all_reduce(object())  # then 300 ms: a peer was late
    host_s = sum(recorder._blocked_s.values())  # the calls themselves returned at once
    assert recorder.blocked_s() == pytest.approx(host_s + 0.340)
    assert FakeEvent.made[-1].synchronized  # read only once the device got there
    assert recorder.blocked_s() == pytest.approx(host_s + 0.340)  # each stall counted once


def test_a_host_collective_is_timed_by_the_host_clock_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    recorder, all_reduce = _recorder(monkeypatch, cuda=False, times=[])
    all_reduce(object())
    assert FakeEvent.made == [] and recorder.blocked_s() < 0.1
