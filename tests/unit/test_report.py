"""The run report: what report.html shows of a run directory, whole, live, failed or damaged."""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path
from typing import Any, Optional

import pytest

from ringtrain.commands import report as report_command
from ringtrain.telemetry.report import REPORT_NAME, write_report
from ringtrain.telemetry.runfiles import NO_SUMMARY, read_run
from ringtrain.telemetry.svgchart import MAX_POINTS
from ringtrain_dev.fake_run import FAILED_SUMMARY, NAN_INCIDENT, step_record, step_records, write_run_dir

PLATFORM = Path(__file__).resolve().parents[2] / "platform"
CHARTS = ("loss", "throughput", "step-time", "timeline", "checkpoint", "goodput", "durable", "lr", "grad-norm", "mfu")
# The nan run's second incident: a hang whose verdict carries a long stack.
HANG_INCIDENT: dict[str, Any] = {
    **NAN_INCIDENT,
    "id": 2,
    "kind": "hang",
    "ranks": [3],
    "detected_at_step": 5,
    "action": "shrink",
    "dp_after": 1,
    "reason": "no progress for 30 s",
    # As the controller writes it: how each rank's step ended, and the hang's diagnosis.
    "verdict": {
        "outcomes": [
            {"rank": 2, "outcome": "ok", "error": "", "where": "", "node_alive": True},
            {"rank": 3, "outcome": "timeout", "error": "no reply in 30 s", "where": "train_step", "node_alive": False},
        ],
        "hang": {
            "culprit_rank": 3,
            "host": "node-b",
            "op": "all_reduce",
            "seq": 12,
            "waited_on": {"rank": 3, "for_s": 31.5},
            "stack": "\n".join(f"frame {i}" for i in range(40)) + "\n  dist.all_reduce(grads)",
        },
    },
}


class Page(HTMLParser):
    """The parts of report.html the tests look at: text, element ids, and each chart's polylines."""

    def __init__(self, text: str) -> None:
        super().__init__(convert_charrefs=True)
        self.ids: set[str] = set()
        self.polylines: dict[str, list[int]] = {}  # chart id -> number of points of each polyline
        self.empty_charts: set[str] = set()
        self.nonfinite_marks: dict[str, int] = {}
        self.tags: list[str] = []
        self.texts: list[str] = []
        self._chart: Optional[str] = None
        self._in_empty = False
        self.feed(text)
        self.close()

    @property
    def text(self) -> str:
        return " ".join(" ".join(self.texts).split())

    def handle_starttag(self, tag: str, attrs: list[tuple[str, Optional[str]]]) -> None:
        a = dict(attrs)
        self.tags.append(tag)
        if a.get("id"):
            self.ids.add(str(a["id"]))
        if tag == "figure" and str(a.get("id", "")).startswith("chart-"):
            self._chart = str(a["id"])[len("chart-") :]
            self.polylines[self._chart] = []
        if self._chart and tag == "polyline":
            self.polylines[self._chart].append(len(str(a.get("points") or "").split()))
        if self._chart and tag == "text" and a.get("class") == "empty":
            self.empty_charts.add(self._chart)
        if self._chart and tag == "text" and a.get("class") == "nonfinite":
            self.nonfinite_marks[self._chart] = self.nonfinite_marks.get(self._chart, 0) + 1

    def handle_endtag(self, tag: str) -> None:
        if tag == "figure":
            self._chart = None

    def handle_data(self, data: str) -> None:
        self.texts.append(data)


def report_of(run: Path) -> tuple[Page, list[str]]:
    path, warnings = write_report(run)
    assert path == run / REPORT_NAME
    return Page(path.read_text(encoding="utf-8")), warnings


