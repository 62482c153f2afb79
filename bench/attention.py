"""Benchmark: one rank's share of zigzag ring attention against one kernel over the whole sequence.

On one GPU, for a ring of N ranks, this times the blocks a single rank computes (one causal
diagonal block plus N-1 half blocks, with the fp32 LSE merges and dK/dV accumulation), using
the same block kernels as training, and compares its TFLOP/s with one monolithic causal call
over the full sequence. The P2P transfers are not simulated: they overlap the compute in the
real ring. bf16, causal, head_dim 128, GQA.

It also reports the zigzag balance (max/min causal work over ranks), computed by counting, so
that part runs without a GPU too. Without CUDA the timing part is skipped and it exits 0.

    PYTHONPATH=platform python bench/attention.py [--kernel auto] [--seq 8192 ...] [--ring 2 4 8]

Writes bench/results/attention-<device>.json (commit, device, torch and CUDA versions, every timing).

Shape legend: B batch, S sequence (full) / S_l (one rank's), H query heads, K KV heads, D head dim.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ringtrain.train.attention.blocks import block_backward, block_forward
from ringtrain.train.attention.kernels import AttentionKernel, BlockOutput, get_kernel
from ringtrain.train.attention.merge import merge_partials
from ringtrain.train.attention.ring import zigzag_block
from ringtrain.train.attention.zigzag import causal_work

sys.path.insert(0, str(Path(__file__).resolve().parent))
from record import RESULTS_DIR, Run  # noqa: E402


def balance_report(seqs: list[int], rings: list[int]) -> list[dict[str, Any]]:
    """Max/min causal (query, key) pairs per rank, zigzag vs a contiguous split."""
    rows = []
    for seq in seqs:
        for ring in rings:
            zigzag, contiguous = causal_work(seq, ring), causal_work(seq, ring, zigzag=False)
            rows.append(
                {
                    "seq": seq,
                    "ring": ring,
                    "zigzag_max_over_min": max(zigzag) / min(zigzag),
                    "contiguous_max_over_min": max(contiguous) / min(contiguous),
                }
            )
    return rows


def causal_flops(batch: int, heads: int, q_len: int, k_len: int, head_dim: int, causal: bool) -> float:
    """Forward matmul FLOPs of one block: QK^T and PV, 2 FLOPs per multiply-add, halved if causal."""
    flops = 4.0 * batch * heads * q_len * k_len * head_dim
    return flops / 2 if causal else flops


def cuda_time_ms(fn: Callable[[], Any], *, warmup: int = 2, iters: int = 5) -> float:
    """Median wall time of ``fn`` on the GPU, in milliseconds."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(iters):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(stop))
    return statistics.median(samples)


def rank_forward(
    kernel: AttentionKernel, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rank: int, world: int, scale: float
) -> tuple[torch.Tensor, torch.Tensor, list[BlockOutput]]:
    """Rank ``rank``'s ring forward with its own K/V standing in for every visiting block."""
    out = lse = torch.empty(0)
    blocks = []
    for step in range(world):
        blk = zigzag_block((rank - step) % world, rank, q.shape[1], causal=True)
        res = block_forward(kernel, q[:, blk.rows], k[:, blk.cols], v[:, blk.cols], causal=blk.causal, scale=scale)
        blocks.append(res)
        if step == 0:
            out, lse = res.out_BQHD.float(), res.lse_BHQ
        else:
            out[:, blk.rows], lse[:, :, blk.rows] = merge_partials(
                out[:, blk.rows], lse[:, :, blk.rows], res.out_BQHD, res.lse_BHQ
            )
    return out.to(q.dtype), lse, blocks


def rank_backward(
    kernel: AttentionKernel,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dout: torch.Tensor,
    blocks: list[BlockOutput],
    rank: int,
    world: int,
    scale: float,
) -> None:
    dq_acc = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dkv_acc = torch.zeros((2, *k.shape), dtype=torch.float32, device=k.device)
    for step in range(world):
        blk = zigzag_block((rank - step) % world, rank, q.shape[1], causal=True)
        dq, dk, dv = block_backward(
            kernel, dout[:, blk.rows], q[:, blk.rows], k[:, blk.cols], v[:, blk.cols],
            out[:, blk.rows], lse[:, :, blk.rows], blocks[step].aux, causal=blk.causal, scale=scale,
        )
        dq_acc[:, blk.rows] += dq
        dkv_acc[0][:, blk.cols] += dk
        dkv_acc[1][:, blk.cols] += dv


