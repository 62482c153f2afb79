"""One context-parallel attention call as a value, and the pure choice of how its K/V travel.

An ``AttentionCall`` holds what a call is besides its tensors: this rank's place in its ring
(the ring's transport, rank, size and the local sequence length), the documents, the window, the
scale, the block kernel, and the K/V exchange ``choose_exchange`` picked. Its plan is kept under
``plan_key``, made of its fields (each field says how it enters the key, or that it does not).
The loop (``loop``) runs any call; the exchange (``exchanges``) is the only part that differs
between layouts.

Shape legend: B batch, S local sequence, H query heads, K key/value heads, D head dim.
"""

from __future__ import annotations

import functools
import operator
from dataclasses import dataclass, field, fields
from typing import Any, Optional

import numpy as np
import torch

from ringtrain.config import KV_EXCHANGES
from ringtrain.train.attention.block_kernel import AttentionKernel
from ringtrain.train.attention.documents import DocIds, Documents
from ringtrain.train.attention.transport import Transport
from ringtrain.train.attention.window import family_sources, needs, shard_positions, sparse

Tensor = torch.Tensor

# Where "auto" gathers K/V: on rings of at least ALLGATHER_FROM_RANKS ranks, below
# ALLGATHER_BELOW_TOKENS tokens a rank. From bench/attention.py's worst rank, forward and backward
# together, on an H200 and an H100 (bf16, head dim 128, 32 query / 8 KV heads; the speed of
# gathered K/V over the ring's):
# - A ring of two passes K/V once, and that one transfer hides behind the diagonal block; gathered,
#   the rank waits for it, and for the reduce-scatter after the backward. The ring was as fast or
#   faster at every length: 0.87x and 0.92x (H200, H100) at 8K tokens a rank, 0.92x and 0.98x at
#   16K, 0.97-1.00x beyond.
# - From four ranks a ring's R - 1 steps each cost a launch, a merge and a round trip whatever the
#   block's length, and below 16K tokens a rank gathering won: 1.01x and 1.05x at 8K on four ranks,
#   1.02-1.27x at 2K-8K on eight (four ranks at 4K were the exception: 0.89x on the H200, 0.99x on
#   the H100).
# - From 16K tokens a rank gathering gained 6% at most (1.00-1.06x on four and eight ranks), and
#   the ring holds two visitors' K/V where gathering holds the whole ring's, and their gradients
#   in fp32.
ALLGATHER_FROM_RANKS = 4
ALLGATHER_BELOW_TOKENS = 16384


def choose_exchange(name: str, world: int, seq_local: int, window: Optional[int]) -> str:
    """How a ring of ``world`` ranks with ``seq_local`` tokens each exchanges K/V when
    ``attention.kv_exchange`` is ``name``; pure.

    One rank: "local". A window that leaves some ranks' K/V unseen by others: "neighbours" (each
    rank's K/V straight to the ranks that see them). Otherwise ``name``, where "auto" is
    "allgather" on rings of ``ALLGATHER_FROM_RANKS`` ranks or more below ``ALLGATHER_BELOW_TOKENS``
    tokens a rank (the ring's per-step costs dominate there) and "ring" otherwise.
    """
    if name != "auto" and name not in KV_EXCHANGES:
        raise ValueError(f"kv_exchange {name!r} is not one of auto, {', '.join(KV_EXCHANGES)}")
    if world == 1:
        return "local"
    if window is not None and sparse(world, seq_local, window):
        return "neighbours"
    if name == "auto":
        gather = world >= ALLGATHER_FROM_RANKS and seq_local < ALLGATHER_BELOW_TOKENS
        return "allgather" if gather else "ring"
    return name


@dataclass(frozen=True)
class Side:
    """The rows or the columns of a visit, on the host: their sequence positions and, with packed
    documents, their document ids ``[B, n]``; with documents in families under a window, how far
    each token's position id falls behind its sequence position (``documents.position_lags``)."""

    positions: np.ndarray
    docs_BS: Optional[np.ndarray]
    lags_BS: Optional[np.ndarray] = None


# How a field of ``AttentionCall`` enters the key its plan is kept under (``plan_key``): by its
# value unless its metadata names the attributes of it the plan reads (none: the plan does not
# depend on it). So a field added to the call is part of the key until it says otherwise.
PLAN_KEY = "plan_key"


def _planned_by(*attributes: str) -> Any:
    """A field that enters the plan's key as these attributes of its value (none: not at all)."""
    return field(metadata={PLAN_KEY: attributes})


