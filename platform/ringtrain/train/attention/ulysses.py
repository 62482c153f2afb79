"""Ulysses attention: all-to-all from sequence shards to head shards, attend, all-to-all back.

DeepSpeed-Ulysses (Jacobs et al. 2023): each of the U ranks holds a contiguous 1/U of the
sequence for all heads; one all-to-all gives every rank the whole sequence for 1/U of the heads,
attention runs there unchanged, and the inverse all-to-all returns the output to sequence
shards. q, k and v travel in a single packed all-to-all, so a forward issues two all-to-alls
(q/k/v in, output back) and a backward two more (output grad in, q/k/v grads back).

``all_to_all_attention`` wraps any attention over the gathered sequence: local attention for
pure Ulysses, ring attention across ring groups for the hybrid.

Heads: query heads are split evenly; when the KV heads do not split evenly (fewer than U, as
in MQA, or not a multiple of U) each KV head is replicated just enough that every rank holds
whole KV heads for its query heads. When the query heads themselves do not split into U, the
heads are padded with zero heads (KV expanded to one per query head first so the padding pairs
up) and the padding is cut off the output.

Shape legend: B batch, s local sequence (S = U*s gathered), H query heads, K key/value heads,
D head dim, U ranks in the Ulysses group, h heads per rank after the all-to-all.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Protocol, Union

import torch

from ringtrain.train.attention import comm
from ringtrain.train.attention.comm import ProcessGroup, group_size
from ringtrain.train.attention.documents import Documents
from ringtrain.train.attention.block_kernel import default_scale
from ringtrain.train.attention.kernels import KernelArg
from ringtrain.train.attention.local import check_qkv, local_attention

Tensor = torch.Tensor


class SequenceAttention(Protocol):
    """Attention over a sequence that is complete (or ring-sharded) on this rank."""

    def __call__(
        self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool, doc_ids: Optional[Union[Tensor, Documents]], scale: float
    ) -> Tensor: ...


def _seq_to_heads(x_BsUhD: Tensor, group: ProcessGroup) -> Tensor:
    """[B, s, U, h, D] (head group u bound for rank u) -> [B, U*s, h, D] (rank u's s tokens at u*s)."""
    B, s, U, h, D = x_BsUhD.shape
    send_UBshD = x_BsUhD.permute(2, 0, 1, 3, 4).contiguous()
    recv_UBshD = torch.empty_like(send_UBshD)
    comm.all_to_all(recv_UBshD, send_UBshD, group)
    return recv_UBshD.permute(1, 0, 2, 3, 4).reshape(B, U * s, h, D)


def _heads_to_seq(x_BShD: Tensor, group: ProcessGroup) -> Tensor:
    """[B, U*s, h, D] -> [B, s, U, h, D] (the head group of rank u at index u): inverse of the above."""
    B, S, h, D = x_BShD.shape
    U = group_size(group)
    send_UBshD = x_BShD.reshape(B, U, S // U, h, D).transpose(0, 1).contiguous()
    recv_UBshD = torch.empty_like(send_UBshD)
    comm.all_to_all(recv_UBshD, send_UBshD, group)
    return recv_UBshD.permute(1, 2, 0, 3, 4)


class _SeqToHeads(torch.autograd.Function):
    """Sequence shards of several tensors -> head shards of the full sequence, in one all-to-all."""

    @staticmethod
    def forward(ctx: Any, group: ProcessGroup, *xs_BsHD: Tensor) -> tuple[Tensor, ...]:  # type: ignore[override]
        U = group_size(group)
        ctx.group = group
        ctx.heads = [x.shape[2] // U for x in xs_BsHD]
        packed_BsUhD = torch.cat([x.unflatten(2, (U, -1)) for x in xs_BsHD], dim=3)
        return _seq_to_heads(packed_BsUhD, group).split(ctx.heads, dim=2)

    @staticmethod
    def backward(ctx: Any, *grads_BShD: Tensor) -> tuple[Optional[Tensor], ...]:  # type: ignore[override]
        packed_BsUhD = _heads_to_seq(torch.cat(grads_BShD, dim=2), ctx.group)
        return (None, *(g.flatten(2, 3) for g in packed_BsUhD.split(ctx.heads, dim=3)))


class _HeadsToSeq(torch.autograd.Function):
    """Head shards of the full sequence -> sequence shards with all heads."""

    @staticmethod
    def forward(ctx: Any, group: ProcessGroup, x_BShD: Tensor) -> Tensor:  # type: ignore[override]
        ctx.group = group
        return _heads_to_seq(x_BShD, group).flatten(2, 3)

    @staticmethod
    def backward(ctx: Any, grad_BsHD: Tensor) -> tuple[Optional[Tensor], ...]:  # type: ignore[override]
        U = group_size(ctx.group)
        return None, _seq_to_heads(grad_BsHD.unflatten(2, (U, -1)), ctx.group)


def spread_heads(q_BsHD: Tensor, k_BsKD: Tensor, v_BsKD: Tensor, degree: int) -> tuple[Tensor, Tensor, Tensor]:
    """q, k, v with head counts that split into ``degree`` ranks, GQA pairing kept (see module doc)."""
    H, K = q_BsHD.shape[2], k_BsKD.shape[2]
    if H % K:
        raise ValueError(f"{H} query heads are not a multiple of {K} key/value heads")
    if H % degree == 0:
        # The fewest copies f with K*f divisible by the degree; H is divisible by lcm(K, degree) = K*f,
        # so query head i still reads (copy of) KV head i // (H // K).
        copies = degree // math.gcd(K, degree)
        if copies > 1:
            k_BsKD, v_BsKD = k_BsKD.repeat_interleave(copies, dim=2), v_BsKD.repeat_interleave(copies, dim=2)
        return q_BsHD, k_BsKD, v_BsKD
    groups = H // K
    k_BsHD, v_BsHD = k_BsKD.repeat_interleave(groups, dim=2), v_BsKD.repeat_interleave(groups, dim=2)
    pad = (0, 0, 0, -H % degree)  # zero heads appended on dim 2
    return (
        torch.nn.functional.pad(q_BsHD, pad),
        torch.nn.functional.pad(k_BsHD, pad),
        torch.nn.functional.pad(v_BsHD, pad),
    )


def all_to_all_attention(
    attend: SequenceAttention,
    q_BsHD: Tensor,
    k_BsKD: Tensor,
    v_BsKD: Tensor,
    *,
    group: ProcessGroup,
    causal: bool,
    doc_ids: Optional[Union[Tensor, Documents]],
    scale: Optional[float],
) -> Tensor:
    """Run ``attend`` on the sequence gathered over ``group`` for a share of the heads."""
    heads = q_BsHD.shape[2]
    scale = default_scale(q_BsHD.shape[-1]) if scale is None else scale
    q_BsHD, k_BsKD, v_BsKD = spread_heads(q_BsHD, k_BsKD, v_BsKD, group_size(group))
    q_BShD, k_BSkD, v_BSkD = _SeqToHeads.apply(group, q_BsHD, k_BsKD, v_BsKD)
    docs = Documents.of(doc_ids)
    gathered = None if docs is None else docs.concatenated(group)
    out_BShD = attend(q_BShD, k_BSkD, v_BSkD, causal=causal, doc_ids=gathered, scale=scale)
    out_BsHD = _HeadsToSeq.apply(group, out_BShD)
    return out_BsHD[:, :, :heads] if out_BsHD.shape[2] != heads else out_BsHD


def ulysses_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    group: Optional[ProcessGroup],
    causal: bool = True,
    doc_ids: Optional[Union[Tensor, Documents]] = None,
    kernel: KernelArg = "auto",
    scale: Optional[float] = None,
    window: Optional[int] = None,
) -> Tensor:
    """Attention over the group's whole sequence from this rank's contiguous part.

    ``q`` [B, s, H, D], ``k``/``v`` [B, s, K, D] and ``doc_ids`` [B, s] hold part u (of U equal
    contiguous parts) of the sequence on group rank u; returns this rank's output part
    [B, s, H, D]. A ``group`` of None or of one rank is plain local attention. ``window``: a
    causal sliding window of that many tokens, over the gathered sequence.
    """
    check_qkv(q, k, v, doc_ids)
    if group_size(group) == 1:
        return local_attention(q, k, v, causal=causal, doc_ids=doc_ids, kernel=kernel, scale=scale, window=window)

    def attend(
        q: Tensor, k: Tensor, v: Tensor, *, causal: bool, doc_ids: Optional[Union[Tensor, Documents]], scale: float
    ) -> Tensor:
        return local_attention(q, k, v, causal=causal, doc_ids=doc_ids, kernel=kernel, scale=scale, window=window)

    assert group is not None
    return all_to_all_attention(attend, q, k, v, group=group, causal=causal, doc_ids=doc_ids, scale=scale)
