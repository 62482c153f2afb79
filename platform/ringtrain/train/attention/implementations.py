"""The attention a CP layout runs: which function runs each, and the attention a layout builds.

``IMPLEMENTATIONS`` maps what a layout runs (``topology.CPLayout.runs``: config's
``ATTENTION_IMPLS`` and ``LOCAL_ATTENTION_IMPL``) to the function that runs it. ``build_attention``
makes a layout's attention on this rank's groups, a ``ContextParallelAttention``, which calls that
function: what runs is the layout's, looked up once, not decided again per call.

Shape legend: B batch, S local sequence, H query heads, K key/value heads, D head dim.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any, Optional, Protocol

import torch

from ringtrain.config import ATTENTION_IMPLS, LOCAL_ATTENTION_IMPL
from ringtrain.topology import HYBRID, LOCAL, RING, ULYSSES, CPLayout
from ringtrain.train.attention.attend import local_attention, ring_attention
from ringtrain.train.attention.call import choose_exchange
from ringtrain.train.attention.documents import DocIds
from ringtrain.train.attention.hybrid import hybrid_attention
from ringtrain.train.attention.kernels import KernelArg, check_kernel_name, keyed_by
from ringtrain.train.attention.transport import GroupArg, Transport, as_transport, group_size
from ringtrain.train.attention.ulysses import KeepKV, ulysses_attention

Tensor = torch.Tensor

IMPLS: tuple[str, ...] = (*ATTENTION_IMPLS, LOCAL_ATTENTION_IMPL)


class ImplFn(Protocol):
    """One implementation, called with both of a rank's CP groups (it uses the ones it needs);
    ``keep``, where given, is handed the K/V this rank attends as the layout leaves them."""

    def __call__(self, q_BSHD: Tensor, k_BSKD: Tensor, v_BSKD: Tensor, /, *, ring_group: Optional[Transport],
                 ulysses_group: Optional[Transport], causal: bool, doc_ids: DocIds, kernel: KernelArg,
                 kv_exchange: str, window: Optional[int], scale: Optional[float],
                 keep: Optional[KeepKV]) -> Tensor: ...


# Each implementation's function, called with the groups it needs; the rest of the options as given.
# Without Ulysses a rank attends its own shard's K/V for every head: what it keeps.


def _ring(q: Tensor, k: Tensor, v: Tensor, /, *, ring_group: Optional[Transport], ulysses_group: Optional[Transport],
          keep: Optional[KeepKV], **options: Any) -> Tensor:
    if keep is not None:
        keep(k, v)
    return ring_attention(q, k, v, group=ring_group, **options)


def _ulysses(q: Tensor, k: Tensor, v: Tensor, /, *, ring_group: Optional[Transport],
             ulysses_group: Optional[Transport], kv_exchange: str, **options: Any) -> Tensor:
    return ulysses_attention(q, k, v, group=ulysses_group, **options)


def _local(q: Tensor, k: Tensor, v: Tensor, /, *, ring_group: Optional[Transport], ulysses_group: Optional[Transport],
           kv_exchange: str, keep: Optional[KeepKV], **options: Any) -> Tensor:
    if keep is not None:
        keep(k, v)
    return local_attention(q, k, v, **options)


IMPLEMENTATIONS: Mapping[str, ImplFn] = keyed_by(
    IMPLS,
    {RING: _ring, ULYSSES: _ulysses, HYBRID: hybrid_attention, LOCAL: _local},
    "the attention implementations",
)


class ContextParallelAttention:
    """``fn(q_BSHD, k_BSKD, v_BSKD, *, causal=True, doc_ids=None, window=None, scale=None) -> out_BSHD``
    for one CP layout."""

    def __init__(self, layout: CPLayout, kernel: KernelArg, ring_group: GroupArg, ulysses_group: GroupArg) -> None:
        self.layout = layout
        self.kernel = kernel
        # Each group's transport, made once: every layer's call goes through the same.
        self.ring_group = as_transport(ring_group)
        self.ulysses_group = as_transport(ulysses_group)
        # What the layout runs, bound once to what the layout and this rank fix: a call passes
        # only its own arguments.
        self._run: functools.partial[Tensor] = functools.partial(
            IMPLEMENTATIONS[layout.runs],
            ring_group=self.ring_group,
            ulysses_group=self.ulysses_group,
            kernel=kernel,
            kv_exchange=layout.kv_exchange,
        )

    @property
    def impl(self) -> str:
        """What runs (``CPLayout.runs``)."""
        return self.layout.runs

    def __call__(self, q_BSHD: Tensor, k_BSKD: Tensor, v_BSKD: Tensor, *, causal: bool = True, doc_ids: DocIds = None,
                 window: Optional[int] = None, scale: Optional[float] = None,
                 keep: Optional[KeepKV] = None) -> Tensor:
        """``window``: a causal sliding window of that many tokens (None: full attention);
        ``scale``: the softmax scale (None: head_dim ** -0.5); ``keep``: handed the K/V this rank
        attends, where the layout leaves them (a KV cache's prefill: ``kv_cache``)."""
        return self._run(q_BSHD, k_BSKD, v_BSKD, causal=causal, doc_ids=doc_ids, window=window, scale=scale, keep=keep)

    def __repr__(self) -> str:
        return f"ContextParallelAttention(layout={self.layout!r}, kernel={self.kernel!r})"


def build_attention(
    layout: CPLayout, kernel: KernelArg, *, ring_group: GroupArg, ulysses_group: GroupArg
) -> ContextParallelAttention:
    """The attention function of ``layout`` (a job's: ``JobConfig.cp_layout``) with block kernel
    ``kernel`` in KERNEL_NAMES (or a kernel object, as tests and benches hand one).

    ``ring_group`` / ``ulysses_group`` are this rank's groups, process groups or ``Transport``s
    (None counts as one rank), of the layout's ring and Ulysses degrees. The kernel name and the
    layout's K/V exchange name are checked now; which kernel "auto" means is decided per call
    from the inputs' device and dtype, and which K/V exchange ``kv_exchange="auto"`` means from
    the ring's block length.
    """
    if isinstance(kernel, str):
        check_kernel_name(kernel)
    choose_exchange(layout.kv_exchange, 2, 2, None)  # refuses an unknown name now, not at the first call
    groups = group_size(ring_group), group_size(ulysses_group)
    if groups != (layout.ring, layout.ulysses):
        raise ValueError(f"a CP layout of ring {layout.ring} x ulysses {layout.ulysses} was given a ring group of "
                         f"{groups[0]} and a Ulysses group of {groups[1]} ranks")
    return ContextParallelAttention(layout, kernel, ring_group, ulysses_group)