def bench_gpu(args: argparse.Namespace) -> list[dict[str, Any]]:
    device, dtype = torch.device("cuda"), torch.bfloat16
    kernel = get_kernel(args.kernel, device_type="cuda", dtype=dtype, head_dim=args.head_dim)
    B, H, K, D = args.batch, args.heads, args.kv_heads, args.head_dim
    scale = D**-0.5
    rows = []
    for seq in args.seq:
        q = torch.randn(B, seq, H, D, device=device, dtype=dtype)
        k = torch.randn(B, seq, K, D, device=device, dtype=dtype)
        v = torch.randn(B, seq, K, D, device=device, dtype=dtype)
        dout = torch.randn_like(q)
        full = kernel.forward(q, k, v, causal=True, scale=scale)
        mono_fwd = cuda_time_ms(lambda: kernel.forward(q, k, v, causal=True, scale=scale))
        mono_bwd = cuda_time_ms(
            lambda: kernel.backward(dout, q, k, v, full.out_BQHD, full.lse_BHQ, full.aux, causal=True, scale=scale)
        )
        mono_flops = causal_flops(B, H, seq, seq, D, causal=True)
        del full
        for world in args.ring:
            local = seq // world
            ql, kl, vl, doutl = q[:, :local], k[:, :local], v[:, :local], dout[:, :local]
            rank = 0  # zigzag gives every rank the same blocks up to order; rank 0 stands for all
            out, lse, blocks = rank_forward(kernel, ql, kl, vl, rank, world, scale)
            ring_fwd = cuda_time_ms(lambda: rank_forward(kernel, ql, kl, vl, rank, world, scale))
            ring_bwd = cuda_time_ms(
                lambda: rank_backward(kernel, ql, kl, vl, out, lse, doutl, blocks, rank, world, scale)
            )
            ring_flops = mono_flops / world
            row = {
                "seq": seq,
                "ring": world,
                "kernel": kernel.name,
                "monolithic_fwd_ms": mono_fwd,
                "monolithic_bwd_ms": mono_bwd,
                "rank_fwd_ms": ring_fwd,
                "rank_bwd_ms": ring_bwd,
                # The backward does 2.5x the forward's matmul FLOPs (5 matmuls against 2).
                "monolithic_fwd_tflops": mono_flops / mono_fwd / 1e9,
                "monolithic_bwd_tflops": 2.5 * mono_flops / mono_bwd / 1e9,
                "rank_fwd_tflops": ring_flops / ring_fwd / 1e9,
                "rank_bwd_tflops": 2.5 * ring_flops / ring_bwd / 1e9,
            }
            row["fwd_ratio"] = row["rank_fwd_tflops"] / row["monolithic_fwd_tflops"]
            row["bwd_ratio"] = row["rank_bwd_tflops"] / row["monolithic_bwd_tflops"]
            rows.append(row)
            print(
                f"seq {seq:>6} ring {world}: monolithic {row['monolithic_fwd_tflops']:6.1f} / "
                f"{row['monolithic_bwd_tflops']:6.1f} TFLOP/s (fwd/bwd), one rank {row['rank_fwd_tflops']:6.1f} / "
                f"{row['rank_bwd_tflops']:6.1f}, ratio {row['fwd_ratio']:.2f} / {row['bwd_ratio']:.2f}"
            )
            del out, lse, blocks
        del q, k, v, dout
        torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernel", default="auto")
    parser.add_argument("--seq", type=int, nargs="+", default=[8192, 16384, 32768, 65536, 131072])
    parser.add_argument("--ring", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    args = parser.parse_args(argv)
    run = Run("attention")

    balance = balance_report(args.seq, args.ring)
    print("causal work per rank, max/min over ranks (1.00 = balanced):")
    for row in balance:
        print(
            f"  seq {row['seq']:>6} ring {row['ring']}: zigzag {row['zigzag_max_over_min']:.2f}, "
            f"contiguous {row['contiguous_max_over_min']:.2f}"
        )
    if not torch.cuda.is_available():
        print("CUDA is not available: skipping the kernel timings (run on a GPU machine for TFLOP/s).")
        return 0

    timings = bench_gpu(args)
    name = torch.cuda.get_device_name()
    result = {"config": {k: v for k, v in vars(args).items()}, "balance": balance, "timings": timings}
    run.write(result, device_type="cuda",
              out=RESULTS_DIR / f"attention-{re.sub(r'[^A-Za-z0-9]+', '-', name).strip('-').lower()}.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
