"""A repeating error: the same exception on the same step after a rollback stops the run."""

from __future__ import annotations

from ringtrain.policies.faults import Action, Capacity, Failure, Kind, Outcome, RankOutcome, classify, decide
from ringtrain.policies.repeats import ErrorSignature, RepeatTracker, repeated_reason, user_frame

TRACEBACK = """Traceback (most recent call last):
  File "/venv/lib/python3.11/site-packages/ray/_private/worker.py", line 900, in main_loop
    return func(*args)
  File "/work/main/platform/ringtrain/actors/worker.py", line 150, in train_step
    report = trainer.train_step()
  File "/work/main/platform/ringtrain/train/trainer.py", line 210, in train_step
    loss = self.model(batch)
  File "/venv/lib/python3.11/site-packages/torch/nn/modules/module.py", line 1500, in _call_impl
    return forward_call(*args)
  File "/usr/lib/python3.11/functools.py", line 10, in wrapper
    raise ValueError("bad batch")
ValueError: bad batch
"""


def test_the_frame_named_is_the_innermost_in_ringtrain_or_user_code() -> None:
    assert user_frame(TRACEBACK) == "ringtrain/train/trainer.py:210 in train_step"
    user = TRACEBACK + '  File "/home/me/my_loss.py", line 7, in loss\n'
    assert user_frame(user) == "/home/me/my_loss.py:7 in loss"
    assert user_frame("no traceback here") == ""


def test_the_second_occurrence_on_the_same_step_is_a_repeat() -> None:
    tracker = RepeatTracker()
    bad = ErrorSignature("ValueError: bad batch", "ringtrain/train/trainer.py:210 in train_step")
    assert repeated_reason(bad, 5, tracker.observe(5, bad)) is None
    # Another step, another message or another frame is another error.
    assert tracker.observe(6, bad) == 1
    assert tracker.observe(5, ErrorSignature("ValueError: other", bad.frame)) == 1
    assert tracker.observe(5, ErrorSignature(bad.error, "ringtrain/x.py:1 in f")) == 1
    reason = repeated_reason(bad, 5, tracker.observe(5, bad))
    assert reason is not None and "ringtrain/train/trainer.py:210" in reason and "step 5" in reason
    assert bad.to_dict() == {"type": "ValueError", "message": "bad batch", "frame": bad.frame}


def test_a_repeat_aborts_even_with_recoveries_left() -> None:
    failure = classify([RankOutcome(0, Outcome.ERROR, "ValueError: bad batch", where="ringtrain/a.py:3 in f")])
    assert failure is not None and failure.kind is Kind.ERROR and failure.where == "ringtrain/a.py:3 in f"
    kwargs = dict(dp=2, cp=1, min_dp=1, capacity=Capacity(0, 0), recoveries=1, max_recoveries=20, on_nan="skip")
    assert decide(failure, **kwargs).action is Action.ROLLBACK  # type: ignore[arg-type]
    assert decide(failure, **kwargs, repeated="again").action is Action.ABORT  # type: ignore[arg-type]
    assert decide(Failure(Kind.ERROR, (0,), "x"), **kwargs).action is Action.ROLLBACK  # type: ignore[arg-type]
