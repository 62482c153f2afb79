"""Where one visit's dK/dV add up in the backward: the accumulator an exchange hands the loop.

The backward walks the plan visit by visit (``loop``); for each visit the exchange makes a
``VisitAccumulator`` and hands it over with the visit's K and V, the loop ``add``s every block's
dK and dV to it, and the exchange takes the visit's dK/dV from it (``grads``, ``stacked``) and
sends them where they belong. An accumulator starts one of three ways, by what the exchange holds
for the visit:

- ``fresh``: nothing (a rank's own K/V; every visit whose gradients the exchange sends on their
  own). A lone block of every column keeps its own dK and dV, neither stacked nor copied to fp32:
  a call of one uncut block pays for no accumulator; a second block stacks them and adds.
- ``into``: a stacked accumulator to add to (all-gather's, of the whole sequence).
- ``arriving``: a stacked accumulator in flight from another rank (the ring's, which the previous
  rank added its share to a step earlier): waited for only once the visit's first block is
  computed, so the transfer overlaps that block's kernel.

Shape legend: K/V in the block kernel's layout, dK/dV stacked ``[2, ...]`` in the accumulation
dtype (fp32; fp64 for fp64 inputs).
"""

from __future__ import annotations

from typing import Optional, Union

import torch

from ringtrain.train.attention.block_kernel import accumulation_dtype
from ringtrain.train.attention.transport import Pending

Tensor = torch.Tensor
KV = tuple[Tensor, Tensor]
# A visit's dK/dV: stacked, or a lone block's own (dK, dV) (``stacked`` makes one tensor of them
# where they must travel).
VisitGradients = Union[Tensor, KV]


def stacked(grads: VisitGradients) -> Tensor:
    """A visit's dK/dV as one ``[2, ...]`` tensor in the accumulation dtype."""
    if isinstance(grads, Tensor):
        return grads
    both = torch.stack(grads)
    return both if both.dtype == accumulation_dtype(both.dtype) else both.float()


class VisitAccumulator:
    """One visit's dK/dV as its blocks add to them (see the module doc for how it starts)."""

    __slots__ = ("_k", "_dkv", "_pending", "_own")

    def __init__(self, k: Tensor, dkv: Optional[Tensor], pending: Optional[Pending]) -> None:
        self._k = k  # the visit's K: a fresh accumulator's shape, device and dtype
        self._dkv = dkv  # stacked, where the blocks add (None: none yet)
        self._pending = pending  # the transfer that fills ``_dkv``
        self._own: Optional[KV] = None  # a lone block's own dK and dV, while there is no ``_dkv``

    @classmethod
    def fresh(cls, k: Tensor) -> VisitAccumulator:
        """Nothing yet, for the visit of K ``k``."""
        return cls(k, None, None)

    @classmethod
    def into(cls, dkv: Tensor) -> VisitAccumulator:
        """Adding into ``dkv``."""
        return cls(dkv, dkv, None)

    @classmethod
    def arriving(cls, dkv: Tensor, pending: Pending) -> VisitAccumulator:
        """Adding into ``dkv`` once ``pending`` has filled it."""
        return cls(dkv, dkv, pending)

    def add(self, dk: Tensor, dv: Tensor, cols: tuple[int, int], all_cols: bool, seq_dim: int) -> None:
        """A block's dK and dV, of the visit's columns ``[start, stop)`` along K's ``seq_dim``
        (``all_cols``: all of them)."""
        if self._pending is not None:
            self._arrive()
        if self._dkv is None and self._own is None and all_cols:
            self._own = (dk, dv)
            return
        if self._dkv is None:
            self._dkv = stacked(self._own) if self._own is not None else self._zeros()
            self._own = None
        target = self._dkv
        if not all_cols:
            target = target.narrow(seq_dim + 1, cols[0], cols[1] - cols[0])
        target.add_(torch.stack((dk, dv)))

    def grads(self) -> VisitGradients:
        """The visit's dK/dV: stacked, or a lone block's own dK and dV (zeros where no block saw
        the visit)."""
        if self._pending is not None:
            self._arrive()
        if self._dkv is not None:
            return self._dkv
        return self._own if self._own is not None else self._zeros()

    def stacked(self) -> Tensor:
        """The visit's dK/dV stacked, as they travel."""
        if self._pending is None and self._dkv is not None:  # an accumulator added to: as it is
            return self._dkv
        return stacked(self.grads())

    def _arrive(self) -> None:
        assert self._pending is not None
        self._pending.wait()
        self._pending = None

    def _zeros(self) -> Tensor:
        k = self._k
        return torch.zeros((2, *k.shape), dtype=accumulation_dtype(k.dtype), device=k.device)
