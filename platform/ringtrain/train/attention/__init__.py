"""Context-parallel attention: zigzag ring, Ulysses and their hybrid, over LSE-returning block kernels.

``build_attention`` turns the configured implementation and kernel into the attention function
the model calls; the functions below it are usable directly.

Shape legend: B batch, S local sequence, H query heads, K key/value heads, D head dim.
"""

from __future__ import annotations

from typing import Optional

import torch

from ringtrain.train.attention.comm import ProcessGroup, count_comm, group_size
from ringtrain.train.attention.hybrid import hybrid_attention
from ringtrain.train.attention.kernels import (
    KERNEL_NAMES,
    AttentionKernel,
    BlockOutput,
    KernelUnavailableError,
    available_kernels,
    check_kernel_name,
    get_kernel,
    select_kernel,
)
from ringtrain.train.attention.local import local_attention
from ringtrain.train.attention.merge import merge_partials
from ringtrain.train.attention.ring import ring_attention
from ringtrain.train.attention.ulysses import ulysses_attention
from ringtrain.train.attention.zigzag import causal_work, cp_shard, cp_unshard, zigzag_shard, zigzag_unshard

__all__ = [
    "IMPLS",
    "KERNEL_NAMES",
    "AttentionKernel",
    "BlockOutput",
    "ContextParallelAttention",
    "KernelUnavailableError",
    "available_kernels",
    "build_attention",
    "causal_work",
    "count_comm",
    "cp_shard",
    "cp_unshard",
    "get_kernel",
    "hybrid_attention",
    "local_attention",
    "merge_partials",
    "ring_attention",
    "select_kernel",
    "ulysses_attention",
    "zigzag_shard",
    "zigzag_unshard",
]

IMPLS = ("ring", "ulysses", "hybrid", "local")

Tensor = torch.Tensor


class ContextParallelAttention:
    """``fn(q_BSHD, k_BSKD, v_BSKD, *, causal=True, doc_ids=None) -> out_BSHD`` for one CP layout."""

    def __init__(
        self, impl: str, kernel: str, ring_group: Optional[ProcessGroup], ulysses_group: Optional[ProcessGroup]
    ) -> None:
        self.impl = impl
        self.kernel = kernel
        self.ring_group = ring_group
        self.ulysses_group = ulysses_group

    def __call__(
        self, q_BSHD: Tensor, k_BSKD: Tensor, v_BSKD: Tensor, *, causal: bool = True, doc_ids: Optional[Tensor] = None
    ) -> Tensor:
        # "hybrid" with a group of one is pure ring or pure Ulysses, so it covers every layout.
        return hybrid_attention(
            q_BSHD,
            k_BSKD,
            v_BSKD,
            ring_group=self.ring_group,
            ulysses_group=self.ulysses_group,
            causal=causal,
            doc_ids=doc_ids,
            kernel=self.kernel,
        )

    def __repr__(self) -> str:
        return (
            f"ContextParallelAttention(impl={self.impl!r}, kernel={self.kernel!r}, "
            f"ring={group_size(self.ring_group)}, ulysses={group_size(self.ulysses_group)})"
        )


def build_attention(
    impl: str, kernel: str, *, ring_group: Optional[ProcessGroup], ulysses_group: Optional[ProcessGroup]
) -> ContextParallelAttention:
    """The attention function for ``impl`` in IMPLS with block kernel ``kernel`` in KERNEL_NAMES.

    ``ring_group`` / ``ulysses_group`` are this rank's groups (None counts as one rank); "ring"
    needs a Ulysses group of one, "ulysses" a ring group of one, "local" both. The kernel name is
    checked now; which kernel "auto" means is decided per call from the inputs' device and dtype.
    """
    if impl not in IMPLS:
        raise ValueError(f"attention impl {impl!r} is unknown; choose one of {', '.join(IMPLS)}")
    check_kernel_name(kernel)
    ring, ulysses = group_size(ring_group), group_size(ulysses_group)
    if impl == "local" and (ring > 1 or ulysses > 1):
        raise ValueError(
            f"attention impl 'local' has no context parallelism, but the groups span {ring}x{ulysses} ranks"
        )
    if impl == "ring" and ulysses > 1:
        raise ValueError(f"attention impl 'ring' with a Ulysses group of {ulysses} ranks; use 'hybrid'")
    if impl == "ulysses" and ring > 1:
        raise ValueError(f"attention impl 'ulysses' with a ring group of {ring} ranks; use 'hybrid'")
    return ContextParallelAttention(impl, kernel, ring_group, ulysses_group)
