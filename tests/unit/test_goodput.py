"""Goodput under failures (planner.goodput, actors.decisions, `ringtrain plan --goodput`): the
timeline against first-order formulas for the same job, the Controller's decisions on the
simulated cluster against those the Controller's own tests and the Ray tier's chaos runs
assert, and the command's output and errors."""

from __future__ import annotations

import json
import statistics
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest

from ringtrain import cli, config
from ringtrain.actors.decisions import ControllerDecisions
from ringtrain.commands.plan import MAX_FAILURES_PER_RUN, PROGRESS_AFTER_S, PROGRESS_EVERY_S, StudyProgress
from ringtrain.planner.failures import LLAMA3, META_RSC, FailureProfile
from ringtrain.planner.goodput import Costs, Job, Recovery, simulate
from ringtrain.planner.goodput_report import Setting, duration, persist_steps

REPO = Path(__file__).resolve().parents[2]

HOUR = 3600.0


def only(kind: str, mtbf_h: float, gpus: int) -> FailureProfile:
    """Failures of one ``kind``, one every ``mtbf_h`` hours on ``gpus`` GPUs."""
    return FailureProfile(kind, "test", {kind: 1.0 / (mtbf_h * gpus)})


class Replace:
    """A decider that always seats warm spares (one per GPU lost) and never shrinks."""

    def recover(self, kind: str, *, dp: int, spares: int, free_gpus: int) -> Recovery:
        return Recovery("replace", dp, 0, 0)

    def grow_to(self, *, dp: int, free_gpus: int) -> int:
        return dp


def test_the_llama3_profile_gives_its_419_interruptions_in_54_days_on_16384_gpus() -> None:
    assert 54 * 24 / LLAMA3.mtbf_h(16_384) == pytest.approx(419)
    assert LLAMA3.per_gpu_hour["device"] / LLAMA3.total_per_gpu_hour == pytest.approx(0.573)
    # 6.50 failures per 1,000 node-days of 8 GPUs
    assert 1000 * 8 * 24 / META_RSC.mtbf_h(1) == pytest.approx(6.50)


def test_restart_mode_matches_the_first_order_model() -> None:
    """Lost per failure: detection, the restart, the step in flight and, on average, half a
    checkpoint interval; and one blocking save per interval (Young 1974's terms)."""
    job = Job(dp=64, gpus_per_replica=8, step_s=10.0, persist_every_s=1800.0)
    costs = Costs(detect_s=20.0, restart_s=600.0, save_s=30.0)
    mtbf_s = 10 * HOUR
    runs = [simulate(job, only("device", 10, job.gpus), costs, mode="restart", days=60, seed=s) for s in range(40)]
    saving = costs.save_s / (job.persist_every_s + costs.save_s)
    per_failure = costs.detect_s + costs.restart_s + job.step_s / 2 + job.persist_every_s / 2
    # Failures strike only while the job trains: one every mtbf of training time.
    expected = (1 - saving) * mtbf_s / (mtbf_s + per_failure)
    assert statistics.fmean(r.ettr for r in runs) == pytest.approx(expected, abs=0.003)
    assert sum(r.lost_s["checkpoints"] for r in runs) > 0 and all(r.lost_s["shrunk"] == 0 for r in runs)


def test_ringtrain_mode_with_spares_matches_the_first_order_model() -> None:
    """Per failure: detection, a re-form, the step in flight and half the steps between
    snapshots; every snapshot makes its step snapshot_overhead longer."""
    job = Job(dp=64, gpus_per_replica=8, step_s=30.0, spares=8, snapshot_every=16)
    costs = Costs(detect_s=20.0, reform_s=120.0, snapshot_overhead=0.05)
    mtbf_s = 5 * HOUR
    runs = [simulate(job, only("device", 5, job.gpus), costs, mode="ringtrain", days=60, seed=s, decider=Replace()) for s in range(40)]
    snapshots = costs.snapshot_overhead / (job.snapshot_every + costs.snapshot_overhead)
    per_failure = costs.detect_s + costs.reform_s + job.step_s / 2 + job.step_s * (job.snapshot_every - 1) / 2
    expected = (1 - snapshots) * mtbf_s / (mtbf_s + per_failure)
    assert statistics.fmean(r.ettr for r in runs) == pytest.approx(expected, abs=0.003)


