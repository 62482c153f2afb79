"""The LSE merge of ``merge.merge_into_`` as one Triton kernel: read both partials, write the merge.

One program merges ``BLOCK_ROWS`` (batch, query, head) rows of D values each: it loads the two
log-sum-exps of its rows, forms the weights as ``merge.merge_partials`` does (m replaced by 0
where both are -inf, so an empty row stays at 0 / -inf), and rewrites the accumulator's output
and LSE in place. Every tensor is addressed through its own strides, so the accumulators can be
views (a ring block's rows of the whole sequence) and the block's output any layout. Rows run
head-fastest, as BSHD stores them, so a program's loads are contiguous in D and across heads.

Importing this module imports Triton; ``merge`` imports it only where Triton is installed.

Shape legend: B batch, Q query rows, H heads, D head dim.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

Tensor = torch.Tensor

BLOCK_ROWS = 16


@triton.jit
def _merge(
    acc_out, acc_lse, blk_out, blk_lse,
    num_rows, Q, H, D,
    ao_b, ao_q, ao_h, ao_d,
    al_b, al_h, al_q,
    bo_b, bo_q, bo_h, bo_d,
    bl_b, bl_h, bl_q,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # In 64 bits: a row's offset (its batch, query and head times their strides) passes 2^31 once
    # an accumulator holds 2^31 elements (128K tokens of 128 heads of 128), where int32 would wrap.
    rows = (tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)).to(tl.int64)
    live = rows < num_rows
    h = rows % H
    q = (rows // H) % Q
    b = rows // (H * Q)

    a = tl.load(acc_lse + b * al_b + h * al_h + q * al_q, mask=live, other=float("-inf"))
    c = tl.load(blk_lse + b * bl_b + h * bl_h + q * bl_q, mask=live, other=float("-inf")).to(tl.float32)
    m = tl.maximum(a, c)
    m = tl.where(m == float("-inf"), 0.0, m)
    wa = tl.exp(a - m)
    wc = tl.exp(c - m)
    total = wa + wc
    lse = m + tl.log(total)
    inv = tl.where(total > 0, 1.0 / total, 0.0)
    wa = wa * inv
    wc = wc * inv

    d = tl.arange(0, BLOCK_D)
    both = live[:, None] & (d < D)[None, :]
    acc_at = acc_out + (b * ao_b + q * ao_q + h * ao_h)[:, None] + d[None, :] * ao_d
    blk_at = blk_out + (b * bo_b + q * bo_q + h * bo_h)[:, None] + d[None, :] * bo_d
    o_a = tl.load(acc_at, mask=both, other=0.0)
    o_c = tl.load(blk_at, mask=both, other=0.0).to(tl.float32)
    tl.store(acc_at, wa[:, None] * o_a + wc[:, None] * o_c, mask=both)
    tl.store(acc_lse + b * al_b + h * al_h + q * al_q, lse, mask=live)


def merge_into_(acc_out_BQHD: Tensor, acc_lse_BHQ: Tensor, blk_out_BQHD: Tensor, blk_lse_BHQ: Tensor) -> None:
    """``merge.merge_into_`` in one kernel launch."""
    B, Q, H, D = acc_out_BQHD.shape
    if blk_out_BQHD.shape != acc_out_BQHD.shape or acc_lse_BHQ.shape != (B, H, Q) or blk_lse_BHQ.shape != (B, H, Q):
        raise ValueError(
            f"merge shapes disagree: out {tuple(acc_out_BQHD.shape)} / {tuple(blk_out_BQHD.shape)}, "
            f"lse {tuple(acc_lse_BHQ.shape)} / {tuple(blk_lse_BHQ.shape)}"
        )
    num_rows = B * Q * H
    if num_rows == 0:
        return
    grid = (triton.cdiv(num_rows, BLOCK_ROWS),)
    _merge[grid](
        acc_out_BQHD, acc_lse_BHQ, blk_out_BQHD, blk_lse_BHQ,
        num_rows, Q, H, D,
        *acc_out_BQHD.stride(), *acc_lse_BHQ.stride(), *blk_out_BQHD.stride(), *blk_lse_BHQ.stride(),
        BLOCK_ROWS=BLOCK_ROWS,
        BLOCK_D=triton.next_power_of_2(D),
    )
