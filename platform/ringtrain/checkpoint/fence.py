"""The fence a writer passes to the store: what it must still hold for each write to go ahead.

The store confirms the fence before every shard, the manifest commit and every deletion
(store.py); the writer lease (lease.py) is the fence a training run holds. Kept apart from both
so that the store knows the protocol and the error, never the lease.
"""

from __future__ import annotations

from typing import Optional, Protocol

from ringtrain.errors import RingtrainError


class FenceLost(RingtrainError):
    """The writer no longer holds the fence: it must not write to the store again."""


class Fence(Protocol):
    def confirm(self) -> None:
        """Return if the writer may still write; raise FenceLost once it may not."""


def confirm(fence: Optional[Fence]) -> None:
    """Confirm ``fence``, when there is one (a store written without a fence is one writer's)."""
    if fence is not None:
        fence.confirm()
