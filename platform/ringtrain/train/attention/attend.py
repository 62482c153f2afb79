"""Attention over a group's whole sequence from this rank's shard: the functions a model calls.

``local_attention`` (one rank) and ``ring_attention`` (a zigzag ring) check their inputs, make
the call a value (``call.AttentionCall``, its K/V exchange chosen there) and run it through the
one loop (``loop``). Ulysses and the hybrid wrap these around their all-to-alls (``ulysses``,
``hybrid``).

Shape legend: B batch, S local sequence, H query heads, K key/value heads, D head dim.
"""

from __future__ import annotations

from typing import Optional

import torch

from ringtrain.train.attention.block_kernel import default_scale
from ringtrain.train.attention.call import AttentionCall, check_qkv, check_window
from ringtrain.train.attention.documents import DocIds, Documents
from ringtrain.train.attention.kernels import KernelArg, resolve_kernel
from ringtrain.train.attention.loop import attend
from ringtrain.train.attention.transport import GroupArg, as_transport

Tensor = torch.Tensor


def local_attention(q_BSHD: Tensor, k_BSKD: Tensor, v_BSKD: Tensor, *, causal: bool = True, doc_ids: DocIds = None,
                    kernel: KernelArg = "auto", scale: Optional[float] = None, window: Optional[int] = None) -> Tensor:
    """Attention over this rank's whole sequence; ``doc_ids`` [B, S] (ids, or ``Documents``)
    confines it to documents, ``window`` (tokens, causal only) to a sliding window."""
    check_qkv(q_BSHD, k_BSKD, v_BSKD, doc_ids)
    check_window(window, causal)
    call = AttentionCall.of(
        None, q_BSHD.shape[1], causal=causal, docs=Documents.of(doc_ids), window=window,
        scale=default_scale(q_BSHD.shape[-1]) if scale is None else scale, kernel=resolve_kernel(kernel, q_BSHD),
        kv_exchange="auto",
    )
    return attend(call, q_BSHD, k_BSKD, v_BSKD)


def ring_attention(q: Tensor, k: Tensor, v: Tensor, *, group: GroupArg, causal: bool = True, doc_ids: DocIds = None,
                   kernel: KernelArg = "auto", scale: Optional[float] = None, kv_exchange: str = "ring",
                   window: Optional[int] = None) -> Tensor:
    """Attention over the ring's whole sequence from this rank's zigzag shards.

    ``q`` [B, S, H, D], ``k``/``v`` [B, S, K, D] and ``doc_ids`` [B, S] are this rank's shard
    (rank r of ``group`` holds zigzag chunks r and 2R-1-r); returns this rank's output shard
    [B, S, H, D] in q's dtype. ``group``: a process group or a ``Transport`` (a layout without a
    ring runs ``local_attention``: ``topology.CPLayout.runs``). ``kv_exchange``: K/V passed around
    the ring ("ring"), all gathered at once ("allgather"), or by the ring's size and the block's
    length ("auto"; ``call.choose_exchange``). ``window`` (tokens, causal only): a sliding window; where it leaves
    some ranks' K/V unseen by others, they go straight to the ranks that see them instead
    (``exchanges.neighbours``).
    """
    check_qkv(q, k, v, doc_ids)
    check_window(window, causal)
    if q.shape[1] % 2:
        raise ValueError(f"local sequence length {q.shape[1]} is odd; a zigzag shard is two equal chunks")
    call = AttentionCall.of(
        as_transport(group), q.shape[1], causal=causal, docs=Documents.of(doc_ids), window=window,
        scale=default_scale(q.shape[-1]) if scale is None else scale, kernel=resolve_kernel(kernel, q),
        kv_exchange=kv_exchange,
    )
    return attend(call, q, k, v)
