"""Probe: where the time of aborting a one-rank NCCL world goes, on one GPU.

Each variant runs in a fresh spawned process (NCCL reads its NCCL_* settings once per process,
torch its TORCH_NCCL_* ones when a group is made), so every environment below starts clean. A
variant joins a one-rank world as a worker does (FileStore, ``device_id`` bound), makes N more
groups with ``new_group`` as ``mesh.build_mesh`` does, runs one all_reduce on every group (so
each holds a live communicator), then times leaving it one way:

- ``apg``: ``_abort_process_group()``, what ``mesh.abort_all`` calls;
- ``each``: every group's ``abort()`` on its own, one after another, each timed;
- ``threads``: every group's ``abort()`` at once from threads (the binding drops the GIL);
- ``shutdown``: ``destroy_process_group()``, the graceful path, for comparison.

``each`` and ``threads`` then call ``_abort_process_group()`` for torch's bookkeeping (an
aborted communicator aborts again for free), timed apart as ``bookkeeping_s``. ``release_s``
is dropping the last references (the destructors join the watchdog threads).

Why the numbers look as they do (NCCL 2.28.9, src/proxy.cc): every communicator that is not
split with shared resources has its own proxy service thread, which reads the abort flag and
then sleeps in poll(..., 500 ms); ncclCommAbort joins it, so one abort costs 0.5-1.0 s, and
aborts run one after another add up. The abort here comes right after the groups are made,
about the worst phase of those polls; a failure at a random moment averages a little less.

Variants start together, so torch imports overlap, but measure one at a time. ``apg-ds``
(13 groups left the slow way, ~12 s) runs only when named.

    python bench/nccl_abort.py [--rounds 1] [--only apg-mesh threads-mesh ...] [--timeout 60]

Writes bench/results/nccl_abort-cuda.json (``--out`` another file). Exits 2 without CUDA.
"""

from __future__ import annotations

import argparse
import gc
import multiprocessing as mp
import os
import queue
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from ringtrain_dev.record import Run

MESH_GROUPS = 6  # mesh.Mesh's *_group fields: dp, cp, ring, ulysses, zero, self
DS_GROUPS = 12  # a DeepSpeed-sized count, to see how the cost scales with groups
# A worker's environment: worker.process_env("cuda") and forensics.arm_flight_recorder().
BASE_ENV = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2", "TORCH_FR_BUFFER_SIZE": "2048"}
# torch's own threads and dumps, off: a control (abort() neither joins nor dumps by default).
QUIET = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0", "TORCH_NCCL_ENABLE_MONITORING": "0",
         "TORCH_NCCL_DUMP_ON_TIMEOUT": "0", "TORCH_FR_BUFFER_SIZE": "0"}
# Split children share the parent's proxy threads, so one proxy is stopped rather than one each.
SHARE = {"NCCL_COMM_SPLIT_SHARE_RESOURCES": "1"}

# name: (groups made besides the default one, how the world is left, env on top of BASE_ENV)
VARIANTS: dict[str, tuple[int, str, dict[str, str]]] = {
    "apg-mesh": (MESH_GROUPS, "apg", {}),
    "apg-ds": (DS_GROUPS, "apg", {}),
    "each-mesh": (MESH_GROUPS, "each", {}),
    "shutdown-mesh": (MESH_GROUPS, "shutdown", {}),
    "apg-mesh-quiet": (MESH_GROUPS, "apg", QUIET),
    "threads-mesh": (MESH_GROUPS, "threads", {}),
    "threads-ds": (DS_GROUPS, "threads", {}),
    "apg-mesh-share": (MESH_GROUPS, "apg", SHARE),
    "apg-ds-share": (DS_GROUPS, "apg", SHARE),
    "threads-ds-share": (DS_GROUPS, "threads", SHARE),
}
SLOW = {"apg-ds"}  # about a second a group: run it by name (--only) to see the scaling


def _abort_each(pgs: list[Any], concurrently: bool) -> list[float]:
    """Abort every group, one after another or all at once; each abort's own seconds."""
    took = [0.0] * len(pgs)
    failed: list[BaseException] = []  # a thread's exception would only be printed: raise it here

    def one(i: int) -> None:
        started = time.perf_counter()
        try:
            pgs[i].abort()
        except BaseException as exc:  # noqa: BLE001
            failed.append(exc)
        took[i] = time.perf_counter() - started

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(pgs))]
    for t in threads:
        t.start()
        if not concurrently:
            t.join()
    for t in threads:
        t.join()
    if failed:
        raise failed[0]
    return took


