"""All-gather K/V context parallelism: a ring's ranks gather the whole sequence's K and V at once
and attend their own queries to it, for short blocks.

A ring of R ranks passes K/V blocks R - 1 times, and each step costs a kernel launch, a merge and
a P2P round trip whatever the block's length; at a few thousand tokens per rank those fixed costs
outweigh the attention itself (bench/attention.py: 0.18 of a monolithic call's forward at 2K
tokens per rank on a ring of 8). Gathering K/V first, as Llama 3's context parallelism does
(Dubey et al. 2024, "The Llama 3 Herd of Models", section 3.3.2), takes the same bytes in one
collective (under GQA K/V are a fraction of Q), after which each rank runs a fixed number of
kernel calls however many ranks there are:

- causal: rank r holds zigzag chunks r and 2R-1-r of L tokens. Chunk c's queries see keys
  [0, cL) in full (one block against the gathered prefix, none for c = 0) and keys
  [cL, (c+1)L) causally (a square diagonal block); the two merge into the chunk's output. Four
  kernel calls and two merges a rank.
- non-causal: the local queries against every key, one call.

The backward runs each block's backward against the merged output and LSE, as the ring does,
accumulates dK/dV in fp32 over the whole gathered sequence, and a reduce-scatter hands each rank
the sum for its own shard. Packed documents: the whole sequence's documents are gathered once
per forward, and blocks cut at their boundaries as the ring's are (``blocks``). ``kv_exchange_for`` picks this or the ring by the length of a rank's
block.

Shape legend: B batch, S local sequence (two zigzag chunks of L = S/2), N the whole sequence
(R S), H query heads, K key/value heads, D head dim, R ranks in the ring.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np
import torch

from ringtrain.config import KV_EXCHANGES
from ringtrain.topology import zigzag_chunks
from ringtrain.train.attention import comm
from ringtrain.train.attention.block_kernel import AttentionKernel
from ringtrain.train.attention.blocks import Block, Cut, block_backward, block_forward
from ringtrain.train.attention.comm import ProcessGroup
from ringtrain.train.attention.documents import Documents
from ringtrain.train.attention.merge import merge_into_
from ringtrain.train.attention.window import shard_positions
from ringtrain.train.attention.zigzag import zigzag_shard, zigzag_unshard

Tensor = torch.Tensor

# Below this many tokens per rank the ring's per-step costs dominate: on an H200 (head dim 128,
# bf16) one rank's ring ran 0.80 / 0.94 of a monolithic call forward / backward at 8K tokens per
# rank and 0.97 / 0.97 at 16K (bench/attention.py).
ALLGATHER_BELOW_TOKENS = 16384


def kv_exchange_for(name: str, seq_local: int) -> str:
    """The K/V exchange ``attention.kv_exchange=name`` runs with ``seq_local`` tokens a rank; pure."""
    if name != "auto":
        if name not in KV_EXCHANGES:
            raise ValueError(f"kv_exchange {name!r} is not one of auto, {', '.join(KV_EXCHANGES)}")
        return name
    return "allgather" if seq_local < ALLGATHER_BELOW_TOKENS else "ring"


def allgather_blocks(rank: int, world: int, seq_local: int, *, causal: bool) -> list[Block]:
    """The blocks rank ``rank`` computes, rows of its shard against columns of the gathered
    sequence; a chunk's diagonal block comes before its prefix (its rows' LSE is finite first)."""
    if not causal:
        return [Block(slice(None), slice(None), causal=False)]
    half = seq_local // 2
    blocks = []
    for i, chunk in enumerate(zigzag_chunks(world, rank)):
        rows = slice(i * half, (i + 1) * half)
        blocks.append(Block(rows, slice(chunk * half, (chunk + 1) * half), causal=True))
        if chunk > 0:
            blocks.append(Block(rows, slice(0, chunk * half), causal=False))
    return blocks


def _gather(x_BS: Tensor, group: ProcessGroup) -> Tensor:
    """The whole sequence in order from every rank's zigzag shard of ``x`` (sequence on dim 1)."""
    return zigzag_unshard(list(comm.all_gather_stacked(x_BS, group).unbind(0)), dim=1)


def _block_cut(doc_pair: Optional[tuple[np.ndarray, np.ndarray]], window: Optional[int], rank: int, world: int,
               seq_local: int, blk: Block) -> Cut:
    """What cuts a block: its rows' documents among this rank's and its columns' among the whole
    sequence's; under a window, their positions too."""
    docs = {} if doc_pair is None else {"q_docs_BQ": doc_pair[0][:, blk.rows], "k_docs_BS": doc_pair[1][:, blk.cols]}
    if window is None:
        return Cut(**docs)
    whole = np.arange(world * seq_local)
    return Cut(**docs, window=window, q_positions=shard_positions(world, rank, seq_local)[blk.rows],
               k_positions=whole[blk.cols])


