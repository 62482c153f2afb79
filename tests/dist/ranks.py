"""Spawn one process per gloo rank, wait for rank 0's result, and always reap every process."""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
from pathlib import Path
from typing import Any, Callable

TIMEOUT_S = 240.0


def run_ranks(target: Callable[..., None], world: int, tmp_path: Path, *args: Any, timeout: float = TIMEOUT_S) -> Any:
    """Call ``target(rank, world, store_path, *args, results)`` in ``world`` spawned processes.

    ``target`` puts rank 0's result (or any rank's exception) on ``results``; the exception is
    raised here, so a failing rank fails the test instead of timing it out.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    store = tmp_path / f"store-{os.urandom(4).hex()}"  # a fresh FileStore rendezvous per group
    procs = [ctx.Process(target=target, args=(rank, world, str(store), *args, results)) for rank in range(world)]
    for p in procs:
        p.start()
    try:
        out = results.get(timeout=timeout)
    except queue.Empty:
        out = RuntimeError(f"no result from {world} ranks within {timeout:g} s")
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    if isinstance(out, BaseException):
        raise out
    return out
