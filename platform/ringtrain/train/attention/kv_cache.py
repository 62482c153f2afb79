"""A rank's shard of a KV cache: for every layer, the keys and values of the tokens it holds.

A batch of prompts is laid out left-padded in ``S`` slots (every prompt ends at slot ``S - 1``),
so the new tokens of every row take the same slots ``S, S + 1, ...`` and a window is the same
span of slots for every row. The prefill runs the layout's own attention, and each layer hands
its shard the K/V it attended as the layout left them (``ContextParallelAttention``'s ``keep``):
a ring rank its zigzag shard's slots for every head, a Ulysses rank the gathered slots of its
ring shard for its own heads. The slots a rank holds are ``sequence_positions(S, ring, 1,
ring_idx, 0)``: the same for every rank of a Ulysses group, which differ by heads.

Each new token's K/V go to one ring index (``append_ring_index``: token t to ring index
``t mod ring``), so the ranks' shards stay within a token of each other; every Ulysses rank of
that ring index appends its own heads. A windowed layer keeps only the slots the next query
can see, so it never holds more than its window. Padding slots are held but marked not
``valid`` for their row: a padded row's query never sees them.

Memory: a layer's buffers are allocated once, for the shard's share of the prompt and the new
tokens (``capacity``), never for the whole sequence.

Shape legend: B batch, K this rank's key/value heads, T slots held (capacity C), D head dim.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

Tensor = torch.Tensor


def append_ring_index(token: int, ring: int) -> int:
    """The ring index whose ranks keep the K/V of new token ``token`` (0 the first); pure."""
    return token % ring


def new_token_share(num_new: int, ring: int, ring_idx: int) -> int:
    """How many of ``num_new`` new tokens ring index ``ring_idx`` keeps; pure."""
    return sum(1 for t in range(num_new) if append_ring_index(t, ring) == ring_idx)


def visible_after(slot: int, window: Optional[int]) -> int:
    """The first slot a query at ``slot`` sees under ``window`` (query i sees key j iff
    i - W < j <= i), or 0 without one; pure."""
    return 0 if window is None else max(0, slot - window + 1)


class LayerShard:
    """One layer's keys and values on this rank: ``k``/``v`` ``[B, K, C, D]``, the first ``held``
    slots filled; ``slots[t]`` is slot t's position in the padded sequence, ``valid[b, t]``
    whether row b's query may see it (padding is held but never seen)."""

    def __init__(self, window: Optional[int]) -> None:
        self.window = window
        self.k: Optional[Tensor] = None
        self.v: Optional[Tensor] = None
        self.slots: Optional[Tensor] = None
        self.valid: Optional[Tensor] = None
        self.held = 0

    def fill(self, k_BSKD: Tensor, v_BSKD: Tensor, slots_S: Tensor, seq_len: int, first_real_B: Tensor,
             num_appended: int) -> None:
        """The prefill's K/V of slots ``slots_S`` (this rank's, in its order) of a sequence of
        ``seq_len`` slots; row b's prompt starts at slot ``first_real_B[b]``; room for
        ``num_appended`` more. A windowed layer keeps only what the first new token sees."""
        keep = slots_S >= visible_after(seq_len, self.window)
        kept_slots = slots_S[keep]
        B, _, K, D = k_BSKD.shape
        held = int(kept_slots.numel())
        capacity = held + num_appended
        if self.window is not None:
            capacity = min(capacity, self.window)
        dtype, device = k_BSKD.dtype, k_BSKD.device
        self.k = torch.empty(B, K, capacity, D, dtype=dtype, device=device)
        self.v = torch.empty_like(self.k)
        self.slots = torch.empty(capacity, dtype=torch.long, device=device)
        self.valid = torch.zeros(B, capacity, dtype=torch.bool, device=device)
        index = keep.nonzero().flatten()
        self.k[:, :, :held] = k_BSKD.index_select(1, index).transpose(1, 2)
        self.v[:, :, :held] = v_BSKD.index_select(1, index).transpose(1, 2)
        self.slots[:held] = kept_slots
        self.valid[:, :held] = kept_slots[None, :] >= first_real_B[:, None]
        self.held = held

    def expire(self, query_slot: int) -> None:
        """Drop what a windowed layer's query at ``query_slot`` (and every later one) cannot see."""
        if self.window is None or self.held == 0:
            return
        assert self.k is not None and self.v is not None and self.slots is not None and self.valid is not None
        live = self.slots[: self.held] >= visible_after(query_slot, self.window)
        if bool(live.all()):
            return
        index = live.nonzero().flatten()
        n = int(index.numel())
        self.k[:, :, :n] = self.k.index_select(2, index)
        self.v[:, :, :n] = self.v.index_select(2, index)
        self.slots[:n] = self.slots.index_select(0, index)
        self.valid[:, :n] = self.valid.index_select(1, index)
        self.held = n

    def append(self, k_B1KD: Tensor, v_B1KD: Tensor, slot: int) -> None:
        """One new token's K/V (this rank's heads of it), seen by every row."""
        assert self.k is not None and self.v is not None and self.slots is not None and self.valid is not None
        if self.held == self.k.shape[2]:
            raise RuntimeError(f"a KV cache shard of {self.held} slots is full; slot {slot} has no room")
        t = self.held
        self.k[:, :, t] = k_B1KD[:, 0]
        self.v[:, :, t] = v_B1KD[:, 0]
        self.slots[t] = slot
        self.valid[:, t] = True
        self.held = t + 1

    def view(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """``(k, v, slots, valid)`` of the held slots."""
        assert self.k is not None and self.v is not None and self.slots is not None and self.valid is not None
        t = self.held
        return self.k[:, :, :t], self.v[:, :, :t], self.slots[:t], self.valid[:, :t]

    @property
    def nbytes(self) -> int:
        """The bytes this shard's buffers take (allocated, not only held)."""
        tensors = (self.k, self.v, self.slots, self.valid)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)


@dataclass
class KVCache:
    """A rank's shard of a batch's KV cache: one ``LayerShard`` a layer."""

    layers: list[LayerShard]

    @classmethod
    def for_windows(cls, windows: list[Optional[int]]) -> KVCache:
        return cls([LayerShard(window) for window in windows])

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers)

    def held(self) -> list[int]:
        """Slots held, layer by layer."""
        return [layer.held for layer in self.layers]
