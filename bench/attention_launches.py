"""Benchmark: where the worst rank's time goes at short blocks, on one GPU, and what taking the
host out of it would give.

For each size (tokens a rank) and K/V exchange, the worst rank of the zigzag ring (its transport
looped back on one GPU, as bench/attention.py runs it) does a forward and backward three ways:

- wall: as the product runs it, each op launched from Python;
- busy: the time its kernels keep the GPU busy (torch.profiler's CUDA kernel time), and how
  many kernels it launches;
- graphed: the same forward and backward replayed from CUDA graphs
  (``torch.cuda.make_graphed_callables``): no Python and no launch per op, the kernels alone.

Each time is held against one monolithic causal kernel's forward+backward over the whole
sequence divided by the ranks (the rank's fair share, zigzag balances the work exactly), the
ratio bench/attention.py prints. The graphed ratio is what taking the host away could give at
most (the same kernels, no time between them): it is held to bench/attention.py's targets (0.7
at 2K tokens a rank, 0.85 at 4K, 0.95 at 8K), so a MISS says that launches are not what stands
between the ring and its target at that size, the kernels on short blocks are (fewer, larger
kernels could still get there). wall / busy says how host-bound the rank still is.

At each size the exchange ``attention.kv_exchange=auto`` picks there (``choose_exchange``) is held
to the faster one's wall time: a pick more than 5% slower is a MISS (``ringtrain_dev.ring_targets``),
and each size prints auto's pick and the best.

    PYTHONPATH=platform python bench/attention_launches.py [--sizes 16384x8 16384x4 32768x4] [--check]
    PYTHONPATH=platform python bench/attention_launches.py --device cpu --tiny   # the code path, no claims

Writes bench/results/attention_launches-<device>.json (commit, device, every row).

Shape legend: B batch, S sequence (full), H query heads, K KV heads, D head dim.
"""

from __future__ import annotations

import argparse
import re
import sys
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Optional

import torch

from ringtrain.train.attention import local_attention, ring_attention
from ringtrain.train.attention.kernels import get_kernel
from ringtrain.train.attention.zigzag import zigzag_shard
from ringtrain_dev.bench_cli import slug
from ringtrain_dev.loopback import LoopbackTransport
from ringtrain_dev.record import RESULTS_DIR, Run
from ringtrain_dev.ring_targets import EXCHANGES, auto_checks, ratio_target
from ringtrain_dev.timing import timed_ms

DEFAULT_SIZES = ("16384x8", "16384x4", "32768x4")  # 2K, 4K and 8K tokens a rank


def busy_ms(step: Callable[[], None], device: torch.device, *, iters: int = 3) -> tuple[float, int]:
    """(GPU kernel milliseconds, kernels launched) per ``step``, from torch.profiler (CUDA only)."""
    step()
    torch.cuda.synchronize(device)
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(iters):
            step()
        torch.cuda.synchronize(device)
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return sum(e.self_device_time_total for e in kernels) / 1e3 / iters, len(kernels) // iters