def test_a_failed_run_shows_curves_ranks_incidents_and_config(tmp_path: Path) -> None:
    run = write_run_dir(tmp_path / "run", steps=4, incidents=(NAN_INCIDENT, HANG_INCIDENT), summary=FAILED_SUMMARY)
    page, warnings = report_of(run)

    assert warnings == []
    assert "Missing or damaged" not in page.text
    assert set(page.polylines) == set(CHARTS)
    for chart in CHARTS:
        assert page.polylines[chart] and all(n >= 2 for n in page.polylines[chart]), chart
    assert len(page.polylines["step-time"]) == 4 + 1  # one line per rank, and the controller's step
    assert "Slowest on average: rank 1" in page.text
    assert "failed" in page.text and "non-finite loss nan at step 3" in page.text
    # Incidents: listed, linked from the chart markers, with the verdict and the stack's innermost frames.
    assert {"incident-0001-nan", "incident-0002-hang"} <= page.ids
    assert "Incident 1: nan" in page.text and "Incident 2: hang" in page.text
    assert "culprit rank 3" in page.text and "host node-b" in page.text and "op all_reduce" in page.text
    assert "dist.all_reduce(grads)" in page.text and "frame 39" in page.text and "frame 5 " not in page.text
    # Each rank's outcome, and the verdict's other values, as text rather than Python reprs.
    assert "rank 2 ok rank 3 timeout (no reply in 30 s) in train_step, its node gone" in page.text
    assert "verdict waited_on for_s: 31.5, rank: 3" in page.text  # keys as written: sorted
    assert "{" not in page.text.split("Overview", 1)[1].split("Resolved config")[0]
    assert "config.yaml" in page.text and "quickstart" in page.text and "details" in page.tags


def test_counts_a_flat_durable_line_and_a_cpu_mfu_are_explained(tmp_path: Path) -> None:
    records = [step_record(step, last_durable_step=0) for step in range(1, 5)]
    summary = {**FAILED_SUMMARY, "status": "finished", "num_params": 834176, "device": "cpu"}
    config = "name: quickstart\ntrain:\n  steps: 4\ncheckpoint:\n  persist_every: 50\n"
    page, _ = report_of(write_run_dir(tmp_path / "run", records=records, incidents=(), summary=summary, config_yaml=config))
    assert "parameters 834,176" in page.text
    assert "No checkpoint was persisted during these steps (checkpoint.persist_every is 50): the last durable step was none." in page.text
    assert "On CPU, against a nominal peak of 96 GFLOP/s a core" in page.text

    # A GPU's MFU, and a durable step that moves, need no note.
    summary = {**summary, "device": "NVIDIA H100 80GB HBM3"}
    page, _ = report_of(write_run_dir(tmp_path / "gpu", steps=4, incidents=(), summary=summary))
    assert "nominal peak" not in page.text and "No checkpoint was persisted" not in page.text


def test_a_run_still_going_has_no_summary_and_a_half_written_line(tmp_path: Path) -> None:
    run = write_run_dir(tmp_path / "run", steps=3, incidents=())
    with (run / "metrics.jsonl").open("a") as f:
        f.write('{"step": 4, "loss": 5.')
    page, warnings = report_of(run)

    assert warnings == [
        "metrics.jsonl: the last line (4) is incomplete (still being written, or cut off): ignored",
        f"summary.json is missing: the run is {NO_SUMMARY}",
    ]
    assert [r["step"] for r in read_run(run).records] == [1, 2, 3]
    assert NO_SUMMARY in page.text and "summary.json is missing" in page.text
    assert page.polylines["loss"] == [3]
    assert "None recorded." in page.text


# (file, what it now holds or None for deleted, the warning's start)
DAMAGE = {
    "no-config": ("config.yaml", None, "config.yaml is missing"),
    "bad-config": ("config.yaml", "name: [unclosed\n", "config.yaml is not valid YAML"),
    "no-metrics": ("metrics.jsonl", None, "metrics.jsonl is missing"),
    "empty-metrics": ("metrics.jsonl", "", "metrics.jsonl is empty"),
    "bad-summary": ("summary.json", "{oops", "summary.json is not valid JSON"),
    "bad-incident": ("incidents/0002-crash.json", "{half", "incidents/0002-crash.json is not valid JSON"),
    "list-incident": ("incidents/0003-hang.json", "[1, 2]", "incidents/0003-hang.json does not hold a JSON object"),
}


@pytest.mark.parametrize("case", DAMAGE)
def test_damage_is_named_and_the_rest_still_renders(tmp_path: Path, case: str) -> None:
    name, content, expected = DAMAGE[case]
    run = write_run_dir(tmp_path / "run", summary=FAILED_SUMMARY)
    if content is None:
        (run / name).unlink()
    else:
        (run / name).write_text(content)
    page, warnings = report_of(run)

    assert len(warnings) == 1 and warnings[0].startswith(expected), warnings
    assert expected in page.text
    assert "incident-0001-nan" in page.ids  # the good incident is still listed
    assert set(page.polylines) == set(CHARTS)


