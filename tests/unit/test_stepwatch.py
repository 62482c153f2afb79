"""The step watchdog's rules on a made-up clock: keep waiting, heartbeats stop, the step
timeout, a stall at the hang timeout, and the fast settle after a first failure."""

from __future__ import annotations

import pytest

from ringtrain.policies.stepwatch import Action, StepWatch

START = 1000.0


def watch(num_ranks: int = 4, **overrides: float) -> StepWatch:
    limits = dict(step_timeout_s=600.0, heartbeat_s=1.0, heartbeat_timeout_s=10.0, hang_timeout_s=300.0)
    limits.update(overrides)
    return StepWatch(range(num_ranks), START, **limits)


def keep_heard(w: StepWatch, now: float) -> None:
    for rank in w.pending:
        w.heard(rank, now)


def test_waits_while_ranks_answer_heartbeats() -> None:
    w = watch()
    for t in range(1, 200):
        keep_heard(w, START + t)
        assert w.check(START + t).action is Action.WAIT
    assert w.wait_s(START + 5) == 1.0  # pings go out every heartbeat_s


def test_finished_ranks_leave_the_watch() -> None:
    w = watch()
    for rank in range(4):
        w.finished(rank, ok=True, now=START + 1)
    assert w.pending == []
    assert w.failed_at is None
    assert w.check(START + 10_000).action is Action.WAIT


def test_silent_rank_is_lost_after_heartbeat_timeout() -> None:
    w = watch()
    for rank in (0, 1, 3):
        w.heard(rank, START + 5)
    assert w.check(START + 10).action is Action.WAIT  # exactly the timeout: not yet
    d = w.check(START + 10.5)
    assert d.action is Action.LOSE
    assert d.lost == ((2, "stopped answering heartbeats"),)
    w.lose([2], START + 10.5)
    assert w.pending == [0, 1, 3]
    assert w.failed_at == START + 10.5


def test_stall_at_hang_timeout_while_nothing_failed() -> None:
    w = watch(hang_timeout_s=30.0)
    w.finished(0, ok=True, now=START + 1)
    keep_heard(w, START + 29)
    assert w.check(START + 29.9).action is Action.WAIT
    d = w.check(START + 30)
    assert d.action is Action.STALL
    assert d.ranks == (1, 2, 3)
    assert d.why == "no progress for 30.0 s"
    w.lose([2], START + 31)  # the group names the culprit and evicts it
    assert w.pending == [1, 3]
    keep_heard(w, START + 32)
    assert w.check(START + 32).action is Action.WAIT  # a failure was seen: no second stall


def test_no_stall_after_a_failure() -> None:
    w = watch(hang_timeout_s=30.0, heartbeat_timeout_s=60.0)
    w.finished(1, ok=False, now=START + 20)
    keep_heard(w, START + 35)
    assert w.check(START + 35).action is Action.WAIT


def test_step_timeout_gives_up_every_rank_still_running() -> None:
    w = watch(step_timeout_s=100.0, hang_timeout_s=1000.0)
    w.finished(3, ok=True, now=START + 2)
    keep_heard(w, START + 99)
    assert w.check(START + 99.9).action is Action.WAIT
    assert w.wait_s(START + 99.5) == pytest.approx(0.5)
    d = w.check(START + 100)
    assert d.action is Action.LOSE
    assert d.lost == tuple((r, "did not finish within 100.0 s") for r in (0, 1, 2))
    assert w.wait_s(START + 101) == 0.0


def test_others_settle_fast_after_a_first_failure() -> None:
    w = watch(heartbeat_timeout_s=10.0)
    w.finished(0, ok=False, now=START + 50)
    assert w.failed_at == START + 50
    assert w.deadline == START + 60
    keep_heard(w, START + 59)
    assert w.check(START + 59).action is Action.WAIT
    d = w.check(START + 60)
    assert d.action is Action.LOSE
    assert [r for r, _ in d.lost] == [1, 2, 3]


def test_settle_deadline_never_passes_the_step_timeout() -> None:
    w = watch(step_timeout_s=100.0, heartbeat_timeout_s=10.0)
    w.finished(0, ok=False, now=START + 95)
    assert w.deadline == START + 100


def test_first_failure_time_is_kept() -> None:
    w = watch()
    w.finished(0, ok=False, now=START + 5)
    w.finished(1, ok=False, now=START + 6)
    w.lose([2], START + 7)
    assert w.failed_at == START + 5


def test_silent_and_late_ranks_named_each_for_its_reason() -> None:
    w = watch(step_timeout_s=100.0, hang_timeout_s=1000.0, heartbeat_timeout_s=10.0)
    keep_heard(w, START + 95)
    w.heard(0, START + 99)
    w.heard(1, START + 99)
    w.heard(3, START + 99)
    d = w.check(START + 106)  # rank 2 silent since 95; the others late
    assert d.lost[2] == (2, "stopped answering heartbeats")
    assert d.lost[0] == (0, "did not finish within 106.0 s")


def test_hang_timeout_must_be_positive() -> None:
    with pytest.raises(ValueError):
        watch(hang_timeout_s=0).check(START + 1)
