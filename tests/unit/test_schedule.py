"""The learning-rate schedule: linear warmup to the peak, then cosine decay to min_ratio."""

from __future__ import annotations

import math
from functools import partial

import pytest

from ringtrain.train.engine import lr_multiplier

WARMUP, TOTAL, MIN_RATIO = 10, 110, 0.1
schedule = partial(lr_multiplier, warmup_steps=WARMUP, total_steps=TOTAL, min_ratio=MIN_RATIO)


@pytest.mark.parametrize("step", range(WARMUP))
def test_warmup_is_linear_and_never_zero(step: int) -> None:
    # step counts optimizer steps taken (LambdaLR), so the first step already trains at 1/warmup
    assert schedule(step) == pytest.approx((step + 1) / WARMUP)


def test_warmup_reaches_the_peak_exactly_at_its_end() -> None:
    assert schedule(WARMUP - 1) == pytest.approx(1.0)
    assert schedule(WARMUP) == pytest.approx(1.0)
    assert schedule(WARMUP + 1) < 1.0


def test_cosine_midpoint_is_halfway_between_peak_and_floor() -> None:
    midpoint = WARMUP + (TOTAL - WARMUP) // 2
    assert schedule(midpoint) == pytest.approx((1 + MIN_RATIO) / 2)


def test_cosine_quarter_point() -> None:
    quarter = WARMUP + (TOTAL - WARMUP) // 4
    expected = MIN_RATIO + (1 - MIN_RATIO) * 0.5 * (1 + math.cos(math.pi / 4))
    assert schedule(quarter) == pytest.approx(expected)


@pytest.mark.parametrize("step", [TOTAL, TOTAL + 1, 2 * TOTAL, 10**6])
def test_min_ratio_at_and_after_total_steps(step: int) -> None:
    assert schedule(step) == pytest.approx(MIN_RATIO)


def test_decay_after_warmup_is_monotone_non_increasing() -> None:
    values = [schedule(s) for s in range(WARMUP, TOTAL + 5)]
    assert all(a >= b for a, b in zip(values, values[1:]))
    assert values[0] == pytest.approx(1.0) and values[-1] == pytest.approx(MIN_RATIO)
    assert all(MIN_RATIO - 1e-12 <= v <= 1.0 + 1e-12 for v in values)


def test_no_warmup_starts_at_the_peak() -> None:
    no_warmup = partial(lr_multiplier, warmup_steps=0, total_steps=100, min_ratio=0.0)
    assert no_warmup(0) == pytest.approx(1.0)
    assert no_warmup(50) == pytest.approx(0.5)
    assert no_warmup(100) == pytest.approx(0.0, abs=1e-12)


@pytest.mark.parametrize("min_ratio", [0.0, 0.25, 1.0])
def test_the_floor_is_min_ratio(min_ratio: float) -> None:
    assert lr_multiplier(1000, warmup_steps=5, total_steps=50, min_ratio=min_ratio) == pytest.approx(min_ratio)


def test_warmup_as_long_as_training_is_all_warmup() -> None:
    whole_run = [lr_multiplier(s, warmup_steps=10, total_steps=10, min_ratio=0.1) for s in range(10)]
    assert whole_run == pytest.approx([(s + 1) / 10 for s in range(10)])
