"""Stragglers: a rank persistently slower than its peers is named, reported or evicted.

The policy runs on synthetic per-rank compute times (seeded noise, no sleeps); the Controller
runs on the scripted elastic group of test_controller, its reports given compute times.
"""

from __future__ import annotations

import dataclasses
import random
import statistics
from pathlib import Path
from typing import Any, Callable, Optional

import pytest

from ringtrain.actors.steps import StepResult
from ringtrain.chaos import FaultPlan, FaultSpec
from ringtrain.policies.faults import Action, Capacity, Failure, Kind, decide
from ringtrain.policies.stragglers import StragglerWatch, peer_medians, slowdowns
from ringtrain.status import StepReport

from tests.unit.controller_fakes import ElasticGroup, elastic_job, elastic_run, incident_files, reform_call, whole

FACTOR, STEPS = 1.5, 3


def noisy(rng: random.Random, ranks: int, *, slow: Optional[int] = None, by: float = 1.0) -> dict[int, float]:
    """One step's compute times: ~0.2 s with 10% log-normal jitter per rank."""
    return {r: 0.2 * rng.lognormvariate(0.0, 0.1) * (by if r == slow else 1.0) for r in range(ranks)}


@pytest.mark.parametrize("seed", range(10))
def test_a_persistent_straggler_is_named_within_straggler_steps_plus_one(seed: int) -> None:
    rng = random.Random(seed)
    ranks, culprit, first_slow = 8, rng.randrange(8), 40
    watch = StragglerWatch(FACTOR, STEPS)
    found = None
    for step in range(1, 80):
        times = noisy(rng, ranks, slow=culprit if step >= first_slow else None, by=2.0)
        found = watch.observe(step, times)
        if found is not None:
            break
    assert found is not None and found.rank == culprit
    assert step - first_slow + 1 <= STEPS + 1, step
    assert found.steps == tuple(range(step - STEPS + 1, step + 1)) and found.slowdown >= FACTOR


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("ranks", [2, 4, 8])
def test_no_false_report_over_200_clean_steps(seed: int, ranks: int) -> None:
    rng = random.Random(seed)
    watch = StragglerWatch(FACTOR, STEPS)
    # Clean but noisy: jitter, plus one rank at a time hiccuping 1.6x for a single step.
    reports = []
    for step in range(1, 201):
        times = noisy(rng, ranks, slow=rng.randrange(ranks) if step % 7 == 0 else None, by=1.6)
        reports.append(watch.observe(step, times))
    assert reports == [None] * 200


def test_a_streak_is_named_once_and_again_only_after_it_ended() -> None:
    watch = StragglerWatch(FACTOR, 2)
    slow, even = {0: 0.1, 1: 0.3}, {0: 0.1, 1: 0.1}
    seen = [watch.observe(step, slow if step != 5 else even) for step in range(1, 9)]
    assert [(s.rank, s.steps) if s else None for s in seen] == [
        None, (1, (1, 2)), None, None, None, None, (1, (6, 7)), None,
    ]
    watch.reset()
    assert watch.observe(9, slow) is None  # a new world starts its evidence again


def test_slowdowns_compare_each_rank_with_its_peers_median() -> None:
    assert slowdowns({0: 1.0, 1: 1.0, 2: 3.0}) == {0: 0.5, 1: 0.5, 2: 3.0}
    assert slowdowns({0: 0.5}) == {0: 1.0}
    assert slowdowns({0: 0.0, 1: 0.0}) == {0: 1.0, 1: 1.0}


def test_eviction_takes_a_spare_else_shrinks_else_only_reports() -> None:
    straggler = Failure(Kind.STRAGGLER, (3,), "slow")
    assert straggler.lost_workers and straggler.quarantine and not straggler.suspect_devices
    common: dict[str, Any] = dict(dp=2, cp=2, recoveries=0, max_recoveries=5, on_nan="skip")
    assert decide(straggler, min_dp=1, capacity=Capacity(1, 0), **common).action is Action.REPLACE
    assert decide(straggler, min_dp=1, capacity=Capacity(0, 0), **common).action is Action.SHRINK
    # No spare, cannot shrink: starting a new worker would not help a slow device; it stays.
    assert decide(straggler, min_dp=2, capacity=Capacity(0, 4), **common).action is Action.REPORT


def test_a_slow_fault_with_count_fires_on_consecutive_steps() -> None:
    plan = FaultPlan([FaultSpec(kind="slow", rank=1, step=3, seconds=0.5, count=3), FaultSpec(kind="nan", rank=1, step=4)])
    fired = {step: [f.kind for f in plan.take(1, step)] for step in range(1, 8)}
    assert fired == {1: [], 2: [], 3: ["slow"], 4: ["slow", "nan"], 5: ["slow"], 6: [], 7: []}
    assert not plan
    assert plan.take(1, 4) == []  # each step fires once


