"""SnapshotHolder: keeps recent snapshots in a node's memory, outside the worker processes.

A crashed worker's own memory is gone, so every snapshot is also handed to the holder on the
worker's node and, when the job spans several nodes, to a buddy node's holder. A holder is a
plain class made a Ray actor (no CPU reserved) pinned to its node; ``HolderDelivery`` is the
worker's side, handing each snapshot to its holders.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Optional, Sequence

import numpy as np

from ringtrain.checkpoint.retention import retained
from ringtrain.checkpoint.wire import verify

if TYPE_CHECKING:
    from ringtrain.train.snapshot import Snapshot


_MAX_ARRIVALS = 8192


class SnapshotHolder:
    def __init__(self, keep: int) -> None:
        self.keep = keep
        self._lock = threading.Lock()
        self._arrived = threading.Condition(self._lock)  # notified on every put, for ``wait_for``
        self._questions = 0  # wait_for calls so far: the newest one is the only one waited on
        self._snaps: dict[tuple[int, int], tuple[int, bytes, str]] = {}  # (rank, step) -> (world, blob, sum)
        self._pinned: Optional[int] = None
        self._pin_seq = -1
        # (rank, step, role) -> wall time the snapshot became readable here: the transit window
        # from a step's record to its snapshot being safe (``actors.transit``). Bounded.
        self._arrivals: OrderedDict[tuple[int, int, str], float] = OrderedDict()

    def put(self, rank: int, step: int, world_size: int, blob: bytes, digest: str, role: str = "node") -> None:
        """Keep ``blob``; ``role``: whether this holder is on the sender's node (node) or a
        buddy node's (buddy), for the arrival times."""
        # A private copy: a zero-copy buffer would live in the object store, owned by the worker,
        # which may die. A ``bytes`` object owns its memory already (Ray deserialises one by
        # copying it out of the store), so it is kept as it is: one copy less per snapshot.
        data = blob if type(blob) is bytes else bytes(memoryview(blob))
        with self._lock:
            self._snaps[(rank, step)] = (world_size, data, digest)
            self._trim(rank)
            self._arrivals[(rank, step, role)] = time.time()
            while len(self._arrivals) > _MAX_ARRIVALS:
                self._arrivals.popitem(last=False)
            self._arrived.notify_all()

    def wait_for(self, ranks: Sequence[int], step: int, timeout_s: float) -> bool:
        """Whether each of ``ranks`` has a snapshot of ``step`` or newer here, waiting up to
        ``timeout_s`` for the ones still on their way (a newer one counts: the holder keeps only
        the newest few, and a step is as safe as any later state). A newer question ends the
        wait at once: the controller asks one at a time, so an older one is moot (its world
        was given up), and no thread of this holder stays tied up in it."""

        def held() -> bool:
            newest: dict[int, int] = {}
            for r, s in self._snaps:
                newest[r] = max(s, newest.get(r, s))
            return all(newest.get(r, -1) >= step for r in ranks)

        with self._arrived:
            self._questions += 1
            mine = self._questions
            self._arrived.notify_all()
            self._arrived.wait_for(lambda: held() or self._questions != mine, timeout=timeout_s)
            return held()

    def arrivals(self) -> list[tuple[int, int, str, float]]:
        """(rank, step, role, wall time readable) of the recent puts."""
        with self._lock:
            return [(r, s, role, t) for (r, s, role), t in self._arrivals.items()]

    def pin(self, step: int, seq: int = 0) -> None:
        """Hold each rank's newest snapshot at or before ``step`` beyond the ``keep`` newest
        (the last clean SDC scan's), until the next pin; a pin older than one already applied
        (lower ``seq``: calls may run out of order) is ignored."""
        with self._lock:
            if seq < self._pin_seq:
                return
            self._pin_seq = seq
            self._pinned = step
            for rank in {r for r, _ in self._snaps}:
                self._trim(rank)

    def _trim(self, rank: int) -> None:
        keep = retained((s for r, s in self._snaps if r == rank), keep=self.keep, pin=self._pinned)
        for old in [s for r, s in self._snaps if r == rank and s not in keep]:
            del self._snaps[(rank, old)]

    def inventory(self) -> dict[int, tuple[int, list[int]]]:
        """step -> (world size, ranks held)."""
        out: dict[int, tuple[int, list[int]]] = {}
        with self._lock:
            for (rank, step), (world, _, _) in self._snaps.items():
                out.setdefault(step, (world, []))[1].append(rank)
        return {step: (world, sorted(ranks)) for step, (world, ranks) in out.items()}

    def get(self, rank: int, step: int) -> Optional[bytes]:
        """The snapshot, or None when absent or when it no longer matches its checksum."""
        with self._lock:
            entry = self._snaps.get((rank, step))
        if entry is None:
            return None
        _, blob, digest = entry
        return blob if verify(blob, digest) else None

    def drop_after(self, step: int) -> None:
        """Forget snapshots newer than ``step`` (after a rollback they describe a dead future)."""
        with self._lock:
            for key in [k for k in self._snaps if k[1] > step]:
                del self._snaps[key]

    def num_bytes(self) -> int:
        with self._lock:
            return sum(len(b) for _, b, _ in self._snaps.values())


class HolderDelivery:
    """Hands each snapshot to the holders, at most one round in flight (runs on the snapshot
    thread, so waiting here never touches the training loop)."""

    def __init__(self, holders: Sequence[Any]) -> None:
        self.holders = list(holders)
        self._in_flight: list[Any] = []

    def __call__(self, snap: "Snapshot") -> None:
        if not self.holders:
            return
        import ray

        if self._in_flight:
            # Waited for, not fetched: a holder that died with its node fails its put, and that
            # must stop neither this round nor the next from reaching the other holders.
            pending, self._in_flight = self._in_flight, []
            ray.wait(pending, num_returns=len(pending))
        # One copy into the object store for all holders; each keeps its own copy of the bytes,
        # so the worker's object going away with the worker loses nothing. As an array, the
        # blob (a view of the snapshot's buffer) goes into the store without a copy on the way.
        blob = ray.put(np.frombuffer(snap.blob, dtype=np.uint8))
        self._in_flight = [
            h.put.remote(snap.rank, snap.step, snap.world_size, blob, snap.checksum, "node" if i == 0 else "buddy")
            for i, h in enumerate(self.holders)
        ]
