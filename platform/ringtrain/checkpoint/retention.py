"""Which in-memory snapshot steps a worker or a node holder keeps. Pure."""

from __future__ import annotations

from typing import Iterable, Optional


def retained(steps: Iterable[int], *, keep: int, pin: Optional[int] = None) -> set[int]:
    """The snapshot steps to hold: the newest ``keep``, and the newest at or before ``pin`` (the
    last clean SDC scan: the point a corruption found later rolls back to, however old)."""
    ordered = sorted(steps)
    out = set(ordered[-keep:]) if keep > 0 else set()
    if pin is not None:
        pinned = [s for s in ordered if s <= pin]
        if pinned:
            out.add(pinned[-1])
    return out