def test_without_records_the_charts_say_so(tmp_path: Path) -> None:
    run = write_run_dir(tmp_path / "run", summary=FAILED_SUMMARY)
    (run / "metrics.jsonl").write_text("")
    page, _ = report_of(run)
    assert page.empty_charts == set(CHARTS)
    assert not any(page.polylines.values())
    assert "steps recorded none" in page.text


def test_malformed_lines_and_incomplete_incidents_are_reported_by_name(tmp_path: Path) -> None:
    run = write_run_dir(tmp_path / "run", steps=3, summary=FAILED_SUMMARY)
    lines = (run / "metrics.jsonl").read_text().splitlines(keepends=True)
    lines[1] = "not json\n"
    (run / "metrics.jsonl").write_text("".join(lines) + '{"loss": 1.0}\n')
    (run / "incidents" / "0002-crash.json").write_text(json.dumps({"id": 2, "kind": "crash", "ranks": [0]}))
    page, warnings = report_of(run)

    assert warnings == [
        "metrics.jsonl: 2 malformed line(s) skipped (line 2, 4)",
        "incidents/0002-crash.json lacks detected_at_step, action, reason: listed with what it has",
    ]
    assert page.polylines["loss"] == [2]  # steps 1 and 3
    assert "incident-0002-crash" in page.ids and "Incident 2: crash" in page.text


# Records of a damaged or hand-made metrics.jsonl, each once a traceback of the report: a value
# of a shape the charts do not expect, or a number no float holds.
DAMAGED_RECORDS = {
    "infinite-step": {"step": math.inf, "loss": 1.0},
    "integer-past-floats": {"step": 4, "tokens_per_s": 10**400, "goodput": 10**400, "step_time_s": 10**400},
    "ranks-not-a-list": {"step": 4, "rank_step_time_s": 1e308},
    "buckets-not-a-list": {"step": 4, "eval": {"loss": 1.0, "by_position": 5}},
    "bucket-end-infinite": {"step": 4, "eval": {"by_position": [{"start": "a", "end": math.inf, "loss": "z"}]}},
    "depths-not-a-list": {"step": 4, "eval": {"passkey": {"depths": 5}}},
    "accuracy-not-numbers": {"step": 4, "eval": {"passkey": {"lengths": [1], "accuracy": [["x"]]}}},
    "by-length-not-a-mapping": {"step": 4, "eval": {"passkey": {"by_length": 5, "lengths": [1], "accuracy": [[0.5]]}}},
    "nested-past-the-parser": None,  # written as text below
}


@pytest.mark.parametrize("case", DAMAGED_RECORDS)
def test_damaged_metrics_are_a_warning_and_the_rest_of_the_report(tmp_path: Path, case: str) -> None:
    run = write_run_dir(tmp_path / "run", steps=3, summary=FAILED_SUMMARY)
    record = DAMAGED_RECORDS[case]
    line = "[" * 100_000 + "]" * 100_000 if record is None else json.dumps(record)
    with open(run / "metrics.jsonl", "a") as f:
        f.write(line + "\n")
    page, warnings = report_of(run)

    assert "incident-0001-nan" in page.ids and "Resolved config" in page.text  # the rest is there
    if case in ("infinite-step", "nested-past-the-parser"):  # not a record: skipped, and said so
        assert warnings == ["metrics.jsonl: 1 malformed line(s) skipped (line 4)"]
    elif case == "integer-past-floats":  # the values no float holds are left out, the step drawn
        assert warnings == [] and page.polylines["loss"] == [3]
    else:
        assert len(warnings) == 1 and "could not be drawn from damaged values" in warnings[0], warnings
        assert warnings[0] in page.text


