"""The process a bench runs each of its tries in (a length, a variant): one of its own.

On CUDA it is a spawned Python: a fresh CUDA context and allocator per try. A CPU has neither to
keep apart, and a spawned Python there spends seconds of CPU importing torch, DeepSpeed and
transformers before every try (on two cores, much of a smoke run). So on a CPU each try is forked
from a server that imported them once, as the gloo test ranks are (tests/dist/ranks.py), and runs
in the environment and folder its parent had when it started the try (a forked one would
otherwise have the server's, from the server's own start).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
from multiprocessing import forkserver
from multiprocessing.context import BaseContext
from multiprocessing.process import BaseProcess
from typing import Any, Callable

# What the server imports before it forks a try: what every try's body imports (and every gloo
# test rank's: tests/dist/ranks.py forks its ranks from this same server).
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
