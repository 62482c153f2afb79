"""Benchmark: where the worst rank's time goes at short blocks, on one GPU, and what taking the
host out of it would give.

For each size (tokens a rank) and K/V exchange, the worst rank of the zigzag ring (its transport
looped back on one GPU, as bench/attention.py runs it) does a forward and backward three ways:

- wall: as the product runs it, each op launched from Python;
- busy: the time its device work keeps the GPU busy (torch.profiler's CUDA time of its kernels,
  copies and fills), how many kernels it launches, and how many copies and fills (memcpy,
  memset) besides;
- graphed: the same forward and backward replayed from CUDA graphs
  (``torch.cuda.make_graphed_callables``): no Python and no launch per op, the kernels alone.
  A capture that fails is a FAIL at its size, its error kept in the row, and the bench captures
  no more graphs (``Graphs``): a failed capture leaves its memory pool and the stream's capture
  state to whatever runs next, so a later capture's outcome and timing would say little, and the
  same code path fails the same way at every size. The later rows keep their wall and busy
  times and say why they have no graphed one (``graph_skipped``); their sizes FAIL too.

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

Writes bench/results/attention_launches-<device>.json (commit, device, every row). A SIGINT (a
time box's) or an error ends the measuring at the size in flight: the JSON then holds the rows
measured before it and says what ended it (``interrupted``, ``error``); sizes left with one
exchange measured get no verdict. Exits 1 then, or on a FAIL; ``--check`` exits 1 on a MISS too.
Needs CUDA unless ``--device cpu``: without it, it exits 2 with a message.

Shape legend: B batch, S sequence (full), H query heads, K KV heads, D head dim.
"""

from __future__ import annotations

import argparse
import re
import sys
import traceback
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from ringtrain.train.attention import local_attention, ring_attention
from ringtrain.train.attention.kernels import get_kernel
from ringtrain.train.attention.zigzag import zigzag_shard
from ringtrain_dev.bench_cli import slug, without_cuda
from ringtrain_dev.loopback import LoopbackTransport
from ringtrain_dev.record import RESULTS_DIR, Run
from ringtrain_dev.ring_targets import EXCHANGES, auto_checks, ratio_target
from ringtrain_dev.timing import timed_ms
from ringtrain_dev.try_process import interrupt_on_sigint

DEFAULT_SIZES = ("16384x8", "16384x4", "32768x4")  # 2K, 4K and 8K tokens a rank
PASS, MISS, FAIL = "PASS", "MISS", "FAIL"
# The profiler's names of device work that is not a kernel (kineto's, from CUPTI's records).
COPY_PREFIXES = ("Memcpy ", "Memset ")


@dataclass(frozen=True)
class DeviceWork:
    """One step's device work, as torch.profiler saw it."""

    busy_ms: float  # kernels, copies and fills together
    kernels: int
    copies: int  # memcpy and memset