def test_a_config_yaml_alias_bomb_is_shown_as_text_not_expanded(tmp_path: Path) -> None:
    """Ten aliases a level, seven levels: 10^7 values in under 500 bytes, which drawing the run's
    name would spell out (a 645-byte one grew to gigabytes)."""
    run = write_run_dir(tmp_path / "run", summary=FAILED_SUMMARY)
    lines = ["a0: &a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, 7)]
    (run / "config.yaml").write_text("\n".join(lines) + "\nname: *a6\n")
    page, warnings = report_of(run)

    assert len(warnings) == 1 and "holds more than 100,000 values" in warnings[0], warnings
    assert warnings[0].endswith("shown as text")
    assert "name: *a6" in page.text and len(page.text) < 200_000  # as written, never expanded
    assert "incident-0001-nan" in page.ids


def test_a_config_yaml_over_1_mib_is_not_read(tmp_path: Path) -> None:
    run = write_run_dir(tmp_path / "run", summary=FAILED_SUMMARY)
    (run / "config.yaml").write_text("name: big\nnote: " + "x" * (1 << 20) + "\n")
    page, warnings = report_of(run)
    assert len(warnings) == 1 and "more than a config holds (1,048,576)" in warnings[0], warnings
    assert "x" * 1000 not in page.text


@pytest.mark.parametrize("name", ["config.yaml", "metrics.jsonl", "summary.json", "incidents/0001-nan.json", "incidents"])
def test_a_file_linking_out_of_the_run_directory_exits_2_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str
) -> None:
    """A run folder from elsewhere whose config.yaml links to ~/.aws/credentials would put the
    credentials into report.html, a page made to be shared: nothing is read, nothing written."""
    secret = tmp_path / "credentials"
    secret.write_text("aws_secret_access_key = SECRET-VALUE\n")
    run = write_run_dir(tmp_path / "run", summary=FAILED_SUMMARY)
    linked = run / name
    target = secret
    if name == "incidents":
        elsewhere = tmp_path / "elsewhere"
        elsewhere.mkdir()
        (elsewhere / "0001-nan.json").write_text(json.dumps({**NAN_INCIDENT, "reason": secret.read_text()}))
        target = elsewhere
    if linked.is_dir():
        import shutil

        shutil.rmtree(linked)
    else:
        linked.unlink()
    linked.symlink_to(target)

    code = report_command.run(argparse.Namespace(run_dir=str(run), open=False))
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith(f"ringtrain: report: RUN_DIR: {linked} leads through a link to {target}, outside {run}") and err.count("\n") == 1
    assert not (run / REPORT_NAME).exists()


def test_the_report_is_never_written_through_a_link_in_the_run_directory(tmp_path: Path) -> None:
    """A folder from elsewhere with report.html (or the name it is written to first) linking to
    a file of the user's: the page replaces the link, the file is untouched."""
    run = write_run_dir(tmp_path / "run", summary=FAILED_SUMMARY)
    mine = {name: tmp_path / f"mine-{name}" for name in (REPORT_NAME, REPORT_NAME + ".tmp")}
    for name, target in mine.items():
        target.write_text("the user's own file\n")
        (run / name).symlink_to(target)
    report_of(run)
    assert all(target.read_text() == "the user's own file\n" for target in mine.values())
    assert not (run / REPORT_NAME).is_symlink() and not (run / (REPORT_NAME + ".tmp")).exists()


def test_a_link_inside_the_run_directory_is_its_own(tmp_path: Path) -> None:
    run = write_run_dir(tmp_path / "run", summary=FAILED_SUMMARY)
    (run / "config.saved.yaml").write_text((run / "config.yaml").read_text())
    (run / "config.yaml").unlink()
    (run / "config.yaml").symlink_to("config.saved.yaml")
    _, warnings = report_of(run)
    assert warnings == []


def test_all_text_is_escaped(tmp_path: Path) -> None:
    hostile = "<script>alert('x')</script><img src=x onerror=alert(1)>"
    evil_incident = {**NAN_INCIDENT, "reason": hostile, "verdict": {"culprit_rank": hostile, "stack": hostile}}
    run = write_run_dir(tmp_path / "run", incidents=(evil_incident,), summary={**FAILED_SUMMARY, "error": hostile})
    (run / "config.yaml").write_text(f"name: \"{hostile}\"\nnote: '</pre>{hostile}'\n")
    (run / "incidents" / '0002-"><b>.json').write_text(json.dumps({**NAN_INCIDENT, "id": 2}))
    path, _ = write_report(run)
    text = path.read_text(encoding="utf-8")
    page = Page(text)

    assert "<script" not in text.lower() and "<img" not in text.lower() and "<b>" not in text
    assert hostile in page.text  # shown, as text
    assert "script" not in page.tags and "img" not in page.tags and "b" not in page.tags


def test_a_resumed_run_draws_the_later_attempt_of_replayed_steps(tmp_path: Path) -> None:
    # The second attempt resumed from step 3's checkpoint and appended from there on.
    resumed = [step_record(step, loss=1.0) for step in (4, 5, 6)]
    run = write_run_dir(tmp_path / "run", records=[*step_records(5), *resumed], summary=FAILED_SUMMARY)
    files = read_run(run)
    assert [r["step"] for r in files.records] == [1, 2, 3, 4, 5, 6]
    assert [r["loss"] for r in files.records][3:] == [1.0, 1.0, 1.0]
    assert files.num_replayed == 2