def test_a_shrunk_job_trains_slower_until_repaired_gpus_grow_it_back() -> None:
    class Shrink(Replace):
        def recover(self, kind: str, *, dp: int, spares: int, free_gpus: int) -> Recovery:
            return Recovery("shrink", dp - 1, 0, 0)

        def grow_to(self, *, dp: int, free_gpus: int) -> int:
            return dp + free_gpus // 8

    job = Job(dp=4, gpus_per_replica=8, step_s=10.0)
    costs = Costs(repair_s=2 * HOUR)
    run = simulate(job, only("node", 24, job.gpus), costs, mode="ringtrain", days=30, seed=0, decider=Shrink())
    assert run.actions["shrink"] == run.actions["grow"] or run.actions["shrink"] == run.actions["grow"] + 1
    # A quarter of the job is gone for each repair's two hours, give or take the last one.
    shrunk_h = run.lost_s["shrunk"] / HOUR
    assert shrunk_h == pytest.approx(run.actions["shrink"] * 2 / 4, rel=0.15)


def test_failures_strike_at_the_rate_of_the_gpus_at_work_through_shrinks_and_grows() -> None:
    """A shrunk job fails less often, and as often as before once grown back: a failure drawn
    while it was small must not outlast the grow."""

    class HalveAndRegrow(Replace):
        def recover(self, kind: str, *, dp: int, spares: int, free_gpus: int) -> Recovery:
            return Recovery("shrink", dp // 2, 0, 0)

        def grow_to(self, *, dp: int, free_gpus: int) -> int:
            return 2 * dp if free_gpus >= 8 * dp else dp  # back once the failed GPU is repaired

    job = Job(dp=4, gpus_per_replica=8, step_s=10.0)
    costs = Costs(repair_s=0.5 * HOUR)
    runs = [simulate(job, only("device", 12, job.gpus), costs, mode="ringtrain", days=30, seed=s, decider=HalveAndRegrow()) for s in range(100)]
    # Up time at full size counts whole, at half size half: up time less the "shrunk" loss.
    down = ("detection", "recovery", "recomputation", "resizes")
    expected = [(r.wall_s - sum(r.lost_s[c] for c in down) - r.lost_s["shrunk"]) / (12 * HOUR) for r in runs]
    assert statistics.fmean(sum(r.failures.values()) for r in runs) == pytest.approx(statistics.fmean(expected), rel=0.05)


def job_config(dp: int, cp: int, *, min_dp: int = 1, global_batch: int = 0) -> config.JobConfig:
    job = config.JobConfig(
        mesh=config.MeshConfig(dp=dp, cp=cp, min_dp=min_dp),
        train=config.TrainConfig(global_batch=global_batch or 2 * dp, steps=10),
    )
    config.validate(job)
    return job


@pytest.mark.parametrize(
    "kind, spares, free, min_dp, expected",
    [
        # A crash with a warm spare: the spare takes the seat (test_elastic's killed worker).
        ("device", 1, 0, 1, Recovery("replace", 4, 1, 0)),
        # No spare: the replica goes, to the largest dp the global batch allows (8 / 3 is not whole).
        ("device", 0, 0, 1, Recovery("shrink", 2, 0, 0)),
        # At min_dp, an idle GPU starts a new worker; with none the run cannot go on.
        ("device", 0, 1, 4, Recovery("replace", 4, 0, 0)),
        ("device", 0, 0, 4, Recovery("abort", 4, 0, 0)),
        # A lost node takes both ranks on it: one spare is not enough (test_elastic's lost node).
        ("node", 1, 0, 1, Recovery("shrink", 2, 0, 0)),
        ("node", 2, 0, 1, Recovery("replace", 4, 2, 0)),
        # A software error rolls back in place; a corrupt device is evicted after its scan, the
        # step it corrupted redone (test_hangs_sdc's bitflip).
        ("software", 0, 0, 1, Recovery("rollback", 4, 0, 0)),
        ("sdc", 1, 0, 1, Recovery("replace", 4, 1, 1)),
    ],
)
def test_the_controller_decides_as_its_own_tests_and_the_chaos_runs_expect(
    kind: str, spares: int, free: int, min_dp: int, expected: Recovery
) -> None:
    decisions = ControllerDecisions(job_config(4, 2, min_dp=min_dp), gpus_per_node=2)
    assert decisions.recover(kind, dp=4, spares=spares, free_gpus=free) == expected


def test_decisions_are_replayed_once_per_state_that_can_change_them() -> None:
    decisions = ControllerDecisions(job_config(4, 2), gpus_per_node=2)
    first = decisions.recover("device", dp=4, spares=5, free_gpus=9)
    assert decisions.recover("device", dp=4, spares=2, free_gpus=2) == first  # both past a node's 2 GPUs
    assert decisions.replays == 1
    assert decisions.grow_to(dp=2, free_gpus=4) == 4 and decisions.grow_to(dp=2, free_gpus=2) == 2  # 3 does not divide 8


def plan(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = cli.main(["plan", "--model", "llama3-8b", "--seq-len", "8192", "--gpus", "64", "--goodput", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_plan_goodput_prints_the_ettr_its_spread_and_the_best_settings(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    chart = tmp_path / "goodput.svg"
    code, out, _ = plan(capsys, "--days", "3", "--seeds", "2", "--chart", str(chart))
    assert code == 0
    assert "recovery: ringtrain (each failure handled as ringtrain's Controller decides" in out and "over seeds" in out
    assert "best setting:" in out and "GPU-hours lost per run" in out
    svg = ET.fromstring(chart.read_text())
    assert len([e for e in svg.iter() if e.tag.endswith("polyline")]) == 5  # a line per spares count


def test_plan_goodput_json_holds_the_ettr_and_the_breakdown(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = plan(capsys, "--days", "3", "--seeds", "2", "--recovery", "restart", "--json")
    assert code == 0
    record: dict[str, Any] = json.loads(out)
    assert 0 < record["ettr"] <= 1 and record["mode"] == "restart" and record["controller_replays"] is None
    assert set(record["given"]["lost_gpu_hours"]) >= {"detection", "recovery", "recomputation", "checkpoints"}
    assert record["best"] == record["swept"][0] and all(record["best"]["goodput"] >= r["goodput"] for r in record["swept"])


def test_the_best_setting_is_a_run_line_of_the_jobs_own_keys(capsys: pytest.CaptureFixture[str]) -> None:
    """The best setting as a person sets it: whole steps for both cadences, spares counted in
    GPUs, and a `run:` line whose every override a job accepts."""
    code, out, _ = plan(capsys, "--days", "3", "--seeds", "1")
    assert code == 0
    run = next(line for line in out.splitlines() if line.startswith("run: "))
    assert run.startswith("run: ringtrain run JOB.yaml mesh.dp=")
    overrides = run.split()[4:]
    keys = dict(o.split("=", 1) for o in overrides)
    assert {"mesh.spares", "checkpoint.snapshot_every", "checkpoint.persist_every"} <= set(keys)
    assert all(keys[k].isdigit() for k in ("mesh.spares", "checkpoint.snapshot_every", "checkpoint.persist_every"))
    # Every key is one a job has (the preset's sequence and 4M-token batch given, as a job file would).
    job = config.load(REPO / "jobs" / "quickstart.yaml", [*overrides, "data.seq_len=8192", "train.global_batch=512"])
    assert job.mesh.spares == int(keys["mesh.spares"])
    # No job file: durable checkpoints every 30 min of the planner's step, in whole steps.
    step_s = float(json.loads(plan(capsys, "--days", "3", "--seeds", "1", "--json")[1])["step_s"])
    assert abs(job.checkpoint.persist_every * step_s - 1800) < 0.05 * 1800
    assert "warm spare" in out and "(steps: a durable checkpoint every" in out
    assert "replayed" not in out and "e-0" not in out  # no jargon, no 9.2e-07 h


def test_a_cadence_is_rounded_to_what_a_person_sets() -> None:
    assert persist_steps(Setting(0, 1, 1800.0), 8.37) == 220  # 215.1 steps
    assert persist_steps(Setting(0, 1, 50 * 3.2e-05), 3.2e-05) == 50
    assert persist_steps(Setting(0, 1, 1e-9), 1.0) == 1  # never 0: a key of 0 means "only at the end"
    assert persist_steps(Setting(0, 16, 1800.0), 8.37) == 224  # a multiple of snapshot_every, as a job's check asks
    assert persist_steps(Setting(0, 16, 1.0), 8.37) == 16
    assert [duration(x) for x in (1.6e-3, 25.0, 1850.0, 3599.0, 5400.0, 3 * 86400)] == ["1.6 ms", "25 s", "31 min", "1 h", "1.5 h", "3 days"]


def test_the_json_holds_each_settings_keys_and_the_run_line(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = plan(capsys, "--days", "3", "--seeds", "1", "--json")
    record = json.loads(out)
    assert code == 0 and record["run"].startswith("ringtrain run JOB.yaml ")
    best = record["best"]["config"]
    assert record["run"].endswith(" ".join(f"{k}={v}" for k, v in best.items()))
    assert best["mesh.spares"] == record["best"]["spares"]


def test_goodput_on_a_gpu_count_no_layout_divides_names_the_divisibility(capsys: pytest.CaptureFixture[str]) -> None:
    code = cli.main(["plan", str(REPO / "jobs" / "quickstart.yaml"), "--gpus", "1000", "--goodput"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert "no layout fits quickstart at 2048 tokens on 1000 GPUs: " in err
    assert "data.seq_len=2048 must divide by 2 x cp" in err


def test_a_long_study_says_how_far_it_got() -> None:
    now = [0.0]
    lines: list[str] = []
    progress = StudyProgress(clock=lambda: now[0], out=lines.append)
    for done in range(1, 100):
        now[0] = done * 0.5
        progress(done, 100)
    # Quiet for the first seconds, then a line every PROGRESS_EVERY_S.
    expected = 1 + int((49.5 - (PROGRESS_AFTER_S + 0.5)) // PROGRESS_EVERY_S)
    assert len(lines) == expected and lines[0] == "ringtrain plan: simulated 6 of 100 runs in 3 s, about 47 s left"
    assert StudyProgress(clock=lambda: 0.0, out=lines.append) and len(lines) == expected


@pytest.mark.parametrize(
    "args, flag",
    [
        (["--recovery", "pray"], "--recovery"),
        (["--failures", "nowhere.json"], "--failures"),
        (["--days", "0"], "--days"),
        (["--days", "inf"], "--days"),
        (["--days", "nan"], "--days"),
        (["--days", "1e9"], "--days"),
        (["--seeds", "none"], "--seeds"),
        (["--seeds", "101"], "--seeds"),
        (["--gpus", "1000000000"], "--gpus"),
        (["--gpus-per-node", "1000000000"], "--gpus-per-node"),
        (["--step-s", "-1"], "--step-s"),
        (["--step-s", "inf"], "--step-s"),
        (["--max-seq-len"], "--goodput"),
        # Before the simulation, not when its chart is written after it.
        (["--chart", "no-such-folder/goodput.svg"], "--chart"),
        (["--chart", "."], "--chart"),
    ],
)
def test_bad_goodput_input_exits_2_naming_the_flag(capsys: pytest.CaptureFixture[str], args: list[str], flag: str) -> None:
    code, out, err = plan(capsys, *args)
    assert code == 2 and f"config error: {flag}: " in err and "Traceback" not in err
    assert out == "" and err.count("\n") == 1


@pytest.mark.parametrize(
    "rates, costs, flag, says",
    [
        ({"device": float("inf")}, {}, "--failures", "rates must be finite"),
        ({"device": float("nan")}, {}, "--failures", "rates must be finite"),
        # Finite, but a timeline of millions of failures: hours of simulation.
        ({"device": 10.0}, {}, "--failures", f"more than the {MAX_FAILURES_PER_RUN:,} a simulated run holds"),
        ({"device": 1e-5}, {"save_s": 0}, "--costs", "save_s must be > 0"),
        ({"device": 1e-5}, {"reform_s": float("inf")}, "--costs", "reform_s: costs must be finite"),
        ({"device": 1e-5}, {"detect_s": float("nan")}, "--costs", "detect_s: costs must be finite"),
    ],
)
def test_rates_and_costs_past_reason_exit_2_before_any_simulation(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, rates: dict[str, float], costs: dict[str, float], flag: str, says: str
) -> None:
    """Infinite or NaN rates and costs, a rate no simulation can get through, a save that takes
    no time (it divides): one line naming the flag, not a traceback, a hang or a result."""
    (tmp_path / "rates.json").write_text(json.dumps({"per_gpu_hour": rates}))  # inf and NaN as JSON's Infinity, NaN
    (tmp_path / "costs.json").write_text(json.dumps(costs))
    for mode in ("ringtrain", "restart"):
        code, out, err = plan(
            capsys, "--failures", str(tmp_path / "rates.json"), "--costs", str(tmp_path / "costs.json"), "--recovery", mode
        )
        assert code == 2 and f"config error: {flag}: " in err and says in err and out == "", err
        assert "Traceback" not in err


@pytest.mark.parametrize("count", ["1e999", "1e16", "inf"])
def test_a_parameter_count_past_any_model_exits_2(capsys: pytest.CaptureFixture[str], count: str) -> None:
    code = cli.main(["plan", "--params", count])
    out, err = capsys.readouterr()
    assert code == 2 and "config error: --params: " in err and out == "" and "Traceback" not in err


def test_a_failures_or_costs_file_names_what_is_wrong(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    rates = tmp_path / "rates.json"
    rates.write_text(json.dumps({"per_gpu_hour": {"gpu": 1e-5}}))
    code, _, err = plan(capsys, "--failures", str(rates))
    assert code == 2 and "unknown kinds ['gpu']" in err
    costs = tmp_path / "costs.json"
    costs.write_text(json.dumps({"reform_seconds": 60}))
    code, _, err = plan(capsys, "--costs", str(costs))
    assert code == 2 and "unknown keys ['reform_seconds']" in err
    rates.write_text(json.dumps({"per_gpu_hour": {"device": 1e-5}, "source": "our fleet"}))
    costs.write_text(json.dumps({"reform_s": 60}))
    code, out, _ = plan(capsys, "--failures", str(rates), "--costs", str(costs), "--days", "2", "--seeds", "1")
    assert code == 0 and "our fleet" in out and "reform_s 60" in out