def device_work(events: Iterable[Any], iters: int) -> DeviceWork:
    """Per step, of the profiler's ``events`` over ``iters`` steps: the CUDA time and how many of
    the device's events were kernels, how many copies and fills."""
    on_device = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    copies = sum(1 for e in on_device if e.name.startswith(COPY_PREFIXES))
    return DeviceWork(busy_ms=sum(e.self_device_time_total for e in on_device) / 1e3 / iters,
                      kernels=(len(on_device) - copies) // iters, copies=copies // iters)


def profiled(step: Callable[[], None], device: torch.device, *, iters: int = 3) -> DeviceWork:
    """``step``'s device work per call, from torch.profiler (CUDA only)."""
    step()
    torch.cuda.synchronize(device)
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(iters):
            step()
        torch.cuda.synchronize(device)
    return device_work(prof.events(), iters)


def where(row: dict[str, Any]) -> str:
    return f"{row['tokens_per_rank']} tokens a rank (ring {row['ring']}, {row['exchange']})"


@dataclass
class Graphs:
    """The rank's step replayed from CUDA graphs, row after row, until a capture fails; after
    that none is captured (the module's docstring says why)."""

    warmup: int
    iters: int
    failed_at: str = ""  # the row whose capture failed, once one has

    def measure(self, row: dict[str, Any], attend: Callable[..., torch.Tensor], shard: Sequence[torch.Tensor],
                device: torch.device) -> None:
        """Add the graphed time and ratio to ``row``, or why it has none."""
        if self.failed_at:
            row["graph_skipped"] = f"no graph captured after the capture at {self.failed_at} failed"
            return
        try:
            leaves = [t.detach().clone().requires_grad_() for t in shard[:3]]
            graphed = torch.cuda.make_graphed_callables(attend, tuple(leaves), num_warmup_iters=3)
            row["graphed_fwd_bwd_ms"] = timed_ms(lambda: graphed(*leaves).backward(shard[3]), device,
                                                 warmup=self.warmup, iters=self.iters)
            row["graphed_ratio"] = row["monolithic_fwd_bwd_ms"] / row["ring"] / row["graphed_fwd_bwd_ms"]
        except Exception as exc:  # a capture that fails is a finding: record why
            row["graph_error"] = "".join(traceback.format_exception_only(exc))[-600:]
            self.failed_at = where(row)


def measure(args: argparse.Namespace, device: torch.device) -> Iterator[dict[str, Any]]:
    """Each row as it is measured: size by size, each exchange."""
    kernel = get_kernel(args.kernel, device_type=device.type, dtype=args.dtype, head_dim=args.head_dim)
    graphs = Graphs(args.warmup, args.iters)
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
                work = profiled(step, device)
                row.update(gpu_busy_ms=work.busy_ms, kernels=work.kernels, copies=work.copies,
                           wall_over_busy=row["rank_fwd_bwd_ms"] / work.busy_ms)
                graphs.measure(row, attend, shard, device)
            print(describe(row), flush=True)
            yield row
        del q, k, v, dout, shard, whole
        if device.type == "cuda":
            torch.cuda.empty_cache()


def describe(row: dict[str, Any]) -> str:
    line = (f"seq {row['seq']:>6} ring {row['ring']} ({row['tokens_per_rank']:>5} a rank) {row['exchange']:<9}: "
            f"{row['rank_fwd_bwd_ms']:7.2f} ms fwd+bwd, ratio {row['ratio']:.2f}")
    if "gpu_busy_ms" in row:
        line += (f"; GPU busy {row['gpu_busy_ms']:.2f} ms ({row['kernels']} kernels, {row['copies']} copies/fills, "
                 f"wall/busy {row['wall_over_busy']:.2f})")
    if "graphed_ratio" in row:
        line += f"; graphed {row['graphed_fwd_bwd_ms']:.2f} ms, ratio {row['graphed_ratio']:.2f}"
    if "graph_error" in row or "graph_skipped" in row:
        line += f"; {not_graphed(row)}"
    return line


def not_graphed(row: dict[str, Any]) -> str:
    """Why a row has no graphed time ("" where it has one, or never would: a CPU's)."""
    if "graph_error" in row:
        return f"graph capture failed: {row['graph_error'].strip().splitlines()[-1]}"
    return row.get("graph_skipped", "")


def complete_sizes(rows: list[dict[str, Any]]) -> set[tuple[int, int]]:
    """The (seq, ring) sizes where every exchange was measured (a cut run leaves one short)."""
    measured: dict[tuple[int, int], set[str]] = {}
    for r in rows:
        measured.setdefault((r["seq"], r["ring"]), set()).add(r["exchange"])
    return {size for size, exchanges in measured.items() if exchanges == set(EXCHANGES)}


def complete(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows of ``complete_sizes``."""
    sizes = complete_sizes(rows)
    return [r for r in rows if (r["seq"], r["ring"]) in sizes]


def verdicts(rows: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """Per size, (what, verdict): FAIL where an exchange's graph was not captured there (its
    capture, or an earlier one, failed); else, where every exchange was measured, whether the
    better one's graphed ratio reaches the size's target (PASS or MISS)."""
    found = []
    whole = complete_sizes(rows)
    for size in sorted({(r["seq"], r["ring"]) for r in rows}):
        at = [r for r in rows if (r["seq"], r["ring"]) == size]
        failed = [r for r in at if not_graphed(r)]
        if failed:
            found.append((f"{at[0]['tokens_per_rank']} tokens a rank (ring {at[0]['ring']}): not graphed: "
                          + "; ".join(f"{r['exchange']}: {not_graphed(r)}" for r in failed), FAIL))
            continue
        graphed = [r for r in at if "graphed_ratio" in r]
        if size not in whole or not graphed or graphed[0]["target"] is None:
            continue
        best = max(graphed, key=lambda r: r["graphed_ratio"])
        met = best["graphed_ratio"] >= best["target"]
        found.append((f"{where(best)}: graphed {best['graphed_ratio']:.2f} (as run {best['ratio']:.2f}) "
                      f">= {best['target']}", PASS if met else MISS))
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
    interrupt_on_sigint()
    args = parse_args(argv)
    if args.device == "cuda" and (no_gpu := without_cuda("attention_launches")) is not None:
        return no_gpu
    run = Run("attention_launches")
    device = torch.device(args.device)
    rows: list[dict[str, Any]] = []
    interrupted, error = "", ""
    try:
        for row in measure(args, device):
            rows.append(row)
    except KeyboardInterrupt:
        interrupted = f"interrupted (SIGINT) after {len(rows)} rows: the rest is not measured"
    except Exception:  # noqa: BLE001 - what was measured is kept; the error is a result
        error = traceback.format_exc()[-3000:]
    for stopped in (interrupted, error):
        if stopped:
            print(stopped, file=sys.stderr)
    found = verdicts(rows)
    for what, verdict in found:
        print(f"{verdict}: {what}")
    # auto's pick against the faster exchange as the product runs it (not graphed).
    checks = auto_checks(complete(rows), lambda row: row["rank_fwd_bwd_ms"])
    smoke = device.type == "cpu"
    for check in checks:
        print(check.line(smoke))
    if not smoke:
        found += [(check.what(), PASS if check.met else MISS) for check in checks]
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    name_slug = slug(name) + ("-tiny" if args.tiny else "")
    config = {k: (str(v) if isinstance(v, torch.dtype) else v) for k, v in vars(args).items() if k != "out"}
    result = {"config": config, "rows": rows, "auto": [check.record() for check in checks],
              "targets": [{"what": what, "verdict": verdict, "met": verdict == PASS} for what, verdict in found],
              "interrupted": interrupted or None, "error": error or None}
    run.write(result, device_type=device.type, out=args.out or RESULTS_DIR / f"attention_launches-{name_slug}.json")
    if interrupted or error or any(verdict == FAIL for _, verdict in found):
        return 1
    return 1 if args.check and any(verdict != PASS for _, verdict in found) else 0


if __name__ == "__main__":
    sys.exit(main())