def test_non_finite_values_break_the_line_and_are_marked(tmp_path: Path) -> None:
    records = step_records(5)
    records[2]["loss"] = math.nan
    run = write_run_dir(tmp_path / "run", records=records, summary=FAILED_SUMMARY)
    page, warnings = report_of(run)
    assert warnings == []
    assert page.polylines["loss"] == [2, 2]
    assert page.nonfinite_marks == {"loss": 1}


def test_a_rank_that_left_the_job_leaves_a_gap(tmp_path: Path) -> None:
    records = [step_record(1), step_record(2, dp=1, rank_step_time_s=[0.2, 0.3]), step_record(3)]
    run = write_run_dir(tmp_path / "run", records=records, summary=FAILED_SUMMARY)
    page, _ = report_of(run)
    # ranks 0 and 1 run through; ranks 2 and 3 have single points at steps 1 and 3 (dots, no line)
    assert page.polylines["step-time"] == [3, 3, 3]


def test_a_long_run_is_thinned_but_keeps_its_spikes(tmp_path: Path) -> None:
    records = [{"step": s, "step_time_s": 9.0 if s == 4321 else 0.3} for s in range(1, 10_001)]
    run = write_run_dir(tmp_path / "run", records=records, incidents=(), summary=FAILED_SUMMARY)
    path, _ = write_report(run)
    page = Page(path.read_text())
    (points,) = page.polylines["step-time"]
    assert points <= MAX_POINTS + 2
    assert path.stat().st_size < 400_000
    # the spike is the chart's maximum: some vertex sits on the plot's top edge
    assert any(int(y) <= 30 for y in _ys(path.read_text(), "step-time"))


def _ys(text: str, chart: str) -> list[float]:
    figure = text.split(f'id="chart-{chart}"', 1)[1].split("</figure>", 1)[0]
    points = figure.split('<polyline points="', 1)[1].split('"', 1)[0]
    return [float(p.split(",")[1]) for p in points.split()]


def test_write_report_refuses_a_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="missing"):
        write_report(tmp_path / "missing")


def args(run_dir: Path, *, open_it: bool = False) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    report_command.add_arguments(parser)
    return parser.parse_args([str(run_dir), *(["--open"] if open_it else [])])


def test_the_command_exits_2_naming_a_missing_run_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "no-such-run"
    assert report_command.run(args(missing)) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and str(missing) in err and "does not exist" in err
    (tmp_path / "file").write_text("x")
    assert report_command.run(args(tmp_path / "file")) == 2
    assert "not a run directory" in capsys.readouterr().err


def test_the_command_prints_the_path_and_the_warnings(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = write_run_dir(tmp_path / "run")
    assert report_command.run(args(run)) == 0
    out, err = capsys.readouterr()
    assert out.strip() == str(run / REPORT_NAME)
    assert err == f"ringtrain: report: warning: summary.json is missing: the run is {NO_SUMMARY}\n"


def test_open_hands_the_file_url_to_the_browser(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    opened: list[str] = []
    monkeypatch.setattr(report_command.webbrowser, "open", lambda url: opened.append(url) or True)
    run = write_run_dir(tmp_path / "run", summary=FAILED_SUMMARY)
    assert report_command.run(args(run, open_it=True)) == 0
    assert opened == [(run / REPORT_NAME).resolve().as_uri()]


def test_the_report_command_imports_no_torch_or_ray(tmp_path: Path) -> None:
    """`ringtrain` imports the command at start-up: it must stay light."""
    code = (
        "import json, sys\n"
        "import ringtrain.commands.report\n"
        "heavy = ('torch', 'ray', 'tensorboard')\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.partition('.')[0] in heavy)))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(PLATFORM), "HOME": str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == []


def test_a_report_that_cannot_be_written_exits_1(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def refuse(run_dir: Path) -> tuple[Path, list[str]]:
        raise PermissionError(13, "Permission denied", str(run_dir / "report.html.tmp"))

    monkeypatch.setattr(report_command, "write_report", refuse)
    assert report_command.run(args(write_run_dir(tmp_path / "run"))) == 1
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "Permission denied" in err
