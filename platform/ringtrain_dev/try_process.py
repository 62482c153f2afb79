"""The process a bench runs each of its tries in (a length, a variant): one of its own, and its
end, whatever it was (``run_to_end``).

On CUDA it is a spawned Python: a fresh CUDA context and allocator per try. A CPU has neither to
keep apart, and a spawned Python there spends seconds of CPU importing torch, DeepSpeed and
transformers before every try (on two cores, much of a smoke run). So on a CPU each try is forked
from a server that imported them once, as the gloo ranks are (``ranks``), and runs in the
environment and folder its parent had when it started the try (a forked one would otherwise have
the server's, from the server's own start).
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import queue
import signal
import time
from dataclasses import dataclass
from multiprocessing import forkserver
from multiprocessing.context import BaseContext
from multiprocessing.process import BaseProcess
from typing import Any, Callable, Optional

# What the server imports before it forks a try: what every try's body imports (and every gloo
# rank's: ``ranks`` forks its ranks from this same server).
PRELOAD = [
    "torch",
    "torch._dynamo",  # torch's optimizers import it at their first step
    "deepspeed",
    "deepspeed.runtime.zero.muon.muon_optimizer",  # ZeRO's optimizers import it (torch.compile at import)
    "transformers",
    "ringtrain.train.trainer",
]


def interrupt_on_sigint() -> None:
    """Make SIGINT raise KeyboardInterrupt in this process, as a time box that stops a bench with
    it expects, however the bench was started: a shell starts a background job (``cmd &``) with
    SIGINT ignored, and Python then leaves it ignored, in the bench and in every try it starts."""
    signal.signal(signal.SIGINT, signal.default_int_handler)


def context(device: str) -> BaseContext:
    """The multiprocessing context a try on ``device`` (cuda | cpu), and its queue, are made in."""
    if device == "cuda":
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    # DeepSpeed picks its accelerator once, as it is imported: the server imports it for CPU
    # tries, whatever this process's DS_ACCELERATOR says.
    before = os.environ.get("DS_ACCELERATOR")
    os.environ["DS_ACCELERATOR"] = "cpu"
    try:
        forkserver.ensure_running()
    finally:
        if before is None:
            del os.environ["DS_ACCELERATOR"]
        else:
            os.environ["DS_ACCELERATOR"] = before
    return ctx


def try_process(device: str, target: Callable[..., None], *args: Any, daemon: bool = True) -> BaseProcess:
    """A process (a daemon unless told otherwise), not yet started, that calls ``target(*args)``."""
    started = (dict(os.environ), os.getcwd(), target)
    return context(device).Process(target=_as_started, args=(*started, *args), daemon=daemon)  # type: ignore[attr-defined]


def _as_started(env: dict[str, str], cwd: str, target: Callable[..., None], *args: Any) -> None:
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    target(*args)


# A process that reported gets this long to tear its process group down before it is killed.
REPORTED_GRACE_S = 30.0


@dataclass(frozen=True)
class Ended:
    """How a try's process ended, as its parent saw it."""

    result: Any = None  # what it reported; None when it reported nothing
    exitcode: Optional[int] = None  # of a process that exited without reporting
    timed_out: bool = False
    pid: Optional[int] = None
    wall_s: float = 0.0  # from its start to its end, process start included


def run_to_end(device: str, target: Callable[..., None], *args: Any, timeout_s: float, poll_s: float = 1.0) -> Ended:
    """``target(*args, results)`` in a process of its own (``try_process``), until it reports on
    ``results``, exits or outlives ``timeout_s``. The process is gone when this returns: one that
    reported gets ``REPORTED_GRACE_S`` to tear its process group down, one past its time, or
    interrupted (the KeyboardInterrupt goes on to the caller), is killed at once."""
    results = context(device).Queue()
    proc = try_process(device, target, *args, results)
    t0 = time.perf_counter()
    grace_s = 0.0
    try:
        proc.start()
        ended = _await(proc, results, timeout_s, poll_s)
        grace_s = 0.0 if ended.timed_out else REPORTED_GRACE_S
    finally:
        if proc.pid is not None:
            proc.join(timeout=grace_s)
            if proc.is_alive():
                proc.kill()
                proc.join()
        results.close()
        results.join_thread()
    return dataclasses.replace(ended, pid=proc.pid, wall_s=time.perf_counter() - t0)


def _await(proc: BaseProcess, results: Any, timeout_s: float, poll_s: float) -> Ended:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return Ended(result=results.get(timeout=poll_s))
        except queue.Empty:
            if not proc.is_alive():
                try:  # it may have reported just before it exited
                    return Ended(result=results.get(timeout=1.0))
                except queue.Empty:
                    return Ended(exitcode=proc.exitcode)
            if time.monotonic() > deadline:
                return Ended(timed_out=True)
