"""Benchmark: the host work of one context-parallel attention layer, per rank, on the CPU.

At short blocks a GPU rank waits on its host: every aten op a rank dispatches is at least one
launch. This counts the aten ops each rank dispatches for one layer's forward + backward and
times the rank's host side, at tiny shapes (so compute is nil) with the one-op ``cpu_flash``
kernel, after a warm-up call, every rank a thread of one process (``tests/emulated_cp.py``: the
real attention code, the transport in memory). Layouts: ring cp4 with K/V passed around the
ring and with K/V all gathered, ring cp4 on packed documents, Ulysses cp4, hybrid 2 x 2, ring
cp8, and a windowed ring cp4 layer.

The figures of 110e587 (the issue's table: the fewest and the most ops of any rank) are printed
beside the ones measured now and kept in the JSON. Targets: ring cp4 (both exchanges) at most
0.33x those ops; packed documents at most 1.3x the same layout without them; host time at most
0.5x of 110e587's at each layout (``--baseline FILE``: an earlier run's JSON of this bench,
e.g. one at 110e587, whose times the ratio is taken against).

Usage: python bench/host_ops.py [--repeats 5] [--baseline PATH] [--out PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "platform"), str(ROOT)]

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from bench.record import Run  # noqa: E402

# ops a rank of each layout dispatched at 110e587 (fewest, most), counted as this bench counts.
BASELINE_110E587: dict[str, tuple[int, int]] = {
    "ring cp4": (348, 351),
    "ring cp4 allgather": (247, 327),
    "ring cp4 packed": (495, 862),
    "ulysses cp4": (140, 140),
    "hybrid 2x2": (232, 233),
    "ring cp8": (716, 723),
}
RING_OPS_TARGET = 0.33
PACKED_TARGET = 1.3
HOST_TIME_TARGET = 0.5
B, HEADS, KV_HEADS, HEAD_DIM = 1, 4, 2, 16
TOKENS_PER_RANK = 32


@dataclass(frozen=True)
class Layout:
    name: str
    impl: str
    ring: int
    ulysses: int
    kv_exchange: str = "ring"
    documents: bool = False
    window: Optional[int] = None


LAYOUTS = (
    Layout("ring cp4", "ring", 4, 1),
    Layout("ring cp4 allgather", "ring", 4, 1, kv_exchange="allgather"),
    Layout("ring cp4 packed", "ring", 4, 1, documents=True),
    Layout("ulysses cp4", "ulysses", 1, 4),
    Layout("hybrid 2x2", "hybrid", 2, 2),
    Layout("ring cp8", "ring", 8, 1),
    Layout("ring cp4 window", "ring", 4, 1, window=48),
)


class _CountOps(TorchDispatchMode):
    """Every aten op the thread dispatches, but the emulated transport's (a job's network work is
    the process group's, not the attention code's)."""

    def __init__(self, counter: Counter[str]) -> None:
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        from tests.emulated_cp import in_transport

        if not in_transport():
            self.counter[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


class _PerRank:
    """Each rank thread's op counts or host time, keyed by the thread's name (counting slows every
    op, so a run either counts or times)."""

    def __init__(self, count: bool) -> None:
        self.count = count
        self.ops: dict[str, Counter[str]] = {}
        self.seconds: dict[str, float] = {}
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def context(self) -> Iterator[None]:
        from tests.emulated_cp import transport_seconds

        counter: Counter[str] = Counter()
        # The thread's own CPU time, less the emulated transport's: what waiting for other ranks
        # and standing in for the network cost is not this rank's host work.
        started = time.thread_time() - transport_seconds()
        with _CountOps(counter) if self.count else contextlib.nullcontext():
            yield
        elapsed = time.thread_time() - transport_seconds() - started
        with self._lock:
            name = threading.current_thread().name
            self.ops[name] = counter
            self.seconds[name] = elapsed


def _inputs(layout: Layout) -> tuple[torch.Tensor, ...]:
    world = layout.ring * layout.ulysses
    seq = TOKENS_PER_RANK * world
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, seq, HEADS, HEAD_DIM, generator=g)
    k = torch.randn(B, seq, KV_HEADS, HEAD_DIM, generator=g)
    v = torch.randn(B, seq, KV_HEADS, HEAD_DIM, generator=g)
    dout = torch.randn(B, seq, HEADS, HEAD_DIM, generator=g)
    return q, k, v, dout


def _doc_ids(seq: int) -> torch.Tensor:
    # Five documents of uneven lengths, so blocks are cut at boundaries inside and across shards.
    bounds = torch.tensor([0, seq // 7, seq // 3, seq // 2, (4 * seq) // 5])
    return (torch.arange(seq)[None, :, None] >= bounds[None, None, :]).sum(-1) - 1


def _documents(layout: Layout) -> Optional[list[Any]]:
    """Each rank's documents, made once for every call of a layout: as a forward's layers share
    theirs, so that a call is a layer's work (the gather and the plan are the forward's)."""
    if not layout.documents:
        return None
    from ringtrain.train.attention.documents import Documents
    from ringtrain.train.attention.zigzag import cp_shard

    docs = _doc_ids(TOKENS_PER_RANK * layout.ring * layout.ulysses)
    return [Documents.of(cp_shard(docs, dim=1, ring=layout.ring, ulysses=layout.ulysses, cp_rank=r))
            for r in range(layout.ring * layout.ulysses)]


def _call(layout: Layout, rank_context: Callable[[], Any], documents: Optional[list[Any]]) -> None:
    from tests.emulated_cp import emulated_attention, emulated_ring

    from ringtrain.train.attention.kernels import get_kernel

    q, k, v, dout = _inputs(layout)
    if layout.window is not None:
        emulated_ring(q, k, v, dout, world=layout.ring, kernel=get_kernel("cpu_flash", device_type="cpu", dtype=torch.float32), causal=True,
                      scale=HEAD_DIM**-0.5, window=layout.window, rank_context=rank_context)  # fmt: skip
        return
    docs = _doc_ids(q.shape[1]) if layout.documents else None
    emulated_attention(layout.impl, q, k, v, dout, ring=layout.ring, ulysses=layout.ulysses, kernel="cpu_flash",
                       doc_ids_BS=docs, kv_exchange=layout.kv_exchange, rank_context=rank_context,
                       documents=documents)  # fmt: skip


def measure(layout: Layout, repeats: int) -> dict[str, Any]:
    documents = _documents(layout)
    _call(layout, contextlib.nullcontext, documents)  # warm-up: caches, lazy imports, the first layer's work
    counted = _PerRank(count=True)
    _call(layout, counted.context, documents)
    ops = sorted(sum(c.values()) for c in counted.ops.values())
    times: list[float] = []
    for _ in range(repeats):
        timed = _PerRank(count=False)
        _call(layout, timed.context, documents)
        times.append(max(timed.seconds.values()))
    # The busiest rank's op mix: where the launches go.
    busiest = max(counted.ops.values(), key=lambda c: sum(c.values()))
    return {
        "ops_min": ops[0],
        "ops_max": ops[-1],
        "host_s_median": statistics.median(times),
        "top_ops": dict(busiest.most_common(12)),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--baseline", type=Path, default=None, help="an earlier run's JSON of this bench")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)

    run = Run("host_ops")
    before = json.loads(args.baseline.read_text())["layouts"] if args.baseline else {}
    results: dict[str, Any] = {}
    checks: list[tuple[str, bool]] = []
    print(f"{'layout':<22} {'ops now':>11} {'ops 110e587':>12} {'ratio':>6} {'host ms':>8} {'before':>8}")
    for layout in LAYOUTS:
        r = measure(layout, args.repeats)
        base = BASELINE_110E587.get(layout.name)
        r["ops_110e587"] = list(base) if base else None
        r["ops_ratio"] = r["ops_max"] / base[1] if base else None
        prior = before.get(layout.name, {}).get("host_s_median")
        r["host_ratio"] = r["host_s_median"] / prior if prior else None
        results[layout.name] = r
        base_text = f"{base[0]}-{base[1]}" if base else "-"
        ratio_text = f"{r['ops_ratio']:.2f}" if base else "-"
        prior_text = f"{prior * 1e3:.2f}" if prior else "-"
        ops_text = f"{r['ops_min']}-{r['ops_max']}"
        print(f"{layout.name:<22} {ops_text:>11} {base_text:>12} {ratio_text:>6} {r['host_s_median'] * 1e3:>8.2f} {prior_text:>8}")
        if r["host_ratio"] is not None:
            checks.append((f"{layout.name}: host time <= {HOST_TIME_TARGET}x", r["host_ratio"] <= HOST_TIME_TARGET))
    for name in ("ring cp4", "ring cp4 allgather"):
        checks.append((f"{name}: ops <= {RING_OPS_TARGET}x 110e587", results[name]["ops_ratio"] <= RING_OPS_TARGET))
    packed = results["ring cp4 packed"]["ops_max"] / results["ring cp4"]["ops_max"]
    checks.append((f"packed documents <= {PACKED_TARGET}x unpacked ({packed:.2f})", packed <= PACKED_TARGET))
    for what, ok in checks:
        print(f"{'PASS' if ok else 'FAIL'}  {what}")
    ok = all(passed for _, passed in checks)
    out = run.write({"layouts": results, "checks": [{"check": c, "pass": p} for c, p in checks], "pass": ok,
                     "shapes": {"batch": B, "heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM,
                                "tokens_per_rank": TOKENS_PER_RANK}}, device_type="cpu", out=args.out)  # fmt: skip
    print(f"wrote {out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
