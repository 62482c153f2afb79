"""The side stream a snapshot's copies run on: its queue, its events, how training's stream is held
behind them, and what each took.

On a GPU the copies of a snapshot are queued on a CUDA stream of their own, ordered after the
work training queued so far, so they overlap the next step; training's stream is held (a
stream-to-stream wait, the host never blocks) only before the work that would change what a copy
still reads. Every event here records a time, so a snapshot step can be profiled from the events
alone: how long the copies ran on the device, and how long training's stream waited for them.
"""

from __future__ import annotations

from typing import Callable, Optional, Protocol

import torch


class CopyEvent(Protocol):
    """The end of some copies queued on the side stream."""

    def synchronize(self) -> None:
        """Block this thread until the copies are done."""
        ...

    def seconds(self) -> Optional[float]:
        """How long the copies ran, once done (None where that is not known)."""
        ...


class Hold(Protocol):
    """Training's stream held behind a copy."""

    def seconds(self) -> Optional[float]:
        """How long the stream waited (0: the copy was done before it got there), once both the
        copy and training's stream have passed the hold; None before, or where not known."""
        ...


class CopyStreams(Protocol):
    """Where a snapshot's copies are queued, and how training's stream is ordered against them."""

    def enqueue(self, copies: Callable[[], None]) -> CopyEvent:
        """Queue the copies ``copies`` issues on the side stream, after the work training queued so
        far; the event ends with them. The side stream runs what it is given in order."""
        ...

    def hold_compute(self, event: CopyEvent) -> Hold:
        """Make training's stream wait for ``event`` before its next kernel."""
        ...


class CudaCopy:
    """Copies queued on a CUDA stream, between two timing events."""

    def __init__(self, start: torch.cuda.Event, end: torch.cuda.Event) -> None:
        self.start, self.end = start, end

    def synchronize(self) -> None:
        self.end.synchronize()

    def seconds(self) -> Optional[float]:
        return self.start.elapsed_time(self.end) / 1e3 if self.end.query() else None


class CudaHold:
    """Training's stream held at ``at`` until ``until`` (the copy's end) completed."""

    def __init__(self, at: torch.cuda.Event, until: torch.cuda.Event) -> None:
        self.at, self.until = at, until

    def seconds(self) -> Optional[float]:
        if not (self.at.query() and self.until.query()):
            return None
        # Both timestamps are the device's: the stream reached the hold at ``at`` and went on
        # when the copy ended, or at once when it had ended before.
        return max(0.0, self.at.elapsed_time(self.until) / 1e3)


class CudaCopyStreams:
    """The copies on a side CUDA stream of ``device``."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)

    def enqueue(self, copies: Callable[[], None]) -> CopyEvent:
        # The end blocks the thread that waits for it instead of spinning on a core: the copy
        # thread waits for most of a step, and the training thread needs the cores.
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True, blocking=True)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            start.record()
            copies()
            end.record()
        return CudaCopy(start, end)

    def hold_compute(self, event: CopyEvent) -> Hold:
        assert isinstance(event, CudaCopy)
        training = torch.cuda.current_stream(self.device)
        at = torch.cuda.Event(enable_timing=True)
        at.record(training)
        training.wait_event(event.end)
        return CudaHold(at, event.end)


def device_has_room(device: torch.device, num_bytes: int, *, margin: float = 0.05) -> bool:
    """Whether ``num_bytes`` more on ``device`` still leave the step's peak and a ``margin`` of the
    device's memory free. Read right after a step: the peak is that step's (the Trainer resets it
    at each step's start), as the allocator reserved it (what the step took, its fragmentation
    included), and what is not torch's (the CUDA context, communication buffers, other
    processes) counts too."""
    if device.type != "cuda":
        return False
    free, total = torch.cuda.mem_get_info(device)
    not_torch = total - free - torch.cuda.memory_reserved(device)
    return torch.cuda.max_memory_reserved(device) + not_torch + num_bytes <= total * (1 - margin)
