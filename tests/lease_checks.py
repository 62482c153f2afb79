"""The writer lease's behaviour, written once and run against each backend: a file store
(tests/unit/test_writer_lease.py) and an S3 store on a real S3 server (tests/s3/test_writer_lease_s3.py).

Each check takes ``make_store``, a function returning a fresh handle on one and the same empty
store, as a second process would open it.

The fencing checks take the lease over in the middle of a save through a seam, not a sleep: the
old run's store writes through ``Spy``, a backend that records every write and deletion and
runs the takeover right after a chosen one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Optional

import pytest

from ringtrain.checkpoint import CheckpointStore, liveness
from ringtrain.checkpoint.backends import ObjectBackend, ObjectInfo
from ringtrain.checkpoint.layout import manifest_key, shard_key
from ringtrain.checkpoint.lease import LEASE_KEY, Holder, LeaseHeld, LeaseLost, WriterLease

StoreFactory = Callable[[], CheckpointStore]
TERM_S = 60.0


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def lease(store: CheckpointStore, job: str, clock: Clock, term_s: float = TERM_S) -> WriterLease:
    return WriterLease(store.backend, Holder.this_process(job, f"/runs/{job}"), term_s, clock=clock)


def a_second_writer_is_refused_until_the_first_releases(make_store: StoreFactory) -> None:
    clock = Clock()
    first, second = lease(make_store(), "first", clock), lease(make_store(), "second", clock)
    first.acquire()
    with pytest.raises(LeaseHeld) as caught:
        second.acquire()
    assert caught.value.key == "checkpoint.uri"
    message = str(caught.value)
    assert "is being written by run 'first'" in message and "/runs/first" in message and "until " in message
    assert "another checkpoint.uri" in message
    first.check()  # the holder may write
    with pytest.raises(LeaseLost, match="never took"):
        second.check()
    first.release()
    second.acquire()
    second.check()


def an_expired_lease_is_taken_over_and_its_old_holder_learns_it(make_store: StoreFactory) -> None:
    clock = Clock()
    killed, next_run = lease(make_store(), "killed", clock), lease(make_store(), "next", clock)
    killed.acquire()
    clock.now += TERM_S / 2
    with pytest.raises(LeaseHeld):
        next_run.acquire()  # still live
    clock.now += TERM_S  # the killed run never renewed it
    with pytest.raises(LeaseLost, match="lapsed"):
        killed.check()
    next_run.acquire()
    with pytest.raises(LeaseLost, match="taken over by another run"):
        killed.renew()
    with pytest.raises(LeaseLost):
        killed.check()
    killed.release()  # not ours any more: leaves the new holder's lease alone
    next_run.check()
    next_run.renew()


def _ended_process() -> tuple[int, int]:
    """(pid, start ticks) of a process of this host that has ended."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        begun = liveness.started(child.pid)
        assert begun is not None
    finally:
        child.kill()
        child.wait()
    return child.pid, begun


def _left_behind(store: CheckpointStore, clock: Clock, holder: Holder) -> None:
    """A live lease of ``holder`` in ``store``, as a run that crashed while training leaves it."""
    WriterLease(store.backend, holder, TERM_S, clock=clock).acquire()


def a_live_lease_of_an_ended_process_of_this_host_is_taken_over_at_once(make_store: StoreFactory) -> None:
    """A crash on this host: the holder's pid no longer runs (or runs a process started at
    another time, the pid handed on), so the next run takes over without waiting for expiry."""
    clock = Clock()
    pid, begun = _ended_process()
    mine = Holder.this_process("next", "/runs/next")
    for gone_holder in (
        Holder("crashed", "crashed", "/runs/crashed", mine.host, pid, mine.boot, begun),
        Holder("reused", "reused", "/runs/reused", mine.host, os.getpid(), mine.boot, mine.started + 1),
    ):
        _left_behind(make_store(), clock, gone_holder)
        next_run = WriterLease(make_store().backend, Holder.this_process("next", "/runs/next"), TERM_S, clock=clock)
        next_run.check_free()  # no clock moved: the lease is still live
        next_run.acquire()
        next_run.check()
        next_run.release()


def a_live_lease_of_a_running_process_or_another_host_still_waits(make_store: StoreFactory) -> None:
    clock = Clock()
    pid, begun = _ended_process()
    mine = Holder.this_process("next", "/runs/next")
    for live_holder in (
        # This very process: running, its start time as recorded.
        Holder("running", "running", "/runs/running", mine.host, os.getpid(), mine.boot, mine.started),
        # Another host (another boot, or a container's own pid namespace): its pid says nothing here.
        Holder("elsewhere", "elsewhere", "/runs/elsewhere", "node-b", pid, "another-boot pid:[1]", begun),
        # A lease written before holders recorded their boot and start.
        Holder("older", "older", "/runs/older", mine.host, pid),
    ):
        _left_behind(make_store(), clock, live_holder)
        next_run = WriterLease(make_store().backend, mine, TERM_S, clock=clock)
        with pytest.raises(LeaseHeld, match=f"run '{live_holder.job}'"):
            next_run.acquire()
        clock.now += TERM_S + 1  # expired: the next holder's turn, and the next case's store is free


