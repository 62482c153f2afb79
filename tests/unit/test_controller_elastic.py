"""Elastic dp, against the scripted world of controller_fakes: workers.json follows each change,
the job grows back when capacity has stayed, only to a dp that divides the global batch, and a
shrink lands on one.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from ringtrain.actors.controller import Controller
from ringtrain.telemetry.rundir import RunDir

from tests.unit.controller_fakes import GROW_S, Clock, ElasticGroup, FakeElastic, Fault, elastic_job, elastic_run, whole


def test_workers_json_follows_the_layout_after_each_change(tmp_path: Path) -> None:
    clock = Clock()
    job = elastic_job(mesh={"min_dp": 1})
    group = ElasticGroup(job, clock, {3: [Fault("crash", 3)]})
    fake = FakeElastic(group, tmp_path)
    run_dir = RunDir(tmp_path)
    layouts: list[dict[str, Any]] = []
    write_workers = run_dir.write_workers

    def spy(layout: dict[str, Any]) -> None:
        layouts.append(layout)
        write_workers(layout)

    run_dir.write_workers = spy  # type: ignore[method-assign]
    Controller(job, group, run_dir, elastic=fake, clock=clock).run()

    # Once at the start (dp 2, ranks 0-3), once after the shrink to dp 1.
    assert layouts == [{"dp": 2, "ranks": [0, 1, 2, 3]}, {"dp": 1, "ranks": [0, 1]}]
    assert json.loads((tmp_path / "workers.json").read_text()) == layouts[-1]


@pytest.mark.parametrize(
    "heartbeat_s, warm_polls, polls, grown_after",
    [
        # The shrink resumes after step 2; capacity is free from t=5.0. Checks every step
        # (heartbeat 1 s = one step): seen after step 3 (t=5.25), the gate opens 3 s later after
        # step 6, workers are prepared, ready at the next poll: grown after step 7.
        (1.0, 0, 4, 7),
        # Ready only at the third poll: after step 9.
        (1.0, 2, 4, 9),
        # Checks every 2 s: after steps 3, 5, 7 (t=5.25, 7.25, 9.25); the gate opens after step 7.
        (2.0, 0, 3, 8),
    ],
    ids=["every-step", "slow-warmup", "every-other-step"],
)
def test_after_a_shrink_the_job_grows_back_when_capacity_has_stayed(
    tmp_path: Path, heartbeat_s: float, warm_polls: int, polls: int, grown_after: int
) -> None:
    job = elastic_job(train={"steps": 10}, mesh={"min_dp": 1}, grow_after_s=3.0, heartbeat_s=heartbeat_s)
    summary, _, fake = elastic_run(
        tmp_path, job, faults={3: [Fault("crash", 2)]}, capacity_from=5.0, warm_polls=warm_polls
    )

    assert (summary["status"], summary["final_step"], summary["dp"]) == ("finished", 10, 2)
    # Capacity is only looked for while dp < max_dp (= mesh.dp = 2), never once grown back.
    assert len(fake.named("growth_capacity")) == polls
    assert fake.named("prepare_growth") == [{"replicas": 1}]
    assert fake.named("grow") == [{"new_dp": 2, "last_step": grown_after}]
    (resize,) = summary["resizes"]
    assert (resize["step"], resize["dp_before"], resize["dp_after"]) == (grown_after, 1, 2)
    assert resize["seconds"] == pytest.approx(GROW_S)
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    dps = [2, 2] + [1] * (grown_after - 2) + [2] * (10 - grown_after)
    assert [r["dp"] for r in lines] == dps
    assert summary["ledger"] == whole(10)
    assert json.loads((tmp_path / "workers.json").read_text())["dp"] == 2


def test_a_grow_waits_for_a_step_that_took_a_snapshot(tmp_path: Path) -> None:
    """The grown world loads the state of the step it grows at: with a snapshot every 2 steps,
    the replicas ready after step 7 (as in the every-step case above) join after step 8."""
    job = elastic_job(train={"steps": 10}, mesh={"min_dp": 1}, grow_after_s=3.0, heartbeat_s=1.0)
    summary, _, fake = elastic_run(tmp_path, job, faults={3: [Fault("crash", 2)]}, snapshot_every=2, capacity_from=5.0)

    assert (summary["status"], summary["final_step"], summary["dp"]) == ("finished", 10, 2)
    assert fake.named("grow") == [{"new_dp": 2, "last_step": 8}]
    assert len(fake.named("growth_ready")) == 2  # ready after step 7, held for step 8's snapshot
    assert summary["ledger"] == whole(10)


def test_a_run_without_snapshots_never_grows(tmp_path: Path) -> None:
    """checkpoint.snapshot_every=0: no state to reshard into a grown world, so no workers are
    started for one however long capacity stays."""
    job = elastic_job(mesh={"max_dp": 4}, train={"global_batch": 8}, grow_after_s=0.0)
    job = dataclasses.replace(job, checkpoint=dataclasses.replace(job.checkpoint, snapshot_every=0))
    summary, _, fake = elastic_run(tmp_path, job, capacity_from=0.0, capacity_replicas=2)

    assert summary["status"] == "finished" and summary["dp"] == 2
    assert fake.named("growth_capacity") == [] and fake.named("prepare_growth") == [] and fake.named("grow") == []


def test_no_growth_when_capacity_never_returns(tmp_path: Path) -> None:
    job = elastic_job(mesh={"min_dp": 1}, grow_after_s=0.0)
    summary, _, fake = elastic_run(tmp_path, job, faults={3: [Fault("crash", 2)]})

    assert summary["dp"] == 1 and summary["resizes"] == []
    assert fake.named("prepare_growth") == [] and fake.named("grow") == []


@pytest.mark.parametrize(
    "capacity_replicas, grown",
    # Global batch 8 allows dp 1, 2, 4 (not 3): one replica's worth of capacity more than dp 2
    # cannot be used; two replicas' worth grows the job to 4. grow_after_s=0: the first check,
    # after step 1, opens the gate; the prepared workers are ready at the poll after step 2.
    [(1, []), (2, [{"new_dp": 4, "last_step": 2}])],
    ids=["dp-3-not-allowed", "dp-4"],
)
def test_a_job_below_max_dp_grows_only_to_an_allowed_dp(tmp_path: Path, capacity_replicas: int, grown: list[dict[str, int]]) -> None:
    job = elastic_job(mesh={"max_dp": 4}, train={"global_batch": 8}, grow_after_s=0.0)
    summary, _, fake = elastic_run(tmp_path, job, capacity_from=0.0, capacity_replicas=capacity_replicas)

    assert fake.named("grow") == grown
    assert summary["dp"] == (4 if grown else 2)
    assert fake.named("prepare_growth") == ([{"replicas": 2}] if grown else [])
    assert summary["ledger"] == whole(8, global_batch=8)



def test_a_shrink_lands_on_a_dp_that_divides_the_global_batch(tmp_path: Path) -> None:
    # Global batch 8, micro-batch 1: allowed dps are 1, 2, 4. Losing replica 3 of 4 leaves 3
    # replicas' worth; the largest allowed dp that fits is 2.
    job = elastic_job(mesh={"dp": 4, "cp": 1, "min_dp": 1}, train={"global_batch": 8})
    summary, _, fake = elastic_run(tmp_path, job, faults={2: [Fault("crash", 3)]})

    assert [call["new_dp"] for call in fake.named("reform")] == [2]
    assert summary["dp"] == 2
    assert summary["ledger"] == whole(8, global_batch=8)
