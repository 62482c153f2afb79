"""Start one process per gloo rank, wait for rank 0's result, and always reap every process.

On the CPU the ranks are forked from the benches' fork server (``try_process``), which has
imported torch, DeepSpeed and the trainer once: a rank then starts in milliseconds instead of
paying seconds of CPU for those imports, and a suite starts hundreds of ranks. Each rank still
runs in the environment and folder of the test that started it. With CUDA the ranks are spawned
fresh: a process forked from one that has touched the CUDA driver (DeepSpeed's import asks for
the devices) cannot use it.
"""

from __future__ import annotations

import contextlib
import functools
import os
import queue
import time
from multiprocessing.context import BaseContext
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

from ringtrain_dev.try_process import context, try_process

TIMEOUT_S = 240.0


@functools.cache
def rank_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def rank_context() -> BaseContext:
    """The multiprocessing context ranks (and the queues and events they share) are made in:
    the benches' (``try_process``), so a rank forks from the same preloaded server."""
    return context(rank_device())


def rank_process(target: Callable[..., None], *args: Any, daemon: bool = False) -> BaseProcess:
    """A rank's process, not yet started, that calls ``target(*args)`` in the environment and
    folder its test had when it started the rank."""
    return try_process(rank_device(), target, *args, daemon=daemon)


def run_ranks(
    target: Callable[..., None], world: int, tmp_path: Path, *args: Any, timeout: float = TIMEOUT_S,
    device: Optional[str] = None,
) -> Any:
    """Call ``target(rank, world, store_path, *args, results)`` in ``world`` processes, started
    for ``device`` (cuda | cpu; default ``rank_device()``: a rank that computes on the CPU of a
    GPU machine still forks).

    ``target`` puts rank 0's result (or any rank's exception) on ``results``; the exception is
    raised here, so a failing rank fails the test instead of timing it out, and so does a rank
    that exits with an error code before any result (killed, or out of memory).
    """
    device = device or rank_device()
    results = context(device).Queue()
    store = tmp_path / f"store-{os.urandom(4).hex()}"  # a fresh FileStore rendezvous per group
    procs = [try_process(device, target, rank, world, str(store), *args, results, daemon=False) for rank in range(world)]
    for p in procs:
        p.start()
    try:
        out = _first_result(results, procs, timeout)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    if isinstance(out, BaseException):
        raise out
    return out


def _first_result(results: Any, procs: list[BaseProcess], timeout: float) -> Any:
    """What the ranks put on ``results`` first, or an error once a rank died without a word or
    ``timeout`` seconds passed."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return results.get(timeout=max(0.0, min(1.0, deadline - time.monotonic())))
        except queue.Empty:
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if dead:
                try:  # a rank that raised put its exception just before it exited
                    return results.get(timeout=1.0)
                except queue.Empty:
                    return RuntimeError(f"a rank exited with code {dead[0]} before any of the {len(procs)} ranks reported")
            if time.monotonic() >= deadline:
                return RuntimeError(f"no result from {len(procs)} ranks within {timeout:g} s")


@contextlib.contextmanager
def gloo_rank(rank: int, world: int, store: str, results: Any) -> Iterator[None]:
    """The frame of one rank's body: one torch thread, the environment DeepSpeed reads, a gloo
    group over the FileStore ``store``; any exception goes to ``results`` (so the test fails at
    once instead of timing out) and the group is always torn down (unless the body left it:
    ``Trainer.close`` does)."""
    import torch
    import torch.distributed as dist

    from ringtrain.train.trainer import set_rank_env

    torch.set_num_threads(1)
    set_rank_env(rank=rank, world_size=world, device=torch.device("cpu"))
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    try:
        yield
    except BaseException as exc:
        results.put(exc)
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
