"""A short job with an injected NaN, end to end: TensorBoard's event files, report.html, the page.

``chaos.faults`` makes rank 1's loss non-finite at step 3 and ``controllers.on_nan=abort`` says
not to roll back: the Controller records incident 0001-nan and the run fails after steps 1-2. TensorBoard's own reader must find every scalar
at the right step and the incident at step 3; ``ringtrain run`` writes the report, which
Chromium must render from disk with its curves drawn and the incident listed.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from ringtrain.telemetry.tensorboard import INCIDENT_COUNT_TAG, SCALAR_TAGS
from ringtrain_dev.cli_runs import QUICKSTART, run_cli
from ringtrain_dev.ray_head import REPO, processes_using
from ringtrain_dev.tiny import TINY
from tests.unit.test_report_browser import CHARTS, assert_drawn, render_in_chromium

from .test_run_e2e import ray_tmp  # noqa: F401  (fixture)

pytestmark = [pytest.mark.ray, pytest.mark.slow]

NAN_ON_RANK_1_AT_STEP_3 = ["chaos.faults=[{kind: nan, rank: 1, step: 3}]", "controllers.on_nan=abort"]
NUM_RANKS = 4  # quickstart's dp 2 x cp 2


def report_cli(*args: str, home: Path) -> subprocess.CompletedProcess[str]:
    """`ringtrain report ...` as a user runs it; it needs no Ray, so no cluster is isolated here."""
    env = dict(os.environ)
    env.update(HOME=str(home), PYTHONPATH=os.pathsep.join([str(REPO / "platform"), env.get("PYTHONPATH", "")]))
    return subprocess.run(
        [sys.executable, "-m", "ringtrain", "report", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=home,
    )


def test_a_nan_fault_shows_in_tensorboard_and_in_the_report(tmp_path: Path, ray_tmp: Path) -> None:
    run_dir = tmp_path / "run"
    result = run_cli(
        [str(QUICKSTART), *TINY, "train.steps=6", *NAN_ON_RANK_1_AT_STEP_3, f"run_dir={run_dir}"],
        home=tmp_path,
        ray_tmp=ray_tmp,
    )
    assert result.returncode == 1, result.stderr[-3000:]
    assert processes_using(ray_tmp) == []

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    incident = json.loads((run_dir / "incidents" / "0001-nan.json").read_text())
    assert (incident["kind"], incident["ranks"], incident["detected_at_step"]) == ("nan", [1], 3)
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "failed"

    # TensorBoard, read with its own reader: every scalar the records hold, at steps 1 and 2.
    assert (run_dir / "tensorboard").is_dir(), "no event files: cmd_run passes no TensorBoardSink to the Controller"
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    written = [(key, tag) for key, tag in SCALAR_TAGS.items() if isinstance(records[0].get(key), (int, float))]
    assert {"loss", "lr", "grad_norm", "tokens_per_s", "dp", "cp", "snapshot_s", "goodput"} <= {k for k, _ in written}
    for key, tag in written:
        assert [(e.step, e.value) for e in events.Scalars(tag)] == [
            (r["step"], pytest.approx(r[key], rel=1e-6, abs=1e-9)) for r in records
        ], tag
    for rank in range(NUM_RANKS):
        assert [e.step for e in events.Scalars(f"step_time/rank_{rank}")] == [1, 2]
    assert [(e.step, e.value) for e in events.Scalars(INCIDENT_COUNT_TAG)] == [(3, 1.0)]
    (text_tag,) = events.Tags()["tensors"]
    (text,) = events.Tensors(text_tag)
    assert text.step == 3 and "incident 1: nan" in text.tensor_proto.string_val[0].decode()

    # The report: written by `ringtrain run`, rewritten by `ringtrain report`.
    report = run_dir / "report.html"
    assert report.is_file() and str(report) in result.stdout, "`ringtrain run` neither wrote nor named report.html"
    again = report_cli(str(run_dir), home=tmp_path)
    assert again.returncode == 0, again.stderr
    assert again.stdout.strip() == str(report) and again.stderr == ""

    rendered = render_in_chromium(report, tmp_path / "report-nan-e2e.png")
    drawn = [c for c in CHARTS if c != "mfu" or all(math.isfinite(r.get("mfu", math.nan)) for r in records)]
    # A real run records each rank's compute time: the page charts it beside the step time.
    assert all(r.get("rank_compute_s") for r in records)
    shown = (*CHARTS, "compute-time")
    assert_drawn(rendered, report, num_ranks=NUM_RANKS, drawn=[*drawn, "compute-time"], charts_shown=shown)
    assert rendered.state["status"] == "failed"
    (row,) = rendered.state["incidentRows"]
    assert row.split("\t")[:5] == ["1", "nan", "3", "1", "abort"]
    assert "Incident 1: nan" in rendered.state["incidents"][0]


def test_the_report_of_a_missing_run_directory_exits_2_naming_it(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-run"
    result = report_cli(str(missing), home=tmp_path)
    assert result.returncode == 2
    assert result.stdout == "" and result.stderr.strip() == f"ringtrain: report: run directory {missing} does not exist"