@dataclass(frozen=True, eq=False)
class AttentionCall:
    """One rank's attention call over its ring's whole sequence, besides its tensors."""

    # The ring's; None for a single rank. Its rank and size are the plan's, as ``rank`` and ``world``.
    transport: Optional[Transport] = _planned_by()
    rank: int
    world: int
    seq_local: int
    causal: bool
    # A plan documents cut is kept with them (``Documents.cached``), under the rest of the key.
    docs: Optional[Documents] = _planned_by()
    window: Optional[int]
    scale: float
    # What the plan asks of the kernel: whether it takes a mask, and where it aligns a causal block.
    kernel: AttentionKernel = _planned_by("supports_mask", "aligns_causal_bottom_right")
    exchange: str  # as ``choose_exchange`` says

    @classmethod
    def of(
        cls,
        transport: Optional[Transport],
        seq_local: int,
        *,
        causal: bool,
        docs: Optional[Documents],
        window: Optional[int],
        scale: float,
        kernel: AttentionKernel,
        kv_exchange: str,
    ) -> AttentionCall:
        world = 1 if transport is None else transport.size()
        rank = 0 if transport is None else transport.rank()
        exchange = choose_exchange(kv_exchange, world, seq_local, window)
        return cls(transport, rank, world, seq_local, causal, docs, window, scale, kernel, exchange)

    def plan_key(self) -> tuple[object, ...]:
        """What the call's plan depends on: its fields, each as ``PLAN_KEY`` says (one getter)."""
        key: tuple[object, ...] = _plan_key(self)
        return key

    @property
    def one_block(self) -> bool:
        """Whether the call is one block no one cuts: this rank's own K/V (one rank; Ulysses'
        gathered sequence), no documents, no window. The loop runs it as one kernel call."""
        return self.exchange == "local" and self.docs is None and self.window is None

    def shard_side(self, source: int) -> Side:
        """Ring rank ``source``'s shard: its positions and documents."""
        docs = None
        if self.docs is not None:
            docs = self.docs.host_BS if self.transport is None else self.docs.shards(self.transport)[source].host_BS
        positions = (_whole_positions(self.seq_local) if self.world == 1
                     else shard_positions(self.world, source, self.seq_local))
        lags = self._lags()
        return Side(positions, docs, None if lags is None else lags[:, positions])

    def whole_side(self) -> Side:
        """The ring's whole sequence in order."""
        docs = None
        if self.docs is not None:
            assert self.transport is not None
            docs = self.docs.whole_sequence(self.transport).host_BS
        return Side(_whole_positions(self.world * self.seq_local), docs, self._lags())

    def window_sources(self) -> tuple[tuple[int, ...], ...]:
        """For each ring rank, the ranks whose K/V its queries see through the window, itself
        included: the layout's (``window.needs``), and with documents in families the ranks
        holding the parents' keys that their children see (``window.family_sources``: every
        rank finds the same, from the ring's gathered documents)."""
        window = self.window
        assert window is not None
        if self.docs is None or not self.docs.family:
            return needs(self.world, self.seq_local, window)
        assert self.transport is not None
        whole, family = self.docs.whole_sequence(self.transport).host_BS, self.docs.family
        found: tuple[tuple[int, ...], ...] = self.docs.cached(
            ("sources", self.world, self.seq_local, window),
            lambda: family_sources(self.world, self.seq_local, window, whole, family))
        return found

    def _lags(self) -> Optional[np.ndarray]:
        """``documents.position_lags`` of the ring's whole sequence where a window measures by
        them (documents in families), else None."""
        if self.window is None or self.docs is None or not self.docs.family:
            return None
        return self.docs.position_lags(self.transport)


# The attribute paths of the plan's key: each field itself, or the attributes of it it names.
PLAN_KEY_PATHS = tuple(
    path
    for f in fields(AttentionCall)
    for path in ((f.name,) if PLAN_KEY not in f.metadata else (f"{f.name}.{a}" for a in f.metadata[PLAN_KEY]))
)
_plan_key = operator.attrgetter(*PLAN_KEY_PATHS)


@functools.lru_cache(maxsize=64)
def _whole_positions(length: int) -> np.ndarray:
    positions = np.arange(length)
    positions.setflags(write=False)
    return positions


def check_window(window: Optional[int], causal: bool) -> None:
    """Raise ValueError unless ``window`` is None or a positive token count of causal attention."""
    if window is None:
        return
    if window < 1:
        raise ValueError(f"a sliding window must hold at least one token, got {window}")
    if not causal:
        raise ValueError("a sliding window is causal: it needs causal=True")


def check_qkv(q_BSHD: Tensor, k_BSKD: Tensor, v_BSKD: Tensor, doc_ids: DocIds) -> None:
    """Raise ValueError unless q, k, v (and doc ids) have consistent [B, S, heads, D] shapes."""
    if q_BSHD.dim() != 4 or k_BSKD.dim() != 4 or k_BSKD.shape != v_BSKD.shape:
        shapes = ", ".join(str(tuple(t.shape)) for t in (q_BSHD, k_BSKD, v_BSKD))
        raise ValueError(f"want q [B, S, H, D] and k, v [B, S, K, D]; got {shapes}")
    B, S, H, D = q_BSHD.shape
    if k_BSKD.shape[:2] != (B, S) or k_BSKD.shape[3] != D:
        raise ValueError(
            f"q {tuple(q_BSHD.shape)} and k {tuple(k_BSKD.shape)} disagree on batch, sequence or head dim"
        )
    if H % k_BSKD.shape[2]:
        raise ValueError(f"{H} query heads are not a multiple of {k_BSKD.shape[2]} key/value heads")
    if doc_ids is not None and tuple(doc_ids.shape) != (B, S):
        raise ValueError(f"doc_ids has shape {tuple(doc_ids.shape)}, want [B, S] = {(B, S)}")