class _AllGatherAttention(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        q_BSHD: Tensor,
        k_BSKD: Tensor,
        v_BSKD: Tensor,
        docs: Optional[Documents],
        group: ProcessGroup,
        causal: bool,
        kernel: AttentionKernel,
        scale: float,
        window: Optional[int],
    ) -> Tensor:
        rank, world, seq_local = comm.group_rank(group), comm.group_size(group), q_BSHD.shape[1]
        # K and V in one collective, stacked after the sequence dim (which the unshard cuts), then
        # apart again: the kernels read each contiguous.
        kv_BN2KD = _gather(torch.stack((k_BSKD, v_BSKD), dim=2), group)
        kv_2BNKD = torch.stack((kv_BN2KD[:, :, 0], kv_BN2KD[:, :, 1]))
        # The rows' documents and those of the whole sequence, on the host (``blocks`` cuts by them).
        doc_pair = None if docs is None else (docs.host_BS, docs.whole_sequence(group).host_BS)
        out_BSHD = torch.empty(q_BSHD.shape, dtype=torch.float32, device=q_BSHD.device)
        lse_BHS = torch.empty((q_BSHD.shape[0], q_BSHD.shape[2], seq_local), dtype=torch.float32, device=q_BSHD.device)
        blocks = allgather_blocks(rank, world, seq_local, causal=causal)
        auxes: list[Any] = []
        filled: set[Optional[int]] = set()
        for blk in blocks:
            res = block_forward(
                kernel,
                q_BSHD[:, blk.rows],
                kv_2BNKD[0][:, blk.cols],
                kv_2BNKD[1][:, blk.cols],
                causal=blk.causal,
                scale=scale,
                cut=_block_cut(doc_pair, window, rank, world, seq_local, blk),
            )
            auxes.append(res.aux)
            if blk.rows.start in filled:
                merge_into_(out_BSHD[:, blk.rows], lse_BHS[:, :, blk.rows], res.out_BQHD, res.lse_BHQ)
            else:
                out_BSHD[:, blk.rows] = res.out_BQHD
                lse_BHS[:, :, blk.rows] = res.lse_BHQ
                filled.add(blk.rows.start)
        out_BSHD = out_BSHD.to(q_BSHD.dtype)
        ctx.save_for_backward(q_BSHD, kv_2BNKD, out_BSHD, lse_BHS)
        ctx.group, ctx.causal, ctx.kernel, ctx.scale, ctx.auxes, ctx.blocks = group, causal, kernel, scale, auxes, blocks
        ctx.doc_pair, ctx.window = doc_pair, window
        return out_BSHD

    @staticmethod
    def backward(ctx: Any, dout_BSHD: Tensor) -> tuple[Optional[Tensor], ...]:  # type: ignore[override]
        q_BSHD, kv_2BNKD, out_BSHD, lse_BHS = ctx.saved_tensors
        world = comm.group_size(ctx.group)
        dq_BSHD = torch.zeros(q_BSHD.shape, dtype=torch.float32, device=q_BSHD.device)
        dkv_2BNKD = torch.zeros(kv_2BNKD.shape, dtype=torch.float32, device=kv_2BNKD.device)
        row_lse = {blk.rows.start: lse_BHS[:, :, blk.rows].contiguous() for blk in ctx.blocks}
        for blk, aux in zip(ctx.blocks, ctx.auxes):
            dq, dk, dv = block_backward(
                ctx.kernel,
                dout_BSHD[:, blk.rows],
                q_BSHD[:, blk.rows],
                kv_2BNKD[0][:, blk.cols],
                kv_2BNKD[1][:, blk.cols],
                out_BSHD[:, blk.rows],
                row_lse[blk.rows.start],
                aux,
                causal=blk.causal,
                scale=ctx.scale,
                cut=_block_cut(ctx.doc_pair, ctx.window, comm.group_rank(ctx.group), world, q_BSHD.shape[1], blk),
            )
            dq_BSHD[:, blk.rows] += dq
            dkv_2BNKD[0][:, blk.cols] += dk
            dkv_2BNKD[1][:, blk.cols] += dv
        # Every rank's share of each rank's K/V gradient, in shard order; summed on its owner.
        by_owner_R2BSKD = torch.stack([zigzag_shard(dkv_2BNKD, dim=2, world=world, rank=r) for r in range(world)])
        dkv_2BSKD = comm.reduce_scatter_stacked(by_owner_R2BSKD, ctx.group)
        k_dtype = kv_2BNKD.dtype
        return (dq_BSHD.to(q_BSHD.dtype), dkv_2BSKD[0].to(k_dtype), dkv_2BSKD[1].to(k_dtype),
                None, None, None, None, None, None)


def allgather_attention(
    q_BSHD: Tensor,
    k_BSKD: Tensor,
    v_BSKD: Tensor,
    docs: Optional[Documents],
    group: ProcessGroup,
    causal: bool,
    kernel: AttentionKernel,
    scale: float,
    window: Optional[int] = None,
) -> Tensor:
    """Attention over the ring's whole sequence from this rank's zigzag shards, K/V gathered
    first; the inputs as ``ring.ring_attention`` takes them (already checked there)."""
    out_BSHD: Tensor = _AllGatherAttention.apply(q_BSHD, k_BSKD, v_BSKD, docs, group, causal, kernel, scale, window)
    return out_BSHD
