"""The Grafana dashboards and alert rules: checked-in JSON matches the generator, the panels fit the
grid, every variable is defined, every PromQL expression parses (promtool) and reads only
metrics of the registry, filtered to the chosen job and run. Also `ringtrain dashboards export`.
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest

from ringtrain import metrics
from ringtrain.commands import dashboards as dashboards_command
from ringtrain.telemetry import alerts, dashboards, panels
from tests.tools import tool

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = (ROOT / "dashboards", ROOT / "helm" / "ringtrain" / "dashboards")
BOARDS = {name: build() for name, build in dashboards.DASHBOARDS.items()}
PANEL_TYPES = {"timeseries", "stat"}
DASHBOARD_KEYS = {"uid", "title", "tags", "schemaVersion", "time", "templating", "panels", "refresh", "editable"}
PANEL_KEYS = {"id", "type", "title", "gridPos", "datasource", "targets", "fieldConfig", "options"}
# Grafana's own variables, and the concrete values the expressions are checked with.
BUILTIN_VARIABLE = re.compile(r"__\w+")
SUBSTITUTES = {
    "job": "demo",
    "run_id": "20240101-000000-abcdef",
    "__rate_interval": "1m",
    "__interval": "15s",
    "__range": "1h",
}
VARIABLE = re.compile(r"\$(?:\{(\w+)(?::\w+)?\}|(\w+))")
LABEL_VALUES = re.compile(r"label_values\((.+),\s*(\w+)\)")
# PromQL words that look like metric names but are not.
PROMQL_WORDS = {
    *("by", "without", "on", "ignoring", "group_left", "group_right"),
    *("and", "or", "unless", "offset", "bool", "inf", "nan"),
}
RUN_FILTER = ('job=~"$job"', 'run_id=~"$run_id"')


def metric_names(expr: str) -> list[str]:
    """The series names an expression reads, in order of appearance."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    text = re.sub(r"\{[^}]*\}", " ", text)
    text = re.sub(r"\[[^\]]*\]", " ", text)
    text = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    names = []
    for match in re.finditer(r"(?<![\w.:])[A-Za-z_:][\w:]*", text):
        followed_by_call = text[match.end() :].lstrip().startswith("(")
        if not followed_by_call and match.group().lower() not in PROMQL_WORDS:
            names.append(match.group())
    return names


def substitute(expr: str) -> str:
    return VARIABLE.sub(lambda match: SUBSTITUTES[match.group(1) or match.group(2)], expr)


def panel_queries() -> list[tuple[str, str, str]]:
    """(dashboard file, panel title, expression) of every panel query."""
    return [
        (name, panel["title"], target["expr"])
        for name, board in BOARDS.items()
        for panel in board["panels"]
        for target in panel["targets"]
    ]


def variable_selectors() -> list[str]:
    """The series selectors inside the template variables' ``label_values`` queries."""
    found = []
    for board in BOARDS.values():
        for variable in board["templating"]["list"]:
            if variable["type"] == "query":
                match = LABEL_VALUES.fullmatch(variable["query"])
                assert match, f"{variable['name']}: {variable['query']!r} is not label_values(selector, label)"
                found.append(match.group(1))
    return found


ALERT_EXPRESSIONS = [rule.expr for rule in alerts.ALERT_RULES]
ALL_EXPRESSIONS = [expr for _, _, expr in panel_queries()] + variable_selectors() + ALERT_EXPRESSIONS


@pytest.mark.parametrize("folder", FOLDERS, ids=lambda folder: str(folder.relative_to(ROOT)))
@pytest.mark.parametrize("name", sorted(BOARDS))
def test_checked_in_json_is_what_the_generator_writes(folder: Path, name: str) -> None:
    path = folder / name
    assert path.is_file(), f"{path.relative_to(ROOT)} is missing: run `ringtrain dashboards export`"
    assert path.read_text(encoding="utf-8") == panels.render(BOARDS[name]), (
        f"{path.relative_to(ROOT)} drifted from telemetry/dashboards.py: run `ringtrain dashboards export`"
    )


