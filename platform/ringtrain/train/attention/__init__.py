"""Context-parallel attention: zigzag ring, Ulysses and their hybrid, over LSE-returning block kernels.

``build_attention`` turns a CP layout (``topology.CPLayout``) and a kernel into the attention
function the model calls (``implementations``); the functions below it are usable directly. Every
layout runs one loop (``loop``) over a K/V exchange (``exchanges``), planned once, not per layer
(``plan``), through a ``Transport`` (``transport``). Block kernels and their registry are in
``kernels``.

Shape legend: B batch, S local sequence, H query heads, K key/value heads, D head dim.
"""

from __future__ import annotations

from ringtrain.train.attention.attend import local_attention, ring_attention
from ringtrain.train.attention.hybrid import hybrid_attention
from ringtrain.train.attention.implementations import IMPLS, ContextParallelAttention, build_attention
from ringtrain.train.attention.kernels import (
    KERNEL_NAMES,
    AttentionKernel,
    BlockOutput,
    KernelUnavailableError,
    available_kernels,
    get_kernel,
    select_kernel,
)
from ringtrain.train.attention.merge import merge_partials
from ringtrain.train.attention.transport import ProcessGroupTransport, Transport, count_comm
from ringtrain.train.attention.ulysses import ulysses_attention
from ringtrain.train.attention.zigzag import causal_work, cp_shard, cp_unshard, zigzag_shard, zigzag_unshard

__all__ = [
    "IMPLS",
    "KERNEL_NAMES",
    "AttentionKernel",
    "BlockOutput",
    "ContextParallelAttention",
    "KernelUnavailableError",
    "ProcessGroupTransport",
    "Transport",
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
