"""A rank's own compute on CUDA, as the straggler policy reads it: a stall of the stream waiting on
a collective counts as blocked, a kernel of the rank's own as compute.

A NCCL call returns to the host at once, so the host clock sees a rank waiting on a late peer
only at its next synchronisation, and would count the wait as compute: every rank of a step
with a straggler would look as slow as the straggler. The recorder times those waits with CUDA
events instead (``CollectiveRecorder.blocked_s``). One GPU takes one NCCL rank (NCCL refuses two
ranks on one device), so the late peer is played by a side stream: the collective is issued on
it behind a known sleep, and the main stream's wait for it stalls that long, as it would for a
peer that entered the collective late.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any, Iterator

from ringtrain_dev.ranks import run_ranks

from .support import MARKS

pytestmark = MARKS

SLEEP_S = 0.2  # the stall played, and the compute


def _sleep_cycles(seconds: float) -> int:
    """GPU clock cycles that ``torch.cuda._sleep`` spins for about ``seconds`` on this device."""
    import torch

    probe = 10_000_000
    torch.cuda._sleep(probe)  # the first launch, and the clocks leaving idle, are not timed
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(probe)
    end.record()
    end.synchronize()
    return int(probe * seconds / (start.elapsed_time(end) / 1000.0))


def _timed(recorder: Any, body: Any) -> tuple[float, float]:
    """(wall seconds, seconds blocked in collectives) of ``body()`` up to a synchronisation."""
    import torch

    blocked, started = recorder.blocked_s(), time.perf_counter()
    body()
    torch.cuda.synchronize()
    return time.perf_counter() - started, recorder.blocked_s() - blocked


@contextlib.contextmanager
def _side_stream_after_sleep(cycles: int) -> Iterator[Any]:
    """Run the body on a side stream (made current) behind a ``cycles`` sleep there, after what
    the main stream has queued; yields the side stream."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(cycles)
        yield side


def _rank_main(rank: int, world: int, store_path: str, results: Any) -> None:
    import torch
    import torch.distributed as dist

    from ringtrain.train import collectives

    try:
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", store=dist.FileStore(store_path, world), rank=rank, world_size=world, device_id=device)
        recorder = collectives.install()
        x = torch.ones(1 << 16, device=device)
        dist.all_reduce(x)  # the communicator is built on the first call
        torch.cuda.synchronize()
        cycles = _sleep_cycles(SLEEP_S)
        out: dict[str, Any] = {}

        def own_compute() -> None:  # the rank's own kernel, then a collective with nothing to wait for
            torch.cuda._sleep(cycles)
            dist.all_reduce(x)

        def late_peer() -> None:  # the collective ends SLEEP_S late; the main stream waits for it
            with _side_stream_after_sleep(cycles):
                work = dist.all_reduce(x, async_op=True)
            entered = time.perf_counter()
            work.wait()
            out["late_host_wait"] = time.perf_counter() - entered

        def own_side_work() -> None:
            # A blocking collective whose input is written on a side stream behind the sleep:
            # the main stream waits for that before the collective is entered.
            with _side_stream_after_sleep(cycles) as side:
                x.add_(0)
            torch.cuda.current_stream().wait_stream(side)
            dist.all_reduce(x)

        out["own"] = _timed(recorder, own_compute)
        out["late"] = _timed(recorder, late_peer)
        out["blocking_late"] = _timed(recorder, own_side_work)
        results.put(out)
    except BaseException as exc:
        results.put(exc)
    finally:
        collectives.uninstall()
        if dist.is_initialized():
            dist.destroy_process_group()


def test_a_stream_stall_on_a_collective_counts_as_blocked_and_own_kernels_as_compute(tmp_path: Path) -> None:
    out = run_ranks(_rank_main, 1, tmp_path)

    wall, blocked = out["own"]
    assert wall >= 0.8 * SLEEP_S, out
    assert blocked < 0.1 * SLEEP_S, f"the rank's own kernel was counted as waiting on a collective: {out}"
    slept = wall  # the sleep as this device ran it: the stall played below is one of the same

    # The main stream waits for the side stream *before* the collective is entered: that is the
    # rank's own work reaching the collective, not a peer's lateness, so it is compute too.
    wall, blocked = out["blocking_late"]
    assert wall >= 0.8 * SLEEP_S, out
    assert blocked < 0.1 * SLEEP_S, f"a wait before the collective was counted as blocked in it: {out}"

    wall, blocked = out["late"]
    assert out["late_host_wait"] < 0.25 * SLEEP_S, f"wait() blocked the host: the stall is not the device's: {out}"
    assert 0.8 * slept <= blocked <= 1.2 * slept + 0.01, f"the stream's wait for the late collective: {out}"
    assert wall - blocked < 0.25 * slept, f"the wait was counted as compute: {out}"
