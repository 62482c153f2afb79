"""The Ray tier's chaos runs replayed on the simulated cluster: the Controller and its policies,
unchanged, make the same decisions, write the same incidents and train the same samples as
they did on Ray.

Each run in tests/chaos_records/ was kept by its Ray test (``make chaos-records``); the replay
strikes the same faults at the same steps (``tests.chaos_replay``) on a cluster with the room
the Ray test's had. Ray's Recovery and the simulated cluster both carry out the plans of one
function (``policies.recovery.plan_recovery``), each answering its view of the cluster: every
incident's plan is the same on both.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.chaos_replay import RECORDS, decisions, plans, replay, scenarios

# The workers each Ray test's cluster had room for beside the job's own and its spares (0.5 CPU a worker).
FREE_SLOTS = {
    # test_elastic: three 1-CPU nodes for 4 workers and a spare
    "crash_replaced_by_a_spare_then_nan": 1,
    # test_elastic: two 1-CPU nodes, one replica on each, nothing spare
    "node_lost_shrink_nan_skip_grow": 0,
    # test_recovery_retry: three 1-CPU nodes for 4 workers and 2 spares
    "death_inside_the_recovery": 0,
    # test_stragglers: 3 CPUs for 4 workers and a spare
    "straggler_replaced_by_a_spare": 1,
    # test_hangs_sdc: 3 CPUs for 4 workers
    "three_stalls_then_a_bitflip": 2,
}


def test_every_chaos_scenario_of_the_ray_tier_is_kept() -> None:
    assert scenarios() == sorted(FREE_SLOTS)


@pytest.mark.parametrize("scenario", sorted(FREE_SLOTS))
def test_the_simulated_cluster_decides_as_the_ray_run_did(scenario: str, tmp_path: Path) -> None:
    kept = RECORDS / scenario
    simulated = replay(kept, tmp_path, FREE_SLOTS[scenario])

    on_ray, replayed = decisions(kept), decisions(simulated)
    assert replayed["incidents"] == on_ray["incidents"]
    assert replayed["resizes"] == on_ray["resizes"]
    assert replayed["steps"] == on_ray["steps"]
    assert (replayed["status"], replayed["final_step"], replayed["dp"]) == (on_ray["status"], on_ray["final_step"], on_ray["dp"])
    assert replayed["ledger"] == on_ray["ledger"]


@pytest.mark.parametrize("scenario", sorted(FREE_SLOTS))
def test_the_simulated_cluster_carries_out_the_recovery_plans_the_ray_run_did(scenario: str, tmp_path: Path) -> None:
    kept = RECORDS / scenario
    on_ray = plans(kept)
    assert any(plan is not None for plan in on_ray)  # every kept run recovered at least once

    assert plans(replay(kept, tmp_path, FREE_SLOTS[scenario])) == on_ray
