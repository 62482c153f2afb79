"""Sliding-window context parallelism: each rank's K/V go straight to the ranks whose windows
reach them, not around the ring.

Under a window of W tokens a query sees only keys within W positions before it. On a zigzag
ring a rank's two chunks then see into few other ranks' shards (``window.needed_sources``; with
W no longer than a chunk, its two ring neighbours), so passing every K/V block around all R
ranks would move and wait for blocks nobody reads. Here a rank sends its K and V once to each
rank that needs them and receives from each rank it needs, in one group launch, and attends
its own block while they are in flight; each visiting block is cut by the window
(``blocks``), and the partial outputs merge through their LSEs. The backward sends each
visiting block's dK/dV (fp32) back to its owner, which adds them to its own.

Shape legend: B batch, S local sequence (two zigzag chunks), H query heads, K key/value heads,
D head dim, R ranks in the ring.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import torch

from ringtrain.train.attention import comm
from ringtrain.train.attention.block_kernel import AttentionKernel
from ringtrain.train.attention.blocks import Cut, block_backward, block_forward
from ringtrain.train.attention.comm import ProcessGroup
from ringtrain.train.attention.documents import Documents
from ringtrain.train.attention.merge import merge_into_
from ringtrain.train.attention.window import needed_sources, shard_positions

Tensor = torch.Tensor

_KV_TAG = 16
_DKV_TAG = 24


@functools.lru_cache(maxsize=None)
def _needs(world: int, seq_local: int, window: int) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(sources) for sources in needed_sources(world, seq_local, window))


def sparse(world: int, seq_local: int, window: int) -> bool:
    """Whether some rank needs fewer than all ranks' K/V: then this beats the ring."""
    return any(len(sources) < world for sources in _needs(world, seq_local, window))


def _cut(docs: Optional[list[Any]], rank: int, source: int, world: int, seq_local: int, window: int) -> Cut:
    q_pos, k_pos = shard_positions(world, rank, seq_local), shard_positions(world, source, seq_local)
    if docs is None:
        return Cut(window=window, q_positions=q_pos, k_positions=k_pos)
    return Cut(docs[rank], docs[source], window, q_pos, k_pos)


class _NeighbourAttention(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        q_BSHD: Tensor,
        k_BSKD: Tensor,
        v_BSKD: Tensor,
        docs: Optional[Documents],
        group: ProcessGroup,
        kernel: AttentionKernel,
        scale: float,
        window: int,
    ) -> Tensor:
        rank, world, seq_local = comm.group_rank(group), comm.group_size(group), q_BSHD.shape[1]
        needs = _needs(world, seq_local, window)
        sources = [j for j in needs[rank] if j != rank]
        readers = [r for r in range(world) if r != rank and rank in needs[r]]
        visiting = {j: [torch.empty_like(k_BSKD), torch.empty_like(v_BSKD)] for j in sources}
        pending = comm.exchange({r: [k_BSKD, v_BSKD] for r in readers}, visiting, group, tag=_KV_TAG)
        shard_docs = None if docs is None else [shard.host_BS for shard in docs.shards(group)]

        # Its own block first, while the others' K/V travel.
        res = block_forward(kernel, q_BSHD, k_BSKD, v_BSKD, causal=True, scale=scale,
                            cut=_cut(shard_docs, rank, rank, world, seq_local, window))
        out_BSHD, lse_BHS = res.out_BQHD.float(), res.lse_BHQ.clone()
        auxes = {rank: res.aux}
        pending.wait()
        for j in sources:
            k_j, v_j = visiting[j]
            res = block_forward(kernel, q_BSHD, k_j, v_j, causal=True, scale=scale,
                                cut=_cut(shard_docs, rank, j, world, seq_local, window))
            merge_into_(out_BSHD, lse_BHS, res.out_BQHD, res.lse_BHQ)
            auxes[j] = res.aux
        out_BSHD = out_BSHD.to(q_BSHD.dtype)
        ctx.save_for_backward(q_BSHD, k_BSKD, v_BSKD, out_BSHD, lse_BHS, *(t for j in sources for t in visiting[j]))
        ctx.group, ctx.kernel, ctx.scale, ctx.window = group, kernel, scale, window
        ctx.sources, ctx.readers, ctx.auxes, ctx.shard_docs = sources, readers, auxes, shard_docs
        return out_BSHD

    @staticmethod
    def backward(ctx: Any, dout_BSHD: Tensor) -> tuple[Optional[Tensor], ...]:  # type: ignore[override]
        q_BSHD, k_BSKD, v_BSKD, out_BSHD, lse_BHS, *visiting_kv = ctx.saved_tensors
        rank, world, seq_local = comm.group_rank(ctx.group), comm.group_size(ctx.group), q_BSHD.shape[1]
        kv = {rank: (k_BSKD, v_BSKD), **{j: (visiting_kv[2 * i], visiting_kv[2 * i + 1]) for i, j in enumerate(ctx.sources)}}
        dq_BSHD = torch.zeros(q_BSHD.shape, dtype=torch.float32, device=q_BSHD.device)
        dkv: dict[int, Tensor] = {}
        for j in [rank, *ctx.sources]:
            dq, dk, dv = block_backward(
                ctx.kernel, dout_BSHD, q_BSHD, kv[j][0], kv[j][1], out_BSHD, lse_BHS, ctx.auxes[j],
                causal=True, scale=ctx.scale, cut=_cut(ctx.shard_docs, rank, j, world, seq_local, ctx.window),
            )
            dq_BSHD += dq
            dkv[j] = torch.stack((dk, dv)).float()
        # Every visiting block's gradients home to its owner; the readers' shares of ours here.
        arriving = {r: [torch.empty_like(dkv[rank])] for r in ctx.readers}
        comm.exchange({j: [dkv[j]] for j in ctx.sources}, arriving, ctx.group, tag=_DKV_TAG).wait()
        mine_2BSKD = dkv[rank] + sum((arriving[r][0] for r in ctx.readers), torch.zeros_like(dkv[rank]))
        return (dq_BSHD.to(q_BSHD.dtype), mine_2BSKD[0].to(k_BSKD.dtype), mine_2BSKD[1].to(v_BSKD.dtype),
                None, None, None, None, None)


def neighbour_attention(
    q_BSHD: Tensor,
    k_BSKD: Tensor,
    v_BSKD: Tensor,
    docs: Optional[Documents],
    group: ProcessGroup,
    kernel: AttentionKernel,
    scale: float,
    window: int,
) -> Tensor:
    """Causal windowed attention over the ring's whole sequence from this rank's zigzag shards,
    K/V exchanged only with the ranks that need them; inputs as ``ring.ring_attention`` takes them."""
    out_BSHD: Tensor = _NeighbourAttention.apply(q_BSHD, k_BSKD, v_BSKD, docs, group, kernel, scale, window)
    return out_BSHD
