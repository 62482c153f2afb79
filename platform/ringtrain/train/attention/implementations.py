"""The attention implementations by name: which function runs each, and the attention a config builds.

The names are config's ``ATTENTION_IMPLS`` (what ``attention.impl`` may say) and
``LOCAL_ATTENTION_IMPL`` (no context parallelism); ``IMPLEMENTATIONS`` maps each to the function
that runs it and the process-group layout it needs. ``ContextParallelAttention`` calls the
function of its own implementation, so the configured name is the one that runs.

Shape legend: B batch, S local sequence, H query heads, K key/value heads, D head dim.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional, Protocol

import torch

from ringtrain.config import ATTENTION_IMPLS, LOCAL_ATTENTION_IMPL
from ringtrain.train.attention.attend import local_attention, ring_attention
from ringtrain.train.attention.call import choose_exchange
from ringtrain.train.attention.documents import DocIds
from ringtrain.train.attention.hybrid import hybrid_attention
from ringtrain.train.attention.kernels import KernelArg, check_kernel_name, keyed_by
from ringtrain.train.attention.transport import GroupArg, Transport, as_transport, group_size
from ringtrain.train.attention.ulysses import ulysses_attention

Tensor = torch.Tensor

IMPLS: tuple[str, ...] = (*ATTENTION_IMPLS, LOCAL_ATTENTION_IMPL)


class ImplFn(Protocol):
    """One implementation, called with both of a rank's CP groups (it uses the ones it needs)."""

    def __call__(self, q_BSHD: Tensor, k_BSKD: Tensor, v_BSKD: Tensor, /, *, ring_group: Optional[Transport],
                 ulysses_group: Optional[Transport], causal: bool, doc_ids: DocIds, kernel: KernelArg,
                 kv_exchange: str, window: Optional[int], scale: Optional[float]) -> Tensor: ...


# Each implementation's function, called with the groups it needs; the rest of the options as given.


def _ring(q: Tensor, k: Tensor, v: Tensor, /, *, ring_group: Optional[Transport], ulysses_group: Optional[Transport],
          **options: Any) -> Tensor:
    return ring_attention(q, k, v, group=ring_group, **options)


def _ulysses(q: Tensor, k: Tensor, v: Tensor, /, *, ring_group: Optional[Transport],
             ulysses_group: Optional[Transport], kv_exchange: str, **options: Any) -> Tensor:
    return ulysses_attention(q, k, v, group=ulysses_group, **options)


def _local(q: Tensor, k: Tensor, v: Tensor, /, *, ring_group: Optional[Transport], ulysses_group: Optional[Transport],
           kv_exchange: str, **options: Any) -> Tensor:
    return local_attention(q, k, v, **options)


@dataclass(frozen=True)
class Implementation:
    run: ImplFn
    # Which groups may span more than one rank; a layout beyond them is refused at build time.
    multi_rank_ring: bool
    multi_rank_ulysses: bool
    refusal: str  # the message's tail when the groups are wider than allowed


IMPLEMENTATIONS: Mapping[str, Implementation] = keyed_by(
    IMPLS,
    {
        "ring": Implementation(_ring, True, False, "with a Ulysses group of {ulysses} ranks; use 'hybrid'"),
        "ulysses": Implementation(_ulysses, False, True, "with a ring group of {ring} ranks; use 'hybrid'"),
        "hybrid": Implementation(hybrid_attention, True, True, ""),
        LOCAL_ATTENTION_IMPL: Implementation(
            _local, False, False, "has no context parallelism, but the groups span {ring}x{ulysses} ranks"
        ),
    },
    "the attention implementations",
)


class ContextParallelAttention:
    """``fn(q_BSHD, k_BSKD, v_BSKD, *, causal=True, doc_ids=None, window=None, scale=None) -> out_BSHD``
    for one CP layout."""

    def __init__(
        self,
        impl: str,
        kernel: KernelArg,
        ring_group: GroupArg,
        ulysses_group: GroupArg,
        kv_exchange: str = "auto",
    ) -> None:
        self.impl = impl
        self.kernel = kernel
        self.kv_exchange = kv_exchange
        # Each group's transport, made once: every layer's call goes through the same.
        self.ring_group = as_transport(ring_group)
        self.ulysses_group = as_transport(ulysses_group)
        self._run = IMPLEMENTATIONS[impl].run

    def __call__(self, q_BSHD: Tensor, k_BSKD: Tensor, v_BSKD: Tensor, *, causal: bool = True, doc_ids: DocIds = None,
                 window: Optional[int] = None, scale: Optional[float] = None) -> Tensor:
        """``window``: a causal sliding window of that many tokens (None: full attention);
        ``scale``: the softmax scale (None: head_dim ** -0.5)."""
        return self._run(
            q_BSHD,
            k_BSKD,
            v_BSKD,
            ring_group=self.ring_group,
            ulysses_group=self.ulysses_group,
            causal=causal,
            doc_ids=doc_ids,
            kernel=self.kernel,
            kv_exchange=self.kv_exchange,
            window=window,
            scale=scale,
        )

    def __repr__(self) -> str:
        return (
            f"ContextParallelAttention(impl={self.impl!r}, kernel={self.kernel!r}, kv_exchange={self.kv_exchange!r}, "
            f"ring={group_size(self.ring_group)}, ulysses={group_size(self.ulysses_group)})"
        )


def build_attention(
    impl: str,
    kernel: KernelArg,
    *,
    ring_group: GroupArg,
    ulysses_group: GroupArg,
    kv_exchange: str = "auto",
) -> ContextParallelAttention:
    """The attention function for ``impl`` in IMPLS with block kernel ``kernel`` in KERNEL_NAMES
    (or a kernel object, as tests and benches hand one).

    ``ring_group`` / ``ulysses_group`` are this rank's groups, process groups or ``Transport``s
    (None counts as one rank); "ring" needs a Ulysses group of one, "ulysses" a ring group of
    one, "local" both. The kernel name is checked now; which kernel "auto" means is decided per
    call from the inputs' device and dtype, and which K/V exchange ``kv_exchange="auto"`` means
    from the ring's block length.
    """
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"attention impl {impl!r} is unknown; choose one of {', '.join(IMPLS)}")
    if isinstance(kernel, str):
        check_kernel_name(kernel)
    choose_exchange(kv_exchange, 2, 2, None)  # refuses an unknown name now, not at the first call
    ring, ulysses = group_size(ring_group), group_size(ulysses_group)
    spec = IMPLEMENTATIONS[impl]
    if (ring > 1 and not spec.multi_rank_ring) or (ulysses > 1 and not spec.multi_rank_ulysses):
        raise ValueError(f"attention impl {impl!r} " + spec.refusal.format(ring=ring, ulysses=ulysses))
    return ContextParallelAttention(impl, kernel, ring_group, ulysses_group, kv_exchange)
