"""The writer lease's behaviour, written once and run against each backend: a file store
(tests/unit/test_writer_lease.py) and an S3 store on a real S3 server (tests/s3/test_writer_lease_s3.py).

Each check takes ``make_store``, a function returning a fresh handle on one and the same empty
store, as a second process would open it.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable

import pytest

from ringtrain.checkpoint import CheckpointStore
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


CHECKS = [
    a_second_writer_is_refused_until_the_first_releases,
    an_expired_lease_is_taken_over_and_its_old_holder_learns_it,
    renewal_keeps_a_lease_live,
    racing_writers_cannot_both_win,
    a_kept_lease_is_renewed_in_the_background_and_released,
    the_lease_is_not_a_checkpoint,
]
