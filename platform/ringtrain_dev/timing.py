"""Wall time of work on a device: synchronized around each call, the median of several."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch


def synchronize(device: torch.device) -> None:
    """Wait for the device's work queued so far (a CPU's is done when queued)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_ms(fn: Callable[[], Any], device: torch.device, *, warmup: int, iters: int) -> float:
    """Median wall time of ``fn`` in milliseconds, device-synchronized around each call."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(iters):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def fwd_bwd_ms(attend: Callable[..., torch.Tensor], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               dout: torch.Tensor, device: torch.device, *, warmup: int, iters: int) -> tuple[float, float]:
    """(forward ms, backward ms) of ``attend(q, k, v)`` through autograd."""
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    fwd = timed_ms(lambda: attend(*leaves), device, warmup=warmup, iters=iters)
    out = attend(*leaves)  # one graph, its backward run again and again
    bwd = timed_ms(lambda: out.backward(dout, retain_graph=True), device, warmup=warmup, iters=iters)
    return fwd, bwd
