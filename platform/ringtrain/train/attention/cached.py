"""Attention over a KV cache sharded over a CP group: the prefill that fills each rank's shard,
and each new token's attention against every shard, merged by log-sum-exp.

The prefill is the layout's own forward (``ContextParallelAttention``), each layer handing its
shard (``kv_cache.LayerShard``) the K/V it attended. A new token's query reaches every rank (each
computes the token's hidden state); each rank attends its shard, for its heads under Ulysses, and
the partial outputs of the ring's ranks merge through their log-sum-exps (``merge.merge_partials``,
the ring's own merge) after one all-gather of the small partials; under Ulysses the heads then
gather over the Ulysses group. The new token's K/V go to one ring index first
(``kv_cache.append_ring_index``), for this rank's heads.

Heads under Ulysses are the prefill's (``ulysses.head_routes``): rank u attends query heads
``u h .. (u + 1) h`` (zero heads past the last, where the heads were padded) with the key/value
heads the all-to-all gave it, copies included, so the output's heads gather in rank order.

Shape legend: B batch, H query heads, K key/value heads, h / g this rank's query / key/value
heads, T slots a rank holds, D head dim, R ring ranks, U Ulysses ranks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

import torch

from ringtrain.topology import CPLayout
from ringtrain.train.attention.block_kernel import default_scale, to_seq_major
from ringtrain.train.attention.documents import DocIds
from ringtrain.train.attention.implementations import ContextParallelAttention
from ringtrain.train.attention.kv_cache import KVCache, append_ring_index
from ringtrain.train.attention.math_kernel import MathKernel
from ringtrain.train.attention.merge import merge_partials
from ringtrain.train.attention.transport import Transport
from ringtrain.train.attention.ulysses import head_routes

Tensor = torch.Tensor
# The model's attention function's signature (``model.AttentionFn``), as each layer calls it.
LayerAttention = Callable[..., Tensor]
# A new token's attention to a shard: the reference kernel takes the shard's mask and GQA as they
# are, and computes the small block exactly.
_EXACT = MathKernel()


@dataclass(frozen=True)
class RankHeads:
    """The heads one rank attends: source indices into the query heads and into the key/value
    heads, where an index past the last (H, or K) is a zero head."""

    query: tuple[int, ...]
    kv: tuple[int, ...]


def rank_heads(heads: int, kv_heads: int, ulysses: int, ulysses_idx: int) -> RankHeads:
    """The heads Ulysses rank ``ulysses_idx`` of ``ulysses`` attends, as the prefill's all-to-all
    routed them (on a group of one rank, every head); pure."""
    routes = head_routes(heads, kv_heads, ulysses)
    n = routes.h + 2 * routes.g
    mine = routes.route[ulysses_idx * n : (ulysses_idx + 1) * n]
    zero = heads + 2 * kv_heads  # the source index of the zero head
    query = tuple(i if i < heads else heads for i in mine[: routes.h])
    kv = tuple(i - heads if i != zero else kv_heads for i in mine[routes.h : routes.h + routes.g])
    return RankHeads(query, kv)


def _heads(x_B1ND: Tensor, index: Tensor, whole: bool) -> Tensor:
    """The heads ``index`` of ``x``, an index past the last a head of zeros."""
    if whole:
        return x_B1ND
    padded = torch.cat([x_B1ND, x_B1ND.new_zeros(*x_B1ND.shape[:2], 1, x_B1ND.shape[3])], dim=2)
    return padded.index_select(2, index)


def shard_attention(q_B1hD: Tensor, k_BgTD: Tensor, v_BgTD: Tensor, valid_BT: Tensor,
                    scale: float) -> tuple[Tensor, Tensor]:
    """One query token against one rank's held keys, by the math kernel in fp32: ``(out [B, 1,
    h, D], lse [B, h, 1])``; query head j reads key/value head j // (h / g). A row that sees no
    key has out 0 and lse -inf, as the merge expects (the kernel's rule)."""
    k_BTgD, v_BTgD = to_seq_major(k_BgTD.float(), v_BgTD.float())
    out_B1hD, lse_Bh1, _ = _EXACT.forward(q_B1hD.float(), k_BTgD, v_BTgD, causal=False, scale=scale,
                                          visible_BQS=valid_BT[:, None, :])
    return out_B1hD, lse_Bh1


def merge_ring(out_B1hD: Tensor, lse_Bh1: Tensor, ring: Optional[Transport]) -> Tensor:
    """Every ring rank's partial ``(out, lse)`` merged through their log-sum-exps, in ring order
    (so every rank computes the same sum): one all-gather of the partials packed together.
    ``ring`` None: no ring, the partial is the whole."""
    if ring is None:
        return out_B1hD
    B, _, h, D = out_B1hD.shape
    packed = torch.cat([out_B1hD.reshape(B, h * D), lse_Bh1.reshape(B, h)], dim=1)
    every = ring.all_gather(packed.contiguous())
    out, lse = every[0, :, : h * D].view(B, 1, h, D), every[0, :, h * D :].view(B, h, 1)
    for part in every[1:]:
        out, lse = merge_partials(out, lse, part[:, : h * D].view(B, 1, h, D), part[:, h * D :].view(B, h, 1))
    return out


def gather_heads(out_B1hD: Tensor, heads: int, ulysses: Optional[Transport]) -> Tensor:
    """Every Ulysses rank's heads of the output, in rank order, the padding heads cut off;
    ``ulysses`` None: no heads to gather."""
    if ulysses is None:
        return out_B1hD
    every = ulysses.all_gather(out_B1hD.contiguous())  # [U, B, 1, h, D]
    U, B, _, h, D = every.shape
    return every.permute(1, 2, 0, 3, 4).reshape(B, 1, U * h, D)[:, :, :heads]


class CachedAttention:
    """One rank's attention for cached decoding with ``attention`` (the layout's, on this rank's
    groups): ``prefill(layer)`` and ``decode(layer)`` are the attention functions layer ``layer``
    runs while the prompt fills the cache and while each new token reads it."""

    def __init__(self, attention: ContextParallelAttention, heads: int, kv_heads: int) -> None:
        self.attention = attention
        self.layout: CPLayout = attention.layout
        # Only the groups the layout crosses: a group of one rank has nothing to merge or gather.
        self.ring = attention.ring_group if self.layout.has_ring else None
        self.ulysses = attention.ulysses_group if self.layout.splits_heads else None
        self.ring_idx = 0 if self.ring is None else self.ring.rank()
        self.ulysses_idx = 0 if self.ulysses is None else self.ulysses.rank()
        self.heads = heads
        mine = rank_heads(heads, kv_heads, self.layout.ulysses, self.ulysses_idx)
        self._all_heads = mine == RankHeads(tuple(range(heads)), tuple(range(kv_heads)))
        self._query_index = torch.tensor(mine.query)
        self._kv_index = torch.tensor(mine.kv)
        self.cache: Optional[KVCache] = None
        self._fill: Optional[tuple[Tensor, int, Tensor, int]] = None
        self._slot = 0
        self._appends = False

    def start(self, cache: KVCache, slots_S: Tensor, seq_len: int, first_real_B: Tensor, num_appended: int) -> None:
        """A new batch: its prompts take ``seq_len`` slots, this rank's shard holds ``slots_S``."""
        self.cache = cache
        self._fill = (slots_S, seq_len, first_real_B, num_appended)

    def step(self, token: int, slot: int) -> None:
        """The next decode step: new token ``token`` (0 the first fed back) at slot ``slot``."""
        self._slot = slot
        self._appends = self.ring_idx == append_ring_index(token, self.layout.ring)

    def prefill(self, layer: int) -> LayerAttention:
        """Layer ``layer``'s attention over the prompt, keeping what this rank attended."""
        assert self.cache is not None and self._fill is not None
        shard, (slots_S, seq_len, first_real_B, num_appended) = self.cache.layers[layer], self._fill

        def keep(k_BSKD: Tensor, v_BSKD: Tensor) -> None:
            shard.fill(k_BSKD, v_BSKD, slots_S.to(k_BSKD.device), seq_len, first_real_B.to(k_BSKD.device),
                       num_appended)

        def attend(q: Tensor, k: Tensor, v: Tensor, **options: Any) -> Tensor:
            return self.attention(q, k, v, keep=keep, **options)

        return attend

    def decode(self, layer: int) -> LayerAttention:
        """Layer ``layer``'s attention of the new token over every rank's shard."""
        assert self.cache is not None
        shard = self.cache.layers[layer]

        def attend(q_B1HD: Tensor, k_B1KD: Tensor, v_B1KD: Tensor, *, causal: bool = True, doc_ids: DocIds = None,
                   window: Optional[int] = None, scale: Optional[float] = None) -> Tensor:
            q_B1hD = _heads(q_B1HD, self._query_index.to(q_B1HD.device), self._all_heads)
            shard.expire(self._slot)
            if self._appends:
                kv_index = self._kv_index.to(k_B1KD.device)
                shard.append(_heads(k_B1KD, kv_index, self._all_heads), _heads(v_B1KD, kv_index, self._all_heads),
                             self._slot)
            k, v, _, valid = shard.view()
            out, lse = shard_attention(q_B1hD, k, v, valid, default_scale(q_B1HD.shape[-1]) if scale is None else scale)
            merged = merge_ring(out, lse, self.ring)
            return gather_heads(merged, self.heads, self.ulysses).to(q_B1HD.dtype)

        return attend
