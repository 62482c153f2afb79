"""Zigzag ring attention: K/V blocks travel around the ring while each rank attends to them.

Each of the R ranks holds a zigzag shard of the sequence (chunks r and 2R-1-r, see ``zigzag``)
for its queries, keys and values. At step i rank r holds the K/V of source j = (r - i) mod R
and computes one block (ring-flash-attention's zigzag decomposition; its names below):

- j == r: its own K/V, causal over both local chunks (the concatenation is in global order);
- j <  r: every local query sees all of the source's first chunk and none of its second;
- j >  r: only the local second chunk sees anything, and it sees all of the source's K/V.

Every rank thus does one diagonal block plus R-1 half blocks: balanced. The next K/V block is in
flight (async P2P) while the current one computes. Partial outputs merge in fp32 through their
log-sum-exps. The backward sends K/V around again, and with them the fp32 dK/dV accumulator of
each block, which reaches its owner after a full turn.

K/V travel unexpanded (K heads, not H): the kernel handles GQA. K and V go as two messages of
one group launch (no stacked copy); the partial outputs merge in place into the fp32
accumulator's rows (``merge.merge_into_``, one kernel on CUDA). With packed documents every
rank's document ids are gathered once per forward (``documents.Documents``), so a visiting K/V
block's documents are known without travelling with it, and each block is cut at document
boundaries on the host (``blocks``).

Shape legend: B batch, S local sequence (two zigzag chunks of S/2), H query heads, K key/value
heads, D head dim; ``dkv_2BSKD`` is the fp32 dK and dV accumulators of one K/V block, stacked so
they travel as one message.
"""

from __future__ import annotations

from typing import Any, Optional, Union

import numpy as np
import torch

from ringtrain.train.attention.allgather import allgather_attention, kv_exchange_for
from ringtrain.train.attention.blocks import Block, Cut, block_backward, block_forward
from ringtrain.train.attention.comm import ProcessGroup, RingExchange, group_size
from ringtrain.train.attention.documents import Documents
from ringtrain.train.attention.block_kernel import AttentionKernel, default_scale
from ringtrain.train.attention.kernels import KernelArg, resolve_kernel
from ringtrain.train.attention.local import check_qkv, check_window, local_attention
from ringtrain.train.attention.merge import merge_into_
from ringtrain.train.attention.neighbours import neighbour_attention, sparse
from ringtrain.train.attention.window import shard_positions

Tensor = torch.Tensor

# One tag per stream of transfers (see RingExchange); a stream of n tensors uses tag..tag+n-1.
_KV_TAG = 0
_DKV_TAG = 8


_ALL = slice(None)


def zigzag_block(source: int, rank: int, seq_local: int, *, causal: bool) -> Block:
    """The block rank ``rank`` computes against the K/V shard of ring rank ``source``."""
    if not causal:
        return Block(_ALL, _ALL, causal=False)
    half = seq_local // 2
    if source == rank:
        return Block(_ALL, _ALL, causal=True)
    if source < rank:
        return Block(_ALL, slice(0, half), causal=False)
    return Block(slice(half, None), _ALL, causal=False)


def _block_cut(
    shard_docs: Optional[list[np.ndarray]], window: Optional[int], ring: Any, source: int, blk: Block, seq_local: int
) -> Cut:
    """What cuts a block of rank ``ring.rank``'s rows against ring rank ``source``'s K/V: their
    documents (from every rank's, gathered once) and, under a window, their positions."""
    docs = {} if shard_docs is None else {
        "q_docs_BQ": shard_docs[ring.rank][:, blk.rows], "k_docs_BS": shard_docs[source][:, blk.cols]
    }
    if window is None:
        return Cut(**docs)
    return Cut(
        **docs,
        window=window,
        q_positions=shard_positions(ring.world, ring.rank, seq_local)[blk.rows],
        k_positions=shard_positions(ring.world, source, seq_local)[blk.cols],
    )