class SlowGroup(ElasticGroup):
    """Rank ``slow`` computes 3x as long as its peers from step ``from_step`` on, until a new
    world is formed (it left with its worker)."""

    def __init__(self, *args: Any, slow: int, from_step: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.slow, self.from_step = slow, from_step

    def train_step(self, probe: bool = False, on_safe: Optional[Callable[[int], None]] = None) -> StepResult:
        result = super().train_step(probe, on_safe)
        if result.failed:
            return result
        step = result.reports[0].step
        slow = self.slow if self.slow is not None and step >= self.from_step else None
        return StepResult(reports=tuple(dataclasses.replace(r, compute_s=0.3 if r.rank == slow else 0.1) for r in result.reports))

    def restore_to(self, newest: int) -> int:
        self.slow = None  # evicted: a fast worker sits there now
        return super().restore_to(newest)


def slow_run(tmp_path: Path, on_straggler: str, **elastic: Any) -> tuple[dict[str, Any], Any]:
    import ringtrain.actors.controller as controller_module
    from ringtrain.telemetry.rundir import RunDir

    from tests.unit import controller_fakes as tc

    job = elastic_job(mesh={"spares": elastic.get("spares", 0), "min_dp": elastic.pop("min_dp", 1)},
                      on_straggler=on_straggler, straggler_steps=STEPS)
    clock = tc.Clock()
    group = SlowGroup(job, clock, slow=3, from_step=3)
    fake = tc.FakeElastic(group, tmp_path, **elastic)
    summary = controller_module.Controller(job, group, RunDir(tmp_path), elastic=fake, clock=clock).run()
    return summary, fake


def test_report_names_the_straggler_and_training_goes_on(tmp_path: Path) -> None:
    summary, fake = slow_run(tmp_path, "report")

    assert summary["status"] == "finished" and summary["recoveries"] == [] and fake.named("reform") == []
    (incident,) = incident_files(tmp_path).values()
    assert (incident["kind"], incident["ranks"], incident["action"], incident["detected_at_step"]) == ("straggler", [3], "report", 5)
    found = incident["verdict"]["straggler"]
    assert (found["rank"], found["replica"], found["ring_pos"], found["host"], found["steps"]) == (3, 1, 1, "h", [3, 4, 5])
    assert found["slowdown"] == pytest.approx(3.0)


def test_evict_seats_a_warm_spare_in_place_of_the_straggler_and_quarantines_its_slot(tmp_path: Path) -> None:
    summary, fake = slow_run(tmp_path, "evict", spares=1)

    assert summary["status"] == "finished" and summary["ledger"] == whole(8)
    # Evicted after step 5 completed: nothing to redo, the restore point is step 5 itself.
    assert fake.named("reform") == [reform_call({3}, new_dp=2, spares=1, last_step=5, fired_through=5, quarantine=True)]
    assert fake.named("capacity") == [{"lost": (3,), "reuse_slots": False}]
    (recovery,) = summary["recoveries"]
    assert (recovery["kind"], recovery["action"], recovery["lost_steps"]) == ("straggler", "replace", 0)


def test_off_watches_nothing(tmp_path: Path) -> None:
    summary, _ = slow_run(tmp_path, "off")
    assert summary["incidents"] == [] and summary["status"] == "finished"


@pytest.mark.parametrize(
    "controllers, key",
    [({"on_straggler": "kick"}, "controllers.on_straggler"), ({"straggler_factor": 1.0}, "controllers.straggler_factor"),
     ({"straggler_steps": 0}, "controllers.straggler_steps")],
)
def test_bad_straggler_settings_name_their_key(controllers: dict[str, Any], key: str) -> None:
    from ringtrain.errors import ConfigError

    with pytest.raises(ConfigError) as err:
        elastic_job(**controllers)
    assert err.value.key == key


@pytest.mark.parametrize("seed", range(6))
def test_peer_medians_are_each_ranks_peers_median(seed: int) -> None:
    """Against the median of each rank's peers taken one rank at a time: ties, an even and an
    odd number of peers, two ranks."""
    rng = random.Random(seed)
    n = [2, 3, 4, 7, 10, 33][seed]
    compute = {r: float(rng.choice([0.5, 1.0, 1.0, 2.0, rng.random()])) for r in range(n)}
    expected = {r: statistics.median([t for q, t in compute.items() if q != r]) for r in compute}
    assert peer_medians(compute) == pytest.approx(expected, rel=0, abs=1e-15)