@pytest.mark.parametrize("folder", FOLDERS, ids=lambda folder: str(folder.relative_to(ROOT)))
def test_no_stale_dashboard_files(folder: Path) -> None:
    assert sorted(path.name for path in folder.glob("*.json")) == sorted(BOARDS)


def test_uids_are_fixed_and_unique() -> None:
    uids = [board["uid"] for board in BOARDS.values()]
    assert uids == ["ringtrain-training", "ringtrain-reliability"]
    rule_uids = [rule.uid for rule in alerts.ALERT_RULES]
    assert len(set(uids + rule_uids)) == len(uids) + len(rule_uids)


@pytest.mark.parametrize("name", sorted(BOARDS))
def test_dashboard_schema_subset(name: str) -> None:
    board = BOARDS[name]
    assert DASHBOARD_KEYS <= board.keys()
    assert board["schemaVersion"] == 39 and board["id"] is None
    assert board["title"].startswith("ringtrain / ")
    assert board["panels"], "a dashboard without panels"
    for panel in board["panels"]:
        assert PANEL_KEYS <= panel.keys(), panel["title"]
        assert panel["type"] in PANEL_TYPES, panel["title"]
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        grid = panel["gridPos"]
        assert set(grid) == {"x", "y", "w", "h"} and all(isinstance(v, int) for v in grid.values())
        assert grid["x"] >= 0 and grid["y"] >= 0 and grid["w"] > 0 and grid["h"] > 0, panel["title"]
        assert grid["x"] + grid["w"] <= 24, f"{panel['title']} runs past column 24"
        ref_ids = [target["refId"] for target in panel["targets"]]
        assert ref_ids and len(set(ref_ids)) == len(ref_ids), panel["title"]
        assert all(target["expr"].strip() for target in panel["targets"]), panel["title"]


@pytest.mark.parametrize("name", sorted(BOARDS))
def test_panels_do_not_overlap_and_ids_are_unique(name: str) -> None:
    panels = BOARDS[name]["panels"]
    ids = [panel["id"] for panel in panels]
    assert len(set(ids)) == len(ids)
    for a, b in itertools.combinations(panels, 2):
        ga, gb = a["gridPos"], b["gridPos"]
        apart = (
            ga["x"] + ga["w"] <= gb["x"]
            or gb["x"] + gb["w"] <= ga["x"]
            or ga["y"] + ga["h"] <= gb["y"]
            or gb["y"] + gb["h"] <= ga["y"]
        )
        assert apart, f"{a['title']!r} overlaps {b['title']!r}"


def test_the_layout_refuses_a_row_wider_than_the_grid() -> None:
    wide = panels.graph("wide", [panels.Query("up")], "", width=13)
    with pytest.raises(ValueError, match="wider than 24"):
        panels.layout([panels.Row(8, (wide, wide))])


@pytest.mark.parametrize("name", sorted(BOARDS))
def test_every_variable_used_is_defined(name: str) -> None:
    board = BOARDS[name]
    defined = [variable["name"] for variable in board["templating"]["list"]]
    assert defined == ["datasource", "job", "run_id"]
    datasource = board["templating"]["list"][0]
    assert datasource["type"] == "datasource" and datasource["query"] == "prometheus"
    used = {a or b for a, b in VARIABLE.findall(json.dumps(board))}
    assert {"datasource", "job", "run_id"} <= used
    undefined = {var for var in used if var not in defined and not BUILTIN_VARIABLE.fullmatch(var)}
    assert not undefined, f"{name} uses undefined variables {sorted(undefined)}"


def test_the_variables_list_jobs_and_runs_of_ringtrain() -> None:
    (board, *_) = BOARDS.values()
    queries = {v["name"]: v["query"] for v in board["templating"]["list"] if v["type"] == "query"}
    assert queries == {
        "job": "label_values(ray_ringtrain_step, job)",
        "run_id": 'label_values(ray_ringtrain_step{job=~"$job"}, run_id)',
    }