def renewal_keeps_a_lease_live(make_store: StoreFactory) -> None:
    clock = Clock()
    holder, other = lease(make_store(), "holder", clock), lease(make_store(), "other", clock)
    holder.acquire()
    for _ in range(5):  # renewed each third of the term: never lapses
        clock.now += TERM_S / 3
        holder.renew()
        with pytest.raises(LeaseHeld):
            other.acquire()
    holder.check()


def racing_writers_cannot_both_win(make_store: StoreFactory) -> None:
    clock = Clock()
    racers = [lease(make_store(), f"racer{i}", clock) for i in range(6)]
    won: list[str] = []
    refused: list[str] = []
    start = threading.Barrier(len(racers))

    def race(racer: WriterLease) -> None:
        start.wait()
        try:
            racer.acquire()
            won.append(racer.holder.job)
        except LeaseHeld:
            refused.append(racer.holder.job)

    threads = [threading.Thread(target=race, args=(r,)) for r in racers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert len(won) == 1 and len(refused) == len(racers) - 1, (won, refused)


def a_kept_lease_is_renewed_in_the_background_and_released(make_store: StoreFactory) -> None:
    """Real time, a short term: the stored expiry moves forward while the block runs (polled,
    bounded), and the lease is gone when it ends."""
    store = make_store()
    holder = WriterLease(store.backend, Holder.this_process("kept", "/runs/kept"), 0.3)
    holder.acquire()
    with holder.kept():
        first = json.loads(store.backend.get(LEASE_KEY))["expires_at"]
        deadline = time.monotonic() + 10
        while json.loads(store.backend.get(LEASE_KEY))["expires_at"] <= first:
            assert time.monotonic() < deadline, "the lease was not renewed"
            time.sleep(0.05)
        holder.check()
    assert LEASE_KEY not in {info.key for info in store.backend.list()}
    WriterLease(make_store().backend, Holder.this_process("after", "/runs/after"), TERM_S).acquire()


def the_lease_is_not_a_checkpoint(make_store: StoreFactory) -> None:
    store = make_store()
    lease(store, "holder", Clock()).acquire()
    assert store.list() == [] and store.latest_valid() is None and store.skipped == []


class Spy:
    """A backend that records the store's writes and deletions (the lease's own aside) and calls
    ``after(op, key)`` once each has happened: the seam a takeover goes through."""

    def __init__(self, inner: ObjectBackend, after: Callable[[str, str], None]) -> None:
        self.inner, self.after = inner, after
        self.root_uri = inner.root_uri
        self.writes: list[tuple[str, str]] = []

    def _did(self, op: str, key: str) -> None:
        if key != LEASE_KEY:
            self.writes.append((op, key))
            self.after(op, key)

    def put(self, key: str, data: bytes) -> None:
        self.inner.put(key, data)
        self._did("put", key)

    def delete(self, keys: Iterable[str]) -> None:
        for key in list(keys):
            self.inner.delete([key])
            self._did("delete", key)

    def delete_prefix(self, prefix: str) -> None:
        self.inner.delete_prefix(prefix)
        self._did("delete_prefix", prefix)

    def __getattr__(self, name: str) -> Any:  # reads, listings, URIs: the real backend's
        return getattr(self.inner, name)


SHARDS = {f"rank-{r:05d}": bytes([r]) * 64 for r in range(4)}


def _fenced_store(make_store: StoreFactory, clock: Clock, when: Callable[[str, str], bool], takeover: Callable[[], None]) -> tuple[CheckpointStore, WriterLease, Spy]:
    """The old run's store (keep 1, one writer thread: writes in a known order), holding a
    committed step 5 and the lease; ``takeover`` runs after the first write ``when`` picks."""
    store = make_store()
    store.keep, store.num_threads = 1, 1
    old = lease(store, "old", clock)
    old.acquire()
    store.save(5, SHARDS, {"step": 5}, fence=old)
    fired: list[bool] = []

    def after(op: str, key: str) -> None:
        if not fired and when(op, key):
            fired.append(True)
            takeover()

    spy = Spy(store.backend, after)
    store.backend = spy
    return store, old, spy


def _after_the_takeover(spy: Spy, first: tuple[str, str]) -> list[tuple[str, str]]:
    return spy.writes[spy.writes.index(first) + 1 :]


def a_lease_that_lapsed_mid_save_stops_every_further_write(make_store: StoreFactory) -> None:
    """The old run stopped renewing (paused, partitioned): between its second and third shard the
    term passes and another run takes the store. No further shard, no manifest, no delete, not
    even of its own half-written step: the folder may be the new holder's by now."""
    clock = Clock()
    second = shard_key(10, "rank-00001")
    newcomer: list[WriterLease] = []

    def takeover() -> None:
        clock.now += 2 * TERM_S
        newcomer.append(lease(make_store(), "new", clock))
        newcomer[0].acquire()

    store, old, spy = _fenced_store(make_store, clock, lambda op, key: key == second, takeover)
    with pytest.raises(LeaseLost, match="lapsed"):
        store.save(10, SHARDS, {"step": 10}, fence=old)
    assert _after_the_takeover(spy, ("put", second)) == []
    keys = {info.key for info in make_store().backend.list("")}
    assert manifest_key(10) not in keys and {shard_key(10, n) for n in ("rank-00000", "rank-00001")} <= keys
    assert [ref.step for ref in make_store().list()] == [5]  # retention (keep 1) deleted nothing
    newcomer[0].check()


def a_lease_taken_over_mid_save_stops_every_further_write(make_store: StoreFactory) -> None:
    """The lease replaced under a holder whose own clock says it is live (removed by hand, or a
    clock far off): the store itself is asked before each write, so the same holds."""
    clock = Clock()
    second = shard_key(10, "rank-00001")

    def takeover() -> None:
        thief = make_store().backend
        thief.delete([LEASE_KEY])
        lease(make_store(), "new", clock).acquire()

    store, old, spy = _fenced_store(make_store, clock, lambda op, key: key == second, takeover)
    with pytest.raises(LeaseLost, match="taken over"):
        store.save(10, SHARDS, {"step": 10}, fence=old)
    assert _after_the_takeover(spy, ("put", second)) == []
    assert [ref.step for ref in make_store().list()] == [5]
    with pytest.raises(LeaseLost):
        old.check()  # and it stays lost


def a_lease_taken_over_after_the_last_shard_commits_nothing(make_store: StoreFactory) -> None:
    clock = Clock()
    last = shard_key(10, "rank-00003")

    def takeover() -> None:
        clock.now += 2 * TERM_S
        lease(make_store(), "new", clock).acquire()

    store, old, spy = _fenced_store(make_store, clock, lambda op, key: key == last, takeover)
    with pytest.raises(LeaseLost):
        store.save(10, SHARDS, {"step": 10}, fence=old)
    assert _after_the_takeover(spy, ("put", last)) == []
    assert [ref.step for ref in make_store().list()] == [5]


def a_lease_taken_over_after_the_commit_deletes_nothing(make_store: StoreFactory) -> None:
    """Taken over right after the manifest commit: retention (keep 1) would delete step 5 next;
    it deletes nothing."""
    clock = Clock()

    def takeover() -> None:
        clock.now += 2 * TERM_S
        lease(make_store(), "new", clock).acquire()

    store, old, spy = _fenced_store(make_store, clock, lambda op, key: key == manifest_key(10), takeover)
    with pytest.raises(LeaseLost):
        store.save(10, SHARDS, {"step": 10}, fence=old)
    assert _after_the_takeover(spy, ("put", manifest_key(10))) == []
    assert [ref.step for ref in make_store().list()] == [10, 5]


def a_fenced_save_without_a_takeover_writes_as_before(make_store: StoreFactory) -> None:
    clock = Clock()
    store, old, spy = _fenced_store(make_store, clock, lambda op, key: False, lambda: None)
    store.save(10, SHARDS, {"step": 10}, fence=old)
    assert [ref.step for ref in make_store().list()] == [10]  # keep 1: step 5 deleted, under the lease
    assert ("put", manifest_key(10)) in spy.writes and spy.writes[-1][0] == "delete_prefix"


CHECKS = [
    a_second_writer_is_refused_until_the_first_releases,
    an_expired_lease_is_taken_over_and_its_old_holder_learns_it,
    a_live_lease_of_an_ended_process_of_this_host_is_taken_over_at_once,
    a_live_lease_of_a_running_process_or_another_host_still_waits,
    renewal_keeps_a_lease_live,
    racing_writers_cannot_both_win,
    a_kept_lease_is_renewed_in_the_background_and_released,
    the_lease_is_not_a_checkpoint,
    a_lease_that_lapsed_mid_save_stops_every_further_write,
    a_lease_taken_over_mid_save_stops_every_further_write,
    a_lease_taken_over_after_the_last_shard_commits_nothing,
    a_lease_taken_over_after_the_commit_deletes_nothing,
    a_fenced_save_without_a_takeover_writes_as_before,
]
