"""The PrometheusRule's alerts: valid for Prometheus, and firing on synthetic series (promtool)."""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from helmkit import Render

from tests.tools import tool

HERE = Path(__file__).resolve().parent
UNIT_TESTS = HERE / "alerts_test.yaml"
ALERTS = {
    "RingtrainNoProgress",
    "RingtrainLossNotFinite",
    "RingtrainHighRecoveryRate",
    "RingtrainSDCDetected",
    "RingtrainLowGoodput",
    "RingtrainCheckpointLag",
}
# The metrics ringtrain exports (Ray prefixes ray_; counters end in _total).
METRICS = {
    "ray_ringtrain_step",
    "ray_ringtrain_loss",
    "ray_ringtrain_tokens_per_second",
    "ray_ringtrain_goodput_ratio",
    "ray_ringtrain_incidents_total",
    "ray_ringtrain_recoveries_total",
    "ray_ringtrain_sdc_failures_total",
    "ray_ringtrain_last_durable_step",
}
ENABLED = {"monitoring": {"prometheusRule": {"enabled": True}}}


def rule_groups(out: Render) -> list[dict[str, Any]]:
    groups: list[dict[str, Any]] = out.one("PrometheusRule")["spec"]["groups"]
    return groups


def rules(out: Render) -> list[dict[str, Any]]:
    return [rule for group in rule_groups(out) for rule in group["rules"]]


@pytest.fixture(scope="module")
def promtool() -> str:
    return tool("promtool")


def write_rules(out: Render, directory: Path) -> Path:
    path = directory / "rules.yaml"
    path.write_text(yaml.safe_dump({"groups": rule_groups(out)}, sort_keys=False))
    return path


def run(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, cwd=cwd, check=False, capture_output=True, text=True, timeout=60)


def test_rule_defines_every_alert_from_known_metrics(render: Callable[..., Render]) -> None:
    out = render(ENABLED)
    found = rules(out)
    assert {r["alert"] for r in found} == ALERTS
    for rule in found:
        used = set(re.findall(r"\bray_ringtrain_\w+", rule["expr"]))
        assert used and used <= METRICS, f"{rule['alert']} reads unknown metrics {used - METRICS}"
        assert "by (job, run_id)" in rule["expr"], f"{rule['alert']} must group by job and run_id"
        assert rule["labels"]["severity"] in {"critical", "warning", "info"}
        assert {"summary", "description"} <= rule["annotations"].keys()


def test_promtool_accepts_the_rules(render: Callable[..., Render], promtool: str, tmp_path: Path) -> None:
    rules_file = write_rules(render(ENABLED), tmp_path)
    result = run(promtool, "check", "rules", str(rules_file), cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(ALERTS)} rules found" in result.stdout


def test_alerts_fire_on_synthetic_series(render: Callable[..., Render], promtool: str, tmp_path: Path) -> None:
    """tests/helm/alerts_test.yaml: each alert fires on the run that misbehaves and on no other."""
    write_rules(render(ENABLED), tmp_path)
    shutil.copy(UNIT_TESTS, tmp_path / UNIT_TESTS.name)
    result = run(promtool, "test", "rules", UNIT_TESTS.name, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout
    tested = set(re.findall(r"alertname: (\w+)", UNIT_TESTS.read_text()))
    assert tested == ALERTS, f"alerts without a promtool test: {ALERTS - tested}"


def test_series_selector_scopes_every_metric(render: Callable[..., Render], promtool: str, tmp_path: Path) -> None:
    out = render({"monitoring": {"prometheusRule": {"enabled": True, "seriesSelector": 'namespace="ml"'}}})
    for rule in rules(out):
        names = re.findall(r"\bray_ringtrain_\w+", rule["expr"])
        scoped = re.findall(r'\bray_ringtrain_\w+\{namespace="ml"\}', rule["expr"])
        assert names and len(scoped) == len(names), f"{rule['alert']}: {rule['expr']}"
    result = run(promtool, "check", "rules", str(write_rules(out, tmp_path)), cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


def test_alerts_can_be_tuned_switched_off_and_labelled(render: Callable[..., Render]) -> None:
    out = render(
        {
            "monitoring": {
                "prometheusRule": {
                    "enabled": True,
                    "labels": {"release": "kube-prometheus-stack"},
                    "additionalRuleLabels": {"team": "ml-infra"},
                    "alerts": {
                        "lowGoodput": {"enabled": False},
                        "checkpointLag": {"enabled": False},
                        "noProgress": {"window": "30m", "severity": "warning"},
                    },
                }
            }
        }
    )
    assert out.one("PrometheusRule")["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    by_name = {r["alert"]: r for r in rules(out)}
    assert set(by_name) == ALERTS - {"RingtrainLowGoodput", "RingtrainCheckpointLag"}
    assert "changes(ray_ringtrain_step[30m])" in by_name["RingtrainNoProgress"]["expr"]
    assert by_name["RingtrainNoProgress"]["labels"] == {"severity": "warning", "team": "ml-infra"}
    assert all(r["labels"]["team"] == "ml-infra" for r in by_name.values())
