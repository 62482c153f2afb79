"""Benchmark: a sliding-window layer's attention against a full causal one, at cp 1 and cp 4.

At 32K tokens with a 1K window, a windowed layer needs 1/32 of a full causal layer's score entries
in principle; cut into tiles of the window (train/attention/window.py: each row of tiles its causal
diagonal and the upper triangle before it) it computes S W of them, 1/16. This times the real
attention functions forward and backward: ``local_attention`` at cp 1, and at cp 4 the worst rank of
a zigzag ring with its transport looped back on one device (as bench/attention.py does): the
neighbour exchange under the window, the ring under full causal. It prints each ratio (windowed over
full, target <= 0.1) beside the ratio of score entries computed, and writes the JSON.

    PYTHONPATH=platform python bench/window.py [--device cpu] [--seq 32768] [--window 1024] [--check]

On a CPU the heads are few so the full causal layer takes seconds, not minutes.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from ringtrain.train.attention import local_attention, ring_attention
from ringtrain.train.attention.window import CAUSAL, UPPER, shard_positions, window_tiles
from ringtrain_dev.bench_cli import slug
from ringtrain_dev.loopback import LoopbackTransport
from ringtrain_dev.record import RESULTS_DIR, Run
from ringtrain_dev.timing import fwd_bwd_ms

TARGET = 0.1


def computed_entries(q_pos: np.ndarray, k_pos: np.ndarray, window: Optional[int]) -> float:
    """Score entries computed: a causal square or upper triangle counts half, a masked tile whole."""
    if window is None:
        return float(np.sum(q_pos[:, None] >= k_pos[None, :]))
    total = 0.0
    for t in window_tiles(q_pos, k_pos, window):
        area = (t.rows.stop - t.rows.start) * (t.cols.stop - t.cols.start)
        total += area / 2 if t.kind in (CAUSAL, UPPER) else area
    return total


def measure(args: argparse.Namespace, cp: int, window: Optional[int], device: torch.device) -> dict[str, Any]:
    gen = torch.Generator(device=device).manual_seed(cp)
    local = args.seq // cp
    shapes = [(1, local, args.heads, args.head_dim), (1, local, args.kv_heads, args.head_dim),
              (1, local, args.kv_heads, args.head_dim), (1, local, args.heads, args.head_dim)]
    q, k, v, dout = (torch.randn(s, generator=gen, device=device, dtype=args.dtype) for s in shapes)
    if cp == 1:
        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return local_attention(q, k, v, causal=True, window=window)

        fwd, bwd = fwd_bwd_ms(attend, q, k, v, dout, device, warmup=1, iters=args.iters)
        entries = computed_entries(np.arange(args.seq), np.arange(args.seq), window)
    else:
        rank = cp - 1  # the worst rank of the full causal ring (every merge); any rank under a window
        group = LoopbackTransport(rank, cp)

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return ring_attention(q, k, v, group=group, causal=True, window=window, kv_exchange="ring")

        fwd, bwd = fwd_bwd_ms(attend, q, k, v, dout, device, warmup=1, iters=args.iters)
        positions = [shard_positions(cp, r, local) for r in range(cp)]
        entries = sum(computed_entries(positions[rank], positions[j], window) for j in range(cp))
    return {"cp": cp, "window": window, "fwd_ms": fwd, "bwd_ms": bwd, "entries": entries}


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seq", type=int, default=32768)
    p.add_argument("--window", type=int, default=1024)
    p.add_argument("--cp", type=int, nargs="+", default=[1, 4])
    p.add_argument("--heads", type=int, default=None, help="query heads (default 2 on a CPU, 32 on a GPU)")
    p.add_argument("--kv-heads", type=int, default=None)
    p.add_argument("--head-dim", type=int, default=None)
    p.add_argument("--iters", type=int, default=1)
    p.add_argument("--check", action="store_true")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    cpu = args.device == "cpu"
    args.heads = args.heads or (2 if cpu else 32)
    args.kv_heads = args.kv_heads or (1 if cpu else 8)
    args.head_dim = args.head_dim or (32 if cpu else 128)
    args.dtype = torch.float32 if cpu else torch.bfloat16
    device = torch.device(args.device)
    run = Run("window")
    rows, met = [], True
    for cp in args.cp:
        full, windowed = measure(args, cp, None, device), measure(args, cp, args.window, device)
        time_ratio = (windowed["fwd_ms"] + windowed["bwd_ms"]) / (full["fwd_ms"] + full["bwd_ms"])
        entry_ratio = windowed["entries"] / full["entries"]
        ok = time_ratio <= TARGET and entry_ratio <= TARGET
        met &= ok
        rows.append({"cp": cp, "full": full, "windowed": windowed, "time_ratio": time_ratio, "entry_ratio": entry_ratio})
        print(f"cp {cp}: {args.window}-token window at {args.seq} tokens: {windowed['fwd_ms']:.0f} / "
              f"{windowed['bwd_ms']:.0f} ms fwd/bwd against {full['fwd_ms']:.0f} / {full['bwd_ms']:.0f} full causal: "
              f"time {time_ratio:.3f}, score entries {entry_ratio:.3f} (target <= {TARGET}): {'PASS' if ok else 'MISS'}")
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    name_slug = slug(name)
    config = {k: (str(v) if isinstance(v, torch.dtype) else v) for k, v in vars(args).items() if k != "out"}
    run.write({"config": config, "rows": rows, "target": TARGET}, device_type=device.type,
              out=args.out or RESULTS_DIR / f"window-{name_slug}.json")
    return 1 if args.check and not met else 0


if __name__ == "__main__":
    sys.exit(main())