def measure(args: argparse.Namespace, device: torch.device) -> list[dict[str, Any]]:
    kernel = get_kernel(args.kernel, device_type=device.type, dtype=args.dtype, head_dim=args.head_dim)
    rows = []
    for seq, world in args.sizes:
        gen = torch.Generator(device=device).manual_seed(seq)
        shapes = [(1, seq, args.heads, args.head_dim), (1, seq, args.kv_heads, args.head_dim),
                  (1, seq, args.kv_heads, args.head_dim), (1, seq, args.heads, args.head_dim)]
        q, k, v, dout = (torch.randn(s, generator=gen, device=device, dtype=args.dtype) for s in shapes)
        whole = [t.detach().requires_grad_() for t in (q, k, v)]

        def monolithic() -> None:
            local_attention(*whole, causal=True, kernel=kernel).backward(dout)

        mono_ms = timed_ms(monolithic, device, warmup=args.warmup, iters=args.iters)
        rank = world - 1  # the worst: under the causal mask its rows take part in every merge
        shard = [zigzag_shard(t, dim=1, world=world, rank=rank).contiguous() for t in (q, k, v, dout)]
        for exchange in EXCHANGES:
            def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, exchange: str = exchange,
                       world: int = world, rank: int = rank) -> torch.Tensor:
                return ring_attention(q, k, v, group=LoopbackTransport(rank, world), causal=True, kernel=kernel,
                                      kv_exchange=exchange)

            leaves = [t.detach().requires_grad_() for t in shard[:3]]

            def step(attend: Callable[..., torch.Tensor] = attend, leaves: list[torch.Tensor] = leaves) -> None:
                attend(*leaves).backward(shard[3])

            fair_ms = mono_ms / world
            row: dict[str, Any] = {"seq": seq, "ring": world, "tokens_per_rank": seq // world, "exchange": exchange,
                                   "kernel": kernel.name, "monolithic_fwd_bwd_ms": mono_ms,
                                   "rank_fwd_bwd_ms": timed_ms(step, device, warmup=args.warmup, iters=args.iters),
                                   "target": ratio_target(seq // world)}
            row["ratio"] = fair_ms / row["rank_fwd_bwd_ms"]
            if device.type == "cuda":
                row["gpu_busy_ms"], row["kernels"] = busy_ms(step, device)
                row["wall_over_busy"] = row["rank_fwd_bwd_ms"] / row["gpu_busy_ms"]
                try:
                    graphed_leaves = [t.detach().clone().requires_grad_() for t in shard[:3]]
                    graphed = torch.cuda.make_graphed_callables(attend, tuple(graphed_leaves), num_warmup_iters=3)
                    row["graphed_fwd_bwd_ms"] = timed_ms(
                        lambda: graphed(*graphed_leaves).backward(shard[3]), device, warmup=args.warmup,
                        iters=args.iters)
                    row["graphed_ratio"] = fair_ms / row["graphed_fwd_bwd_ms"]
                except Exception as exc:  # a capture that fails is a finding: record why
                    row["graph_error"] = "".join(traceback.format_exception_only(exc))[-600:]
            rows.append(row)
            print(describe(row), flush=True)
        del q, k, v, dout, shard, whole
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def describe(row: dict[str, Any]) -> str:
    line = (f"seq {row['seq']:>6} ring {row['ring']} ({row['tokens_per_rank']:>5} a rank) {row['exchange']:<9}: "
            f"{row['rank_fwd_bwd_ms']:7.2f} ms fwd+bwd, ratio {row['ratio']:.2f}")
    if "gpu_busy_ms" in row:
        line += (f"; GPU busy {row['gpu_busy_ms']:.2f} ms ({row['kernels']} kernels, "
                 f"wall/busy {row['wall_over_busy']:.2f})")
    if "graphed_ratio" in row:
        line += f"; graphed {row['graphed_fwd_bwd_ms']:.2f} ms, ratio {row['graphed_ratio']:.2f}"
    if "graph_error" in row:
        line += f"; graph capture failed: {row['graph_error'].strip().splitlines()[-1]}"
    return line


def verdicts(rows: list[dict[str, Any]]) -> list[tuple[str, bool]]:
    """Per size, whether the better exchange's graphed ratio reaches the size's target."""
    found = []
    for size in sorted({(r["seq"], r["ring"]) for r in rows}):
        graphed = [r for r in rows if (r["seq"], r["ring"]) == size and "graphed_ratio" in r]
        if not graphed or graphed[0]["target"] is None:
            continue
        best = max(graphed, key=lambda r: r["graphed_ratio"])
        found.append((f"{best['tokens_per_rank']} tokens a rank (ring {best['ring']}, {best['exchange']}): graphed "
                      f"{best['graphed_ratio']:.2f} (as run {best['ratio']:.2f}) >= {best['target']}",
                      best["graphed_ratio"] >= best["target"]))
    return found


def _size(text: str) -> tuple[int, int]:
    match = re.fullmatch(r"(\d+)x(\d+)", text)
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r}: expected SEQxRANKS, e.g. 16384x8")
    seq, world = int(match[1]), int(match[2])
    if world < 2 or seq % (2 * world):
        raise argparse.ArgumentTypeError(f"{text!r}: the sequence must split into 2 x {world} equal chunks")
    return seq, world


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--tiny", action="store_true", help="small shapes: the code path on a CPU, no claims")
    p.add_argument("--kernel", default="auto")
    p.add_argument("--sizes", type=_size, nargs="+", default=None,
                   help="whole sequence x ranks (default: " + " ".join(DEFAULT_SIZES) + ")")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--check", action="store_true", help="exit 1 when a target is missed")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    if args.tiny:
        args.sizes = args.sizes or [(256, 4)]
        args.heads, args.kv_heads, args.head_dim, args.warmup, args.iters = 4, 2, 16, 1, 2
    args.sizes = args.sizes or [_size(s) for s in DEFAULT_SIZES]
    args.dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    run = Run("attention_launches")
    if args.device == "cuda" and not torch.cuda.is_available():
        print("CUDA is not available: nothing to measure (run on a GPU, or --device cpu --tiny for the code path).")
        return 0
    device = torch.device(args.device)
    rows = measure(args, device)
    found = verdicts(rows)
    for what, met in found:
        print(f"{'PASS' if met else 'MISS'}: {what}")
    # auto's pick against the faster exchange as the product runs it (not graphed).
    checks = auto_checks(rows, lambda row: row["rank_fwd_bwd_ms"])
    smoke = device.type == "cpu"
    for check in checks:
        print(check.line(smoke))
    if not smoke:
        found += [(check.what(), check.met) for check in checks]
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    name_slug = slug(name) + ("-tiny" if args.tiny else "")
    config = {k: (str(v) if isinstance(v, torch.dtype) else v) for k, v in vars(args).items() if k != "out"}
    result = {"config": config, "rows": rows, "auto": [check.record() for check in checks],
              "targets": [{"what": what, "met": met} for what, met in found]}
    run.write(result, device_type=device.type, out=args.out or RESULTS_DIR / f"attention_launches-{name_slug}.json")
    return 1 if args.check and not all(met for _, met in found) else 0


if __name__ == "__main__":
    sys.exit(main())