def _round(groups: int, how: str, store: str) -> dict[str, Any]:
    """One world made, used and left; the seconds of each phase."""
    import torch
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    device = torch.device("cuda", 0)
    out: dict[str, Any] = {}
    mark = time.perf_counter()

    def lap(key: str) -> None:
        nonlocal mark
        now = time.perf_counter()
        out[key] = round(now - mark, 4)
        mark = now

    dist.init_process_group("nccl", store=dist.FileStore(store, 1), rank=0, world_size=1, device_id=device)
    lap("init_s")
    made = [dist.new_group([0]) for _ in range(groups)]
    lap("new_groups_s")
    x = torch.ones(8, device=device)
    for group in (None, *made):
        dist.all_reduce(x, group=group)
    torch.cuda.synchronize()
    lap("all_reduce_s")
    pgs = list(c10d._world.pg_map)  # the default group and every other one
    out["groups"] = len(pgs)
    started = mark
    if how == "apg":
        c10d._abort_process_group()
    elif how == "shutdown":
        dist.destroy_process_group()
    else:
        out["per_group_s"] = [round(s, 4) for s in _abort_each(pgs, concurrently=how == "threads")]
        lap("aborts_s")
        c10d._abort_process_group()
        lap("bookkeeping_s")
    out["total_s"] = round(time.perf_counter() - started, 4)
    mark = time.perf_counter()
    del made, pgs, group  # the last references: the destructors run now
    gc.collect()
    lap("release_s")
    assert not dist.is_initialized()
    return out


def _variant(name: str, groups: int, how: str, env: dict[str, str], rounds: int, tmp: str,
             go: Any, results: Any) -> None:
    """A spawned process: set the environment before torch or NCCL reads it, get CUDA ready,
    then wait for the parent's go so that only one variant touches NCCL at a time."""
    os.environ.update({**BASE_ENV, **env})
    try:
        import torch

        torch.cuda.set_device(0)
        torch.ones(1, device="cuda")  # the CUDA context, outside every timing
        go.wait()
        out: dict[str, Any] = {"env": {**BASE_ENV, **env}, "how": how, "extra_groups": groups, "rounds": []}
        for r in range(rounds):
            out["rounds"].append(_round(groups, how, os.path.join(tmp, f"{name}-{r}")))
        out["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        results.put(out)
    except BaseException as exc:  # noqa: BLE001 - the parent reports it
        results.put({"error": repr(exc)})


def _line(name: str, got: dict[str, Any]) -> str:
    if "error" in got:
        return f"{name:<17} FAILED {got['error']}"
    totals = [r["total_s"] for r in got["rounds"]]
    last = got["rounds"][-1]
    text = f"{name:<17} groups {last['groups']:>2}  total {statistics.mean(totals):6.3f} s"
    if "per_group_s" in last:
        per = last["per_group_s"]
        text += (f"  per group mean {statistics.mean(per):.3f} max {max(per):.3f} s"
                 f"  bookkeeping {last['bookkeeping_s']:.3f} s")
    return text + (f"  (init {last['init_s']:.2f} s, groups {last['new_groups_s']:.2f} s,"
                   f" release {last['release_s']:.3f} s)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=1, help="worlds made and left per variant")
    parser.add_argument("--only", nargs="+", choices=list(VARIANTS), default=[v for v in VARIANTS if v not in SLOW])
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds one variant may take once started")
    parser.add_argument("--out", type=Path, default=None, help="default: bench/results/nccl_abort-cuda.json")
    args = parser.parse_args(argv)
    run = Run("nccl_abort")
    try:
        import torch
    except ImportError:
        print("torch is not installed: this probe needs torch with CUDA and one NVIDIA GPU.")
        return 2
    if not torch.cuda.is_available():
        print("CUDA is not available: this probe needs one NVIDIA GPU.")
        return 2

    ctx = mp.get_context("spawn")  # a fresh interpreter: no CUDA or NCCL state, its own env
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="nccl-abort-") as tmp:
        started = {}
        for name in args.only:
            go, box = ctx.Event(), ctx.Queue()
            proc = ctx.Process(target=_variant, args=(name, *VARIANTS[name], args.rounds, tmp, go, box), daemon=True)
            proc.start()  # all import torch together; each measures only on its go
            started[name] = (proc, go, box)
        for name, (proc, go, box) in started.items():
            go.set()
            try:
                results[name] = box.get(timeout=args.timeout)
            except queue.Empty:
                results[name] = {"error": f"no result within {args.timeout:g} s (a hung abort?)"}
            proc.join(10)
            if proc.is_alive():  # hung in the abort, or in a destructor after reporting: not ours to wait on
                proc.kill()
            print(_line(name, results[name]), flush=True)

    nccl = next((r["nccl"] for r in results.values() if "nccl" in r), None)
    run.write({"config": {"rounds": args.rounds, "base_env": BASE_ENV, "nccl": nccl}, "variants": results},
              device_type="cuda", out=args.out)
    return 0 if all("error" not in r for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