@pytest.mark.parametrize(("name", "title", "expr"), panel_queries(), ids=lambda v: str(v)[:40])
def test_every_panel_query_filters_by_job_and_run(name: str, title: str, expr: str) -> None:
    names = metric_names(expr)
    assert names, f"{title}: no metric in {expr!r}"
    for metric in names:
        for match in re.finditer(rf"(?<![\w:]){re.escape(metric)}(?![\w:])(\{{[^}}]*\}})?", expr):
            matchers = match.group(1) or ""
            assert all(m in matchers for m in RUN_FILTER), f"{name} / {title}: {metric} is not filtered: {expr}"


@pytest.mark.parametrize("expr", ALL_EXPRESSIONS, ids=lambda v: v[:40])
def test_every_metric_read_is_in_the_registry(expr: str) -> None:
    names = metric_names(expr)
    assert names, f"no metric found in {expr!r}"
    unknown = sorted(set(names) - metrics.BY_EXPORTED_NAME.keys())
    assert not unknown, f"{unknown} are not in ringtrain/metrics.py: {expr}"


def test_the_metric_name_parser_sees_through_promql() -> None:
    expr = (
        'sum by (job, run_id) ((a_total{x="b_c(d)"} unless a_total offset 30m) or increase(b_total[5m]))'
        ' - on (job) group_left (kind) max without (rank) (c) * 1e3 > +Inf and d'
    )
    assert metric_names(expr) == ["a_total", "a_total", "b_total", "c", "d"]


def test_the_dashboards_show_every_metric_where_it_belongs() -> None:
    used: dict[str, set[str]] = {name: set() for name in BOARDS}
    for name, _, expr in panel_queries():
        used[name].update(metric_names(expr))
    m = metrics
    training = {m.LOSS, m.TOKENS_PER_SECOND, m.MFU, m.STEP_TIME, m.DP_SIZE, m.CP_SIZE, m.MEMORY_BYTES}
    reliability = {
        m.INCIDENTS, m.RECOVERY_SECONDS, m.GOODPUT, m.SNAPSHOT_SECONDS, m.SNAPSHOT_BYTES, m.PERSIST_SECONDS,
        m.LAST_DURABLE_STEP, m.STEP, m.SDC_PROBES, m.SDC_FAILURES, m.HANG_VERDICTS, m.RECOVERIES, m.LOST_STEPS,
    }
    assert {x.exported for x in training} <= used["training.json"]
    assert {x.exported for x in reliability} <= used["reliability.json"]
    missing = {x.exported for x in metrics.ALL} - used["training.json"] - used["reliability.json"]
    assert not missing, f"{sorted(missing)} have no panel: add one in telemetry/dashboards.py"


def _promtool() -> str:
    return tool("promtool")  # without it the PromQL goes unchecked