def _row_lses(lse_BHS: Tensor, seq_local: int) -> dict[Optional[int], Tensor]:
    """The LSE of each row set a block can have (every row, the second half), contiguous, made
    once per backward rather than once per block (the kernels' backward ops take it contiguous)."""
    return {None: lse_BHS.contiguous(), seq_local // 2: lse_BHS[:, :, seq_local // 2 :].contiguous()}


class _RingAttention(torch.autograd.Function):
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
        ring = RingExchange(group)
        seq_local = q_BSHD.shape[1]
        kv = [k_BSKD, v_BSKD]
        # Every rank's documents on the host, gathered once per forward: a visiting block's are
        # its source's, so no ids travel with the K/V.
        shard_docs = None if docs is None else [shard.host_BS for shard in docs.shards(group)]
        auxes: list[Any] = []
        out_BSHD = lse_BHS = torch.empty(0)

        for step in range(ring.world):
            pending = None
            if step + 1 < ring.world:
                # K and V as separate messages of one group launch: no stacked copy.
                next_kv = [torch.empty_like(t) for t in kv]
                pending = ring.start(kv, next_kv, tag=_KV_TAG)

            source = (ring.rank - step) % ring.world
            blk = zigzag_block(source, ring.rank, seq_local, causal=causal)
            res = block_forward(
                kernel,
                q_BSHD[:, blk.rows],
                kv[0][:, blk.cols],
                kv[1][:, blk.cols],
                causal=blk.causal,
                scale=scale,
                cut=_block_cut(shard_docs, window, ring, source, blk, seq_local),
            )
            auxes.append(res.aux)
            if step == 0:  # the diagonal block covers every row
                out_BSHD, lse_BHS = res.out_BQHD.float(), res.lse_BHQ.clone()
            else:  # in place, into the rows' views: nothing copied out and back
                merge_into_(out_BSHD[:, blk.rows], lse_BHS[:, :, blk.rows], res.out_BQHD, res.lse_BHQ)

            if pending is not None:
                pending.wait()
                kv = next_kv

        out_BSHD = out_BSHD.to(q_BSHD.dtype)
        ctx.save_for_backward(q_BSHD, k_BSKD, v_BSKD, out_BSHD, lse_BHS)
        ctx.group, ctx.causal, ctx.kernel, ctx.scale, ctx.auxes = group, causal, kernel, scale, auxes
        ctx.shard_docs, ctx.window = shard_docs, window
        return out_BSHD

    @staticmethod
    def backward(ctx: Any, dout_BSHD: Tensor) -> tuple[Optional[Tensor], ...]:  # type: ignore[override]
        q_BSHD, k_BSKD, v_BSKD, out_BSHD, lse_BHS = ctx.saved_tensors
        ring = RingExchange(ctx.group)
        seq_local = q_BSHD.shape[1]
        row_lse = _row_lses(lse_BHS, seq_local)
        kv = [k_BSKD, v_BSKD]
        dq_BSHD = torch.zeros(q_BSHD.shape, dtype=torch.float32, device=q_BSHD.device)
        dkv_2BSKD = next_dkv_2BSKD = torch.empty(0)
        dkv_pending = None

        for step in range(ring.world):
            kv_pending = None
            if step + 1 < ring.world:
                next_kv = [torch.empty_like(t) for t in kv]
                kv_pending = ring.start(kv, next_kv, tag=_KV_TAG)

            source = (ring.rank - step) % ring.world
            blk = zigzag_block(source, ring.rank, seq_local, causal=ctx.causal)
            dq, dk, dv = block_backward(
                ctx.kernel,
                dout_BSHD[:, blk.rows],
                q_BSHD[:, blk.rows],
                kv[0][:, blk.cols],
                kv[1][:, blk.cols],
                out_BSHD[:, blk.rows],
                row_lse[blk.rows.start],
                ctx.auxes[step],
                causal=blk.causal,
                scale=ctx.scale,
                cut=_block_cut(ctx.shard_docs, ctx.window, ring, source, blk, seq_local),
            )
            dq_BSHD[:, blk.rows] += dq

            # The accumulator of this K/V block arrives from the previous rank (which added its
            # share one step earlier); the diagonal step starts a fresh one.
            if dkv_pending is None:
                dkv_2BSKD = torch.zeros((2, *k_BSKD.shape), dtype=torch.float32, device=k_BSKD.device)
            else:
                dkv_pending.wait()
                dkv_2BSKD = next_dkv_2BSKD
            dkv_2BSKD[0][:, blk.cols] += dk
            dkv_2BSKD[1][:, blk.cols] += dv

            if kv_pending is not None:
                kv_pending.wait()
                kv = next_kv
            # After the last step the accumulator belongs to the next rank: this send brings it home.
            next_dkv_2BSKD = torch.empty_like(dkv_2BSKD)
            dkv_pending = ring.start([dkv_2BSKD], [next_dkv_2BSKD], tag=_DKV_TAG)

        assert dkv_pending is not None
        dkv_pending.wait()
        dk_BSKD, dv_BSKD = next_dkv_2BSKD[0].to(k_BSKD.dtype), next_dkv_2BSKD[1].to(v_BSKD.dtype)
        return dq_BSHD.to(q_BSHD.dtype), dk_BSKD, dv_BSKD, None, None, None, None, None, None


def ring_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    group: Optional[ProcessGroup],
    causal: bool = True,
    doc_ids: Optional[Union[Tensor, Documents]] = None,
    kernel: KernelArg = "auto",
    scale: Optional[float] = None,
    kv_exchange: str = "ring",
    window: Optional[int] = None,
) -> Tensor:
    """Attention over the ring's whole sequence from this rank's zigzag shards.

    ``q`` [B, S, H, D], ``k``/``v`` [B, S, K, D] and ``doc_ids`` [B, S] are this rank's shard
    (rank r of ``group`` holds zigzag chunks r and 2R-1-r); returns this rank's output shard
    [B, S, H, D] in q's dtype. A ``group`` of None or of one rank is plain local attention.
    ``kv_exchange``: K/V passed around the ring ("ring"), all gathered at once ("allgather",
    allgather.py), or by the block's length ("auto", ``kv_exchange_for``). ``window`` (tokens,
    causal only): a sliding window; where it leaves some ranks' K/V unseen by others, they go
    straight to the ranks that see them instead (neighbours.py).
    """
    check_qkv(q, k, v, doc_ids)
    check_window(window, causal)
    if group_size(group) == 1:
        return local_attention(q, k, v, causal=causal, doc_ids=doc_ids, kernel=kernel, scale=scale, window=window)
    if q.shape[1] % 2:
        raise ValueError(f"local sequence length {q.shape[1]} is odd; a zigzag shard is two equal chunks")
    assert group is not None
    docs, chosen = Documents.of(doc_ids), resolve_kernel(kernel, q)
    scale = default_scale(q.shape[-1]) if scale is None else scale
    k, v = k.contiguous(), v.contiguous()
    if window is not None and sparse(group_size(group), q.shape[1], window):
        return neighbour_attention(q, k, v, docs, group, chosen, scale, window)
    if kv_exchange_for(kv_exchange, q.shape[1]) == "allgather":
        return allgather_attention(q, k, v, docs, group, causal, chosen, scale, window)
    out: Tensor = _RingAttention.apply(q, k, v, docs, group, causal, chosen, scale, window)
    return out
