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

K/V travel unexpanded (K heads, not H): the kernel handles GQA. With packed documents the
doc ids of each K/V block travel with it in the forward, and are kept for the backward.

Shape legend: B batch, S local sequence (two zigzag chunks of S/2), H query heads, K key/value
heads, D head dim; ``kv_2BSKD`` is K and V stacked so they travel as one message.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from ringtrain.train.attention.blocks import block_backward, block_forward
from ringtrain.train.attention.comm import ProcessGroup, RingExchange, group_size
from ringtrain.train.attention.block_kernel import AttentionKernel, default_scale
from ringtrain.train.attention.kernels import KernelArg, resolve_kernel
from ringtrain.train.attention.local import check_qkv, local_attention
from ringtrain.train.attention.merge import merge_partials

Tensor = torch.Tensor

# One tag per stream of transfers (see RingExchange); a stream of n tensors uses tag..tag+n-1.
_KV_TAG = 0
_DKV_TAG = 8


@dataclass(frozen=True)
class Block:
    """Which local query rows attend to which columns of the visiting K/V, and how."""

    rows: slice
    cols: slice
    causal: bool


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


def _sub(x_BS: Optional[Tensor], index: slice) -> Optional[Tensor]:
    return None if x_BS is None else x_BS[:, index]


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        q_BSHD: Tensor,
        k_BSKD: Tensor,
        v_BSKD: Tensor,
        doc_BS: Optional[Tensor],
        group: ProcessGroup,
        causal: bool,
        kernel: AttentionKernel,
        scale: float,
    ) -> Tensor:
        ring = RingExchange(group)
        seq_local = q_BSHD.shape[1]
        kv_2BSKD = torch.stack((k_BSKD, v_BSKD))
        kv_doc_BS = None if doc_BS is None else doc_BS.contiguous()
        kv_docs: list[Tensor] = [] if kv_doc_BS is None else [kv_doc_BS]
        auxes: list[Any] = []
        out_BSHD = lse_BHS = torch.empty(0)

        for step in range(ring.world):
            pending = None
            if step + 1 < ring.world:
                next_kv_2BSKD = torch.empty_like(kv_2BSKD)
                send, recv = [kv_2BSKD], [next_kv_2BSKD]
                if kv_doc_BS is not None:
                    next_kv_doc_BS = torch.empty_like(kv_doc_BS)
                    send.append(kv_doc_BS)
                    recv.append(next_kv_doc_BS)
                pending = ring.start(send, recv, tag=_KV_TAG)

            blk = zigzag_block((ring.rank - step) % ring.world, ring.rank, seq_local, causal=causal)
            res = block_forward(
                kernel,
                q_BSHD[:, blk.rows],
                kv_2BSKD[0][:, blk.cols],
                kv_2BSKD[1][:, blk.cols],
                causal=blk.causal,
                scale=scale,
                q_doc_BQ=_sub(doc_BS, blk.rows),
                k_doc_BS=_sub(kv_doc_BS, blk.cols),
            )
            auxes.append(res.aux)
            if step == 0:  # the diagonal block covers every row
                out_BSHD, lse_BHS = res.out_BQHD.float(), res.lse_BHQ.clone()
            else:
                out_BSHD[:, blk.rows], lse_BHS[:, :, blk.rows] = merge_partials(
                    out_BSHD[:, blk.rows], lse_BHS[:, :, blk.rows], res.out_BQHD, res.lse_BHQ
                )

            if pending is not None:
                pending.wait()
                kv_2BSKD = next_kv_2BSKD
                if kv_doc_BS is not None:
                    kv_doc_BS = next_kv_doc_BS
                    kv_docs.append(kv_doc_BS)

        out_BSHD = out_BSHD.to(q_BSHD.dtype)
        ctx.save_for_backward(q_BSHD, k_BSKD, v_BSKD, out_BSHD, lse_BHS, *kv_docs)
        ctx.group, ctx.causal, ctx.kernel, ctx.scale, ctx.auxes = group, causal, kernel, scale, auxes
        return out_BSHD

    @staticmethod
    def backward(ctx: Any, dout_BSHD: Tensor) -> tuple[Optional[Tensor], ...]:  # type: ignore[override]
        q_BSHD, k_BSKD, v_BSKD, out_BSHD, lse_BHS, *kv_docs = ctx.saved_tensors
        ring = RingExchange(ctx.group)
        seq_local = q_BSHD.shape[1]
        doc_BS = kv_docs[0] if kv_docs else None
        kv_2BSKD = torch.stack((k_BSKD, v_BSKD))
        dq_BSHD = torch.zeros(q_BSHD.shape, dtype=torch.float32, device=q_BSHD.device)
        dkv_2BSKD = next_dkv_2BSKD = torch.empty(0)
        dkv_pending = None

        for step in range(ring.world):
            kv_pending = None
            if step + 1 < ring.world:
                next_kv_2BSKD = torch.empty_like(kv_2BSKD)
                kv_pending = ring.start([kv_2BSKD], [next_kv_2BSKD], tag=_KV_TAG)

            blk = zigzag_block((ring.rank - step) % ring.world, ring.rank, seq_local, causal=ctx.causal)
            dq, dk, dv = block_backward(
                ctx.kernel,
                dout_BSHD[:, blk.rows],
                q_BSHD[:, blk.rows],
                kv_2BSKD[0][:, blk.cols],
                kv_2BSKD[1][:, blk.cols],
                out_BSHD[:, blk.rows],
                lse_BHS[:, :, blk.rows],
                ctx.auxes[step],
                causal=blk.causal,
                scale=ctx.scale,
                q_doc_BQ=_sub(doc_BS, blk.rows),
                k_doc_BS=_sub(kv_docs[step] if kv_docs else None, blk.cols),
            )
            dq_BSHD[:, blk.rows] += dq

            # The accumulator of this K/V block arrives from the previous rank (which added its
            # share one step earlier); the diagonal step starts a fresh one.
            if dkv_pending is None:
                dkv_2BSKD = torch.zeros(kv_2BSKD.shape, dtype=torch.float32, device=kv_2BSKD.device)
            else:
                dkv_pending.wait()
                dkv_2BSKD = next_dkv_2BSKD
            dkv_2BSKD[0][:, blk.cols] += dk
            dkv_2BSKD[1][:, blk.cols] += dv

            if kv_pending is not None:
                kv_pending.wait()
                kv_2BSKD = next_kv_2BSKD
            # After the last step the accumulator belongs to the next rank: this send brings it home.
            next_dkv_2BSKD = torch.empty_like(dkv_2BSKD)
            dkv_pending = ring.start([dkv_2BSKD], [next_dkv_2BSKD], tag=_DKV_TAG)

        assert dkv_pending is not None
        dkv_pending.wait()
        dk_BSKD, dv_BSKD = next_dkv_2BSKD[0].to(k_BSKD.dtype), next_dkv_2BSKD[1].to(v_BSKD.dtype)
        return dq_BSHD.to(q_BSHD.dtype), dk_BSKD, dv_BSKD, None, None, None, None, None


def ring_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    group: Optional[ProcessGroup],
    causal: bool = True,
    doc_ids: Optional[Tensor] = None,
    kernel: KernelArg = "auto",
    scale: Optional[float] = None,
) -> Tensor:
    """Attention over the ring's whole sequence from this rank's zigzag shards.

    ``q`` [B, S, H, D], ``k``/``v`` [B, S, K, D] and ``doc_ids`` [B, S] are this rank's shard
    (rank r of ``group`` holds zigzag chunks r and 2R-1-r); returns this rank's output shard
    [B, S, H, D] in q's dtype. A ``group`` of None or of one rank is plain local attention.
    """
    check_qkv(q, k, v, doc_ids)
    if group_size(group) == 1:
        return local_attention(q, k, v, causal=causal, doc_ids=doc_ids, kernel=kernel, scale=scale)
    if q.shape[1] % 2:
        raise ValueError(f"local sequence length {q.shape[1]} is odd; a zigzag shard is two equal chunks")
    return _RingAttention.apply(
        q,
        k.contiguous(),
        v.contiguous(),
        doc_ids,
        group,
        causal,
        resolve_kernel(kernel, q),
        default_scale(q.shape[-1]) if scale is None else scale,
    )