def _check_rules(exprs: list[str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    rules = [{"record": f"ringtrain_check:expr_{i}", "expr": substitute(expr)} for i, expr in enumerate(exprs)]
    path = tmp_path / "expressions.rules.yml"
    # JSON is YAML: promtool reads it as a rules file.
    path.write_text(json.dumps({"groups": [{"name": "ringtrain_dashboards", "rules": rules}]}))
    return subprocess.run([_promtool(), "check", "rules", str(path)], capture_output=True, text=True, timeout=30)


def test_every_expression_parses_with_promtool(tmp_path: Path) -> None:
    proc = _check_rules(ALL_EXPRESSIONS, tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"{len(ALL_EXPRESSIONS)} rules found" in proc.stdout


def test_promtool_does_reject_a_broken_expression(tmp_path: Path) -> None:
    proc = _check_rules(["max by (job) (ray_ringtrain_loss{job=~\"$job\"}"], tmp_path)
    assert proc.returncode != 0 and "could not parse expression" in proc.stdout + proc.stderr


@pytest.mark.parametrize("rule", alerts.ALERT_RULES, ids=lambda rule: rule.uid)
def test_alert_rules_are_complete(rule: alerts.AlertRule) -> None:
    body = alerts.alert_rule(rule, "ds-uid", "folder-uid")
    assert body["uid"] == rule.uid and body["folderUID"] == "folder-uid" and body["ruleGroup"] == "ringtrain"
    ref_ids = [query["refId"] for query in body["data"]]
    assert body["condition"] in ref_ids and len(set(ref_ids)) == len(ref_ids)
    assert body["data"][0]["datasourceUid"] == "ds-uid"
    assert re.fullmatch(r"\d+[smh]", body["for"])
    assert body["labels"]["severity"] in {"critical", "warning"}
    assert not VARIABLE.search(rule.expr), "alert rules watch every run: no dashboard variables"
    assert "by (job, run_id)" in rule.expr


def test_alert_rules_cover_progress_loss_goodput_and_sdc() -> None:
    assert [rule.uid for rule in alerts.ALERT_RULES] == [
        "ringtrain-no-progress",
        "ringtrain-loss-not-finite",
        "ringtrain-low-goodput",
        "ringtrain-sdc-detected",
    ]


def test_with_datasource_pins_only_the_datasource_variable() -> None:
    board = BOARDS["training.json"]
    pinned = panels.with_datasource(board, "ds-uid", "ds name")
    assert pinned["templating"]["list"][0]["current"] == {"selected": True, "text": "ds name", "value": "ds-uid"}
    assert board["templating"]["list"][0]["current"] == {}
    assert pinned["panels"] == board["panels"]


def _export(*argv: str) -> int:
    parser = argparse.ArgumentParser()
    dashboards_command.add_arguments(parser)
    return dashboards_command.run(parser.parse_args(["export", *argv]))


def test_export_writes_every_folder_then_reports_unchanged(tmp_path: Path, capsys: Any) -> None:
    first, second = tmp_path / "a", tmp_path / "b" / "nested"
    assert _export("--out", str(first), "--out", str(second)) == 0
    for folder in (first, second):
        for name, board in BOARDS.items():
            assert (folder / name).read_text(encoding="utf-8") == panels.render(board)
    assert capsys.readouterr().out.count(": created") == 4
    assert _export("--out", str(first), "--out", str(second)) == 0
    assert capsys.readouterr().out.count(": unchanged") == 4


def test_export_check_finds_a_stale_file_and_writes_nothing(tmp_path: Path, capsys: Any) -> None:
    assert _export("--out", str(tmp_path)) == 0
    assert _export("--out", str(tmp_path), "--check") == 0
    (tmp_path / "training.json").write_text("{}\n")
    capsys.readouterr()
    assert _export("--out", str(tmp_path), "--check") == 1
    err = capsys.readouterr().err
    assert "training.json" in err and "ringtrain dashboards export" in err and err.count("\n") == 1
    assert (tmp_path / "training.json").read_text() == "{}\n"


def test_export_refuses_a_file_as_out(tmp_path: Path, capsys: Any) -> None:
    target = tmp_path / "file.json"
    target.write_text("")
    assert _export("--out", str(target)) == 2
    err = capsys.readouterr().err
    assert err.startswith("ringtrain: config error: --out:") and err.count("\n") == 1


def test_export_defaults_to_both_folders_of_the_checkout() -> None:
    assert dashboards_command.REPO == ROOT
    assert [ROOT / out for out in dashboards_command.DEFAULT_OUT] == list(FOLDERS)


def test_no_action_is_bad_input(capsys: Any) -> None:
    parser = argparse.ArgumentParser()
    dashboards_command.add_arguments(parser)
    assert dashboards_command.run(parser.parse_args([])) == 2
    assert "export or push" in capsys.readouterr().err
