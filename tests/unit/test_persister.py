"""The Persister's bookkeeping against a real file store (the shard fetch from workers aside)."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any, Optional

from ringtrain.actors.persister import Persisted, Persister
from ringtrain.checkpoint import open_store

META = {"model": {"dim": 64}}


class LocalPersister(Persister):
    """Writes one small shard per step itself instead of fetching the workers' snapshots."""

    def _persist(self, step: int, snapshot_refs: list[Any], t0: float, timeout_s: Optional[float]) -> Persisted:
        ref = self.store.save(step, {"rank-00000": bytes([step]) * 64}, dict(self.meta, step=step, world_size=1))
        return Persisted(step, ref.uri, 64, time.perf_counter() - t0)


def test_discard_after_deletes_only_what_this_run_wrote_after_the_step(tmp_path: Path) -> None:
    store = open_store(tmp_path.as_uri(), keep=10)
    store.save(9, {"rank-00000": b"older run"}, dict(META, step=9, world_size=1))  # not this run's
    persister = LocalPersister(store, META)
    for step in (2, 4, 6):
        persister.submit(step, [])

    gone = persister.discard_after(3)  # waits for the writes in flight first

    assert gone == [4, 6]
    assert sorted(ref.step for ref in store.list()) == [2, 9]
    assert persister.last_durable_step == 2 and persister.errors == []
    persister.close()


def test_a_failed_delete_is_reported_and_the_checkpoint_still_counts(tmp_path: Path) -> None:
    store = open_store(tmp_path.as_uri(), keep=10)
    persister = LocalPersister(store, META)
    persister.submit(4, [])
    persister.flush()

    def refuse(step: int, fence: object = None) -> None:
        raise PermissionError("read-only bucket")

    store.delete = refuse  # type: ignore[method-assign]
    assert persister.discard_after(3) == []
    assert persister.last_durable_step == 4
    assert len(persister.errors) == 1 and "read-only bucket" in persister.errors[0]
    persister.close()


class HeldPersister(LocalPersister):
    """Its saves wait for ``release`` before writing."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.release = threading.Event()

    def _persist(self, step: int, snapshot_refs: list[Any], t0: float, timeout_s: Optional[float]) -> Persisted:
        self.release.wait(timeout=30)
        return super()._persist(step, snapshot_refs, t0, timeout_s)


def test_flush_and_close_are_bounded_and_close_says_whether_a_save_still_writes(tmp_path: Path) -> None:
    store = open_store(tmp_path.as_uri(), keep=10)
    persister = HeldPersister(store, META)
    persister.submit(2, [])
    persister.submit(4, [])  # queued behind step 2
    t0 = time.monotonic()
    assert persister.flush(timeout_s=0.2) == []
    assert not persister.close(timeout_s=0.2)  # step 2 is still writing
    assert time.monotonic() - t0 < 5
    persister.release.set()
    assert persister.close(timeout_s=10)
    assert [ref.step for ref in store.list()] == [2]  # step 4 was dropped by close, never started
    assert [p.step for p in persister.flush()] == [2] and persister.errors == []
