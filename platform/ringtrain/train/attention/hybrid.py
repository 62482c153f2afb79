"""Hybrid context parallelism: Ulysses inside (all-to-all over consecutive ranks), ring across.

A CP group of R x U ranks: CP rank c = ring_idx * U + ulysses_idx. The sequence is zigzag-
sharded over the R ring indices, and each ring shard is split contiguously over the U ranks of
its Ulysses group. The Ulysses all-to-all therefore reassembles a whole ring shard (a zigzag
pair of chunks) for 1/U of the heads, and zigzag ring attention runs over it across the ring
group; the inverse all-to-all returns the output to the local layout.

Shape legend: B batch, s local sequence, H query heads, K key/value heads, D head dim.
"""

from __future__ import annotations

from typing import Optional

import torch

from ringtrain.train.attention.block_kernel import default_scale
from ringtrain.train.attention.call import AttentionCall, check_qkv, check_window
from ringtrain.train.attention.documents import DocIds, Documents
from ringtrain.train.attention.kernels import KernelArg, resolve_kernel
from ringtrain.train.attention.transport import GroupArg, as_transport
from ringtrain.train.attention.ulysses import KeepKV, all_to_all_attention

Tensor = torch.Tensor


def hybrid_attention(q: Tensor, k: Tensor, v: Tensor, *, ring_group: GroupArg, ulysses_group: GroupArg,
                     causal: bool = True, doc_ids: DocIds = None, kernel: KernelArg = "auto",
                     scale: Optional[float] = None, kv_exchange: str = "ring", window: Optional[int] = None,
                     keep: Optional[KeepKV] = None) -> Tensor:
    """Attention over the CP group's sequence from this rank's part ([B, s, ...] in, [B, s, H, D] out).

    ``ring_group``: the R ranks with this rank's Ulysses index (group rank = ring index).
    ``ulysses_group``: the U ranks with this rank's ring index (group rank = Ulysses index).
    Both span more than one rank: a layout with a group of one runs the ring or Ulysses alone
    (``topology.CPLayout.runs``). ``kv_exchange``: how the ring group exchanges K/V
    (``attend.ring_attention``); ``window``: a causal sliding window of that many tokens;
    ``keep``: handed this rank's K/V after the all-to-all (its heads of the ring shard).
    """
    check_qkv(q, k, v, doc_ids)
    check_window(window, causal)
    ring, ulysses = as_transport(ring_group), as_transport(ulysses_group)
    assert ring is not None and ulysses is not None
    chosen = resolve_kernel(kernel, q)
    scale = default_scale(q.shape[-1]) if scale is None else scale

    def inner(seq: int, docs: Optional[Documents]) -> AttentionCall:
        if seq % 2:
            raise ValueError(f"a ring shard of {seq} tokens is odd; a zigzag shard is two equal chunks")
        return AttentionCall.of(ring, seq, causal=causal, docs=docs, window=window, scale=scale, kernel=chosen,
                                kv_exchange=kv_exchange)

    return all_to_all_attention(inner, q, k, v, group=ulysses, kernel=chosen, doc_ids=doc_ids, keep=keep)
