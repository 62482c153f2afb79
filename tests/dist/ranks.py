"""Spawn one process per gloo rank, wait for rank 0's result, and always reap every process."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import queue
from pathlib import Path
from typing import Any, Callable, Iterator

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


@contextlib.contextmanager
def gloo_rank(rank: int, world: int, store: str, results: Any) -> Iterator[None]:
    """The frame of one rank's body: one torch thread, the environment DeepSpeed reads, a gloo
    group over the FileStore ``store``; any exception goes to ``results`` (so the test fails at
    once instead of timing out) and the group is always torn down."""
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
        dist.destroy_process_group()
