"""Benchmark: one rank's share of context-parallel attention against one kernel over the whole
sequence, on one GPU; and packed documents against the same sequence unpacked.

Ring, all-gathered K/V: for a ring of R ranks this runs the real ``ring_attention`` (both K/V
exchanges: passed around the ring, and all gathered, train/attention/exchanges/allgather.py) forward and
backward through autograd, for one rank, the worst one: under a causal mask the last rank's rows
take part in every merge. It is handed a loopback transport on the one GPU
(``ringtrain_dev.loopback``: a visiting block is a device copy of the rank's own K/V; the gather
stacks R copies), so what is timed is the rank's compute and copies, not the network; in a real
ring the transfers overlap the compute (ring) or precede it (all-gather, one collective of K/V,
small under GQA). Its TFLOP/s over one
monolithic causal call's over the whole sequence, same kernel, is the ratio printed.

Packed documents: local attention over one sequence of N documents, each rectangle of a
document run unmasked on the fastest kernel (train/attention/blocks.py), against the same
sequence unpacked: forward + backward time and peak memory.

Targets (``ringtrain_dev.ring_targets``): the better exchange's worst-rank ratio >= 0.95 forward
and backward at >= 8K tokens a rank, >= 0.85 at 4K, >= 0.7 at 2K; packed documents' throughput
>= 0.9x the unpacked sequence's with peak memory <= 1.1x; at every size, the exchange
``attention.kv_exchange=auto`` picks there (``choose_exchange``) no more than 5% slower, forward
and backward together, than the faster one measured (each size prints auto's pick and the best).
bf16, head dim 128, 32 query / 8 KV heads. ``--check`` exits 1 on a miss.

    PYTHONPATH=platform python bench/attention.py [--seq 16384 32768 ...] [--ring 2 4 8] [--kernel auto] [--check]
    PYTHONPATH=platform python bench/attention.py --device cpu --tiny   # the code path, no timing claims

The GPU tier (bench/gpu_check.py) runs it at short blocks only, ``--seq 4096 8192 16384 32768
65536``: 2K, 4K and 8K tokens a rank on rings of 2, 4 and 8 each, and auto's threshold at 16K.

Writes bench/results/attention-<device>.json (commit, device, every timing). The zigzag
balance (max/min causal work over ranks) is computed by counting and printed first. Needs CUDA
unless ``--device cpu``: without it, it prints the balance and exits 2 with a message.

Shape legend: B batch, S sequence (full) / S_l (one rank's), H query heads, K KV heads, D head dim.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

import torch

from ringtrain.train.attention import local_attention, ring_attention
from ringtrain.train.attention.kernels import get_kernel
from ringtrain.train.attention.zigzag import causal_work, zigzag_shard
from ringtrain_dev.bench_cli import slug, without_cuda
from ringtrain_dev.loopback import LoopbackTransport
from ringtrain_dev.record import RESULTS_DIR, Run
from ringtrain_dev.ring_targets import EXCHANGES, auto_checks, ratio_target
from ringtrain_dev.timing import fwd_bwd_ms

PACKED_SPEED_MIN, PACKED_MEMORY_MAX = 0.9, 1.1


def balance_report(seqs: Sequence[int], rings: Sequence[int]) -> list[dict[str, Any]]:
    """Max/min causal (query, key) pairs per rank, zigzag vs a contiguous split."""
    rows = []
    for seq in seqs:
        for ring in rings:
            zigzag, contiguous = causal_work(seq, ring), causal_work(seq, ring, zigzag=False)
            rows.append({"seq": seq, "ring": ring, "zigzag_max_over_min": max(zigzag) / min(zigzag),
                         "contiguous_max_over_min": max(contiguous) / min(contiguous)})
    return rows


def causal_flops(batch: int, heads: int, seq: int, head_dim: int) -> float:
    """Forward matmul FLOPs of causal attention over ``seq``: QK^T and PV, halved by the mask."""
    return 4.0 * batch * heads * seq * seq * head_dim / 2


def _inputs(args: argparse.Namespace, seq: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator(device=device).manual_seed(seq)
    B, H, K, D = args.batch, args.heads, args.kv_heads, args.head_dim
    shapes = [(B, seq, H, D), (B, seq, K, D), (B, seq, K, D), (B, seq, H, D)]
    return tuple(torch.randn(s, generator=gen, device=device, dtype=args.dtype) for s in shapes)


def bench_ring(args: argparse.Namespace, device: torch.device) -> list[dict[str, Any]]:
    kernel = get_kernel(args.kernel, device_type=device.type, dtype=args.dtype, head_dim=args.head_dim)
    rows = []
    for seq in args.seq:
        q, k, v, dout = _inputs(args, seq, device)
        mono = fwd_bwd_ms(lambda q, k, v: local_attention(q, k, v, causal=True, kernel=kernel), q, k, v, dout,
                          device, warmup=args.warmup, iters=args.iters)
        flops = causal_flops(args.batch, args.heads, seq, args.head_dim)
        for world in args.ring:
            if seq % (2 * world):
                continue
            rank = world - 1  # the worst: under the causal mask its rows take part in every merge
            shard = [zigzag_shard(t, dim=1, world=world, rank=rank).contiguous() for t in (q, k, v, dout)]
            for exchange in EXCHANGES:
                def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, exchange: str = exchange,
                           world: int = world) -> torch.Tensor:
                    return ring_attention(q, k, v, group=LoopbackTransport(rank, world), causal=True,
                                          kernel=kernel, kv_exchange=exchange)

                fwd, bwd = fwd_bwd_ms(attend, *shard, device, warmup=args.warmup, iters=args.iters)
                # One rank's share of the FLOPs is 1/R of the whole (zigzag balances them exactly).
                row = {"seq": seq, "ring": world, "tokens_per_rank": seq // world, "exchange": exchange,
                       "kernel": kernel.name, "monolithic_fwd_ms": mono[0], "monolithic_bwd_ms": mono[1],
                       "rank_fwd_ms": fwd, "rank_bwd_ms": bwd,
                       "fwd_ratio": (mono[0] / world) / fwd, "bwd_ratio": (mono[1] / world) / bwd,
                       "monolithic_fwd_tflops": flops / mono[0] / 1e9, "monolithic_bwd_tflops": 2.5 * flops / mono[1] / 1e9}
                rows.append(row)
                print(f"seq {seq:>6} ring {world} ({seq // world:>6} a rank) {exchange:<9}: worst rank "
                      f"{fwd:8.2f} / {bwd:8.2f} ms fwd/bwd, ratio {row['fwd_ratio']:.2f} / {row['bwd_ratio']:.2f} "
                      f"(monolithic {row['monolithic_fwd_tflops']:.0f} / {row['monolithic_bwd_tflops']:.0f} TFLOP/s)")
        del q, k, v, dout
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def packed_doc_ids(batch: int, seq: int, docs: int, device: torch.device) -> torch.Tensor:
    """``docs`` documents of equal length end to end in each sequence."""
    return (torch.arange(seq, device=device) * docs // seq).expand(batch, seq).contiguous()


def bench_packed(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    kernel = get_kernel(args.kernel, device_type=device.type, dtype=args.dtype, head_dim=args.head_dim)
    q, k, v, dout = _inputs(args, args.packed_seq, device)
    doc_ids = packed_doc_ids(args.batch, args.packed_seq, args.docs, device)
    out: dict[str, Any] = {"seq": args.packed_seq, "docs": args.docs, "kernel": kernel.name}
    for name, ids in (("unpacked", None), ("packed", doc_ids)):
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        fwd, bwd = fwd_bwd_ms(lambda q, k, v, ids=ids: local_attention(q, k, v, causal=True, doc_ids=ids, kernel=kernel),
                              q, k, v, dout, device, warmup=args.warmup, iters=args.iters)
        peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
        out[name] = {"fwd_ms": fwd, "bwd_ms": bwd, "peak_memory_bytes": peak}
    speed = (out["unpacked"]["fwd_ms"] + out["unpacked"]["bwd_ms"]) / (out["packed"]["fwd_ms"] + out["packed"]["bwd_ms"])
    out["packed_over_unpacked_throughput"] = speed
    if device.type == "cuda":
        out["packed_over_unpacked_memory"] = out["packed"]["peak_memory_bytes"] / out["unpacked"]["peak_memory_bytes"]
    print(f"{args.packed_seq} tokens, {args.docs} packed documents: {out['packed']['fwd_ms']:.2f} / "
          f"{out['packed']['bwd_ms']:.2f} ms fwd/bwd against {out['unpacked']['fwd_ms']:.2f} / "
          f"{out['unpacked']['bwd_ms']:.2f} unpacked: {speed:.2f}x the throughput")
    return out


def verdicts(rows: list[dict[str, Any]], packed: dict[str, Any]) -> list[tuple[str, bool]]:
    """(what, met) for every target measured."""
    found = []
    by_size: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for row in rows:
        by_size.setdefault((row["seq"], row["ring"]), []).append(row)
    for (seq, world), pair in sorted(by_size.items()):
        best = max(pair, key=lambda r: min(r["fwd_ratio"], r["bwd_ratio"]))
        tokens = seq // world
        need = ratio_target(tokens)
        if need is None:
            continue
        met = best["fwd_ratio"] >= need and best["bwd_ratio"] >= need
        found.append((f"{tokens} tokens a rank (ring {world}, {best['exchange']}): worst rank "
                      f"{best['fwd_ratio']:.2f} / {best['bwd_ratio']:.2f} >= {need}", met))
    if "packed_over_unpacked_memory" in packed:
        speed, memory = packed["packed_over_unpacked_throughput"], packed["packed_over_unpacked_memory"]
        found.append((f"packed documents: {speed:.2f}x the throughput (>= {PACKED_SPEED_MIN}), "
                      f"{memory:.2f}x the memory (<= {PACKED_MEMORY_MAX})",
                      speed >= PACKED_SPEED_MIN and memory <= PACKED_MEMORY_MAX))
    return found


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--tiny", action="store_true", help="small shapes: the code path on a CPU, no claims")
    p.add_argument("--kernel", default="auto")
    p.add_argument("--seq", type=int, nargs="+", default=None, help="whole sequences (default: 16K to 128K)")
    p.add_argument("--ring", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--packed-seq", type=int, default=32768)
    p.add_argument("--docs", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--check", action="store_true", help="exit 1 when a target is missed")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    if args.tiny:
        args.seq = args.seq or [256]
        args.ring, args.heads, args.kv_heads, args.head_dim = [2, 4], 4, 2, 16
        args.packed_seq, args.docs, args.warmup, args.iters = 256, 4, 1, 1
    args.seq = args.seq or [16384, 32768, 65536, 131072]
    args.dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    run = Run("attention")
    balance = balance_report(args.seq, args.ring)
    print("causal work per rank, max/min over ranks (1.00 = balanced):")
    for row in balance:
        print(f"  seq {row['seq']:>6} ring {row['ring']}: zigzag {row['zigzag_max_over_min']:.2f}, "
              f"contiguous {row['contiguous_max_over_min']:.2f}")
    if args.device == "cuda" and (no_gpu := without_cuda("attention")) is not None:
        return no_gpu
    device = torch.device(args.device)
    rows = bench_ring(args, device)
    packed = bench_packed(args, device)
    smoke = device.type == "cpu"
    found = [] if smoke else verdicts(rows, packed)
    for what, met in found:
        print(f"{'PASS' if met else 'MISS'}: {what}")
    # auto's pick against the faster exchange, forward and backward together.
    checks = auto_checks(rows, lambda row: row["rank_fwd_ms"] + row["rank_bwd_ms"])
    for check in checks:
        print(check.line(smoke))
    if not smoke:
        found += [(check.what(), check.met) for check in checks]
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    name_slug = slug(name) + ("-tiny" if args.tiny else "")
    config = {k: (str(v) if isinstance(v, torch.dtype) else v) for k, v in vars(args).items() if k != "out"}
    result = {"config": config, "balance": balance, "timings": rows, "packed": packed,
              "auto": [check.record() for check in checks],
              "targets": [{"what": what, "met": met} for what, met in found]}
    run.write(result, device_type=device.type, out=args.out or RESULTS_DIR / f"attention-{name_slug}.json")
    return 1 if args.check and not all(met for _, met in found) else 0


if __name__ == "__main__":
    sys.exit(main())
