"""Sample ledger: recording kept steps, striking rolled-back ones, skips, and the totals that
prove nothing was lost or repeated. Batches of 4: step s (1-based) trains samples
[4(s-1), 4s) unless the test says otherwise."""

from __future__ import annotations

import pytest

from ringtrain.policies.ledger import SampleLedger

G = 4


def batch(cursor: int) -> tuple[int, ...]:
    return tuple(range(cursor * G, (cursor + 1) * G))


def run(steps: int) -> SampleLedger:
    ledger = SampleLedger()
    for s in range(1, steps + 1):
        ledger.record(s, batch(s - 1))
    return ledger


def test_an_empty_ledger_totals_zero() -> None:
    assert SampleLedger().totals() == {"steps": 0, "samples": 0, "duplicates": 0, "skipped": 0, "missing": 0}


def test_contiguous_steps_account_for_every_sample_once() -> None:
    assert run(5).totals() == {"steps": 5, "samples": 20, "duplicates": 0, "skipped": 0, "missing": 0}


def test_rollback_strikes_the_later_steps_and_says_which() -> None:
    ledger = run(6)

    assert ledger.rollback(3) == [4, 5, 6]
    assert sorted(ledger.steps) == [1, 2, 3]
    assert ledger.totals()["samples"] == 12


@pytest.mark.parametrize("to_step, struck", [(6, []), (9, []), (0, [1, 2, 3, 4, 5, 6])])
def test_rollback_at_or_past_the_end_strikes_nothing_and_to_zero_everything(to_step: int, struck: list[int]) -> None:
    ledger = run(6)

    assert ledger.rollback(to_step) == struck
    assert len(ledger.steps) == 6 - len(struck)


def test_redoing_struck_steps_on_the_same_samples_repeats_nothing() -> None:
    ledger = run(5)
    ledger.rollback(2)
    for s in range(3, 7):  # steps 3..6 again, on the batches they had (cursor = step - 1)
        ledger.record(s, batch(s - 1))

    assert ledger.totals() == {"steps": 6, "samples": 24, "duplicates": 0, "skipped": 0, "missing": 0}


def test_recording_a_step_again_replaces_its_samples() -> None:
    ledger = run(2)
    ledger.record(2, batch(5))

    # Step 2 now holds 20..23: 4..7 are gone, leaving a gap between 3 and 20 of 16 samples.
    assert ledger.steps[2] == batch(5)
    assert ledger.totals() == {"steps": 2, "samples": 8, "duplicates": 0, "skipped": 0, "missing": 16}


@pytest.mark.parametrize(
    "steps, duplicates",
    [
        ({1: (0, 1), 2: (1, 2)}, 1),  # sample 1 twice
        ({1: (0, 1), 2: (0, 1), 3: (0, 1)}, 4),  # two samples, three times each: 2 + 2 extra
        ({1: (0, 1, 2), 2: (3, 4, 5)}, 0),
    ],
)
def test_duplicates_count_the_extra_uses(steps: dict[int, tuple[int, ...]], duplicates: int) -> None:
    ledger = SampleLedger()
    for s, samples in steps.items():
        ledger.record(s, samples)

    assert ledger.totals()["duplicates"] == duplicates


def test_a_step_never_recorded_leaves_its_samples_missing() -> None:
    ledger = SampleLedger()
    for s in (1, 2, 4):  # step 3 (samples 8..11) lost
        ledger.record(s, batch(s - 1))

    assert ledger.totals() == {"steps": 3, "samples": 12, "duplicates": 0, "skipped": 0, "missing": 4}


def test_a_skipped_batch_is_accounted_for_not_missing() -> None:
    # Step 3's batch (cursor 2) was poisoned and skipped: step 3 then trained cursor 3, and so on.
    ledger = run(2)
    ledger.skip(range(8, 12))
    for s in range(3, 5):
        ledger.record(s, batch(s))

    assert ledger.totals() == {"steps": 4, "samples": 16, "duplicates": 0, "skipped": 4, "missing": 0}
    assert ledger.skipped == [8, 9, 10, 11]


def test_a_skipped_batch_that_a_kept_step_trained_anyway_is_a_duplicate() -> None:
    # The skip was recorded, but the batch was trained all the same (a skip that did not happen).
    ledger = run(2)
    ledger.skip(range(4, 8))

    assert ledger.totals() == {"steps": 2, "samples": 8, "duplicates": 4, "skipped": 4, "missing": 0}


def test_skipping_the_same_batch_twice_counts_its_samples_once() -> None:
    ledger = run(1)
    ledger.skip(range(4, 8))
    ledger.skip(range(4, 8))

    assert ledger.totals()["skipped"] == 4


def test_a_resumed_run_is_not_missing_the_samples_before_it() -> None:
    # Resumed after step 10: the first step here is 11, samples 40..43.
    ledger = SampleLedger()
    for s in range(11, 14):
        ledger.record(s, batch(s - 1))

    assert ledger.totals() == {"steps": 3, "samples": 12, "duplicates": 0, "skipped": 0, "missing": 0}


def test_only_skips_account_for_a_span() -> None:
    ledger = SampleLedger()
    ledger.skip(range(0, 4))
    ledger.skip(range(8, 12))

    assert ledger.totals() == {"steps": 0, "samples": 0, "duplicates": 0, "skipped": 8, "missing": 4}
