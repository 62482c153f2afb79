"""Recomputation inside a layer: the sequence-tiled SwiGLU MLP and selective recomputation.

Both trade a little compute in the backward for activation memory, with
``torch.utils.checkpoint`` (non-reentrant) as the mechanism: a checkpointed function keeps only
its inputs and is run again when its backward needs what it would have saved. Because the
module calls are repeated, DeepSpeed's ZeRO-3 hooks gather the weights again in the recompute,
and an enclosing ``saved_tensors_hooks`` (activation offload, train/offload.py) sees the
checkpoint's inputs, which are then what it offloads.

Tiled MLP (after DeepSpeed's Arctic Long Sequence Training, Bekman et al. 2025, "tiled MLP"):
the SwiGLU runs over K tiles of the sequence, each checkpointed. Autograd's ready queue runs
the most recently created node first, so one tile's recompute and backward complete before the
next tile's start, and the ``3 x ffn_dim`` intermediates live for one tile at a time: t/K
tokens instead of t. The weights' gradients are summed over the tiles by autograd before they
are accumulated, once, into ``.grad``.

Selective recomputation (after Korthikanti et al. 2022, "Reducing Activation Recomputation in
Large Transformer Models", section 4.2: recompute the parts that hold much memory for few FLOPs).
Their pick, the attention's softmax and dropout, is already memory-light here: the fused
attention kernels keep q, k, v, the output and one log-sum-exp per row. What holds most of a
Llama layer's activations is the RMSNorms' fp32 internals (16 h bytes per token in bf16) and
the SwiGLU's four f-wide tensors (8 f), ~90% of the layer for Llama-3-8B, and their FLOPs grow
only linearly in the sequence while the attention's grow quadratically. So ``selective``
recomputes both norms and the whole MLP (keeping the residual stream they read, 2 x p h per
token) and never the attention. For Llama-3-8B the MLP is half a layer's forward FLOPs at 32K
tokens per rank (1/6 of forward + backward) and a quarter at 128K, against a whole forward
(1/3 of forward + backward) for ``full``.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch.utils.checkpoint import checkpoint

TensorFn = Callable[[torch.Tensor], torch.Tensor]


def recomputed(fn: TensorFn, x_BSE: torch.Tensor) -> torch.Tensor:
    """``fn(x)`` keeping only ``x`` for the backward; ``fn`` runs again there."""
    if not torch.is_grad_enabled():
        return fn(x_BSE)
    out = checkpoint(fn, x_BSE, use_reentrant=False)
    assert isinstance(out, torch.Tensor)
    return out


def tiled(fn: TensorFn, x_BSE: torch.Tensor, num_tiles: int) -> torch.Tensor:
    """``fn`` of a position-wise function over ``num_tiles`` sequence tiles, each recomputed in the
    backward; ``num_tiles`` must divide the sequence (``config.checks`` checks ``model.mlp_tiles``)."""
    if num_tiles == 1:
        return recomputed(fn, x_BSE)
    if x_BSE.shape[1] % num_tiles:
        raise ValueError(f"{num_tiles} tiles do not divide the local sequence of {x_BSE.shape[1]} tokens")
    return torch.cat([recomputed(fn, piece) for piece in x_BSE.chunk(num_tiles, dim=1)], dim=1)
