"""The monitoring objects: the PodMonitor, opt-in monitors, and the Grafana dashboard ConfigMaps."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from helmkit import CASES, CHART, NAMESPACE, Render, merged, ray_container


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expr in selector.get("matchExpressions", []):
        assert expr["operator"] == "In", "extend _selects for other operators"
        if labels.get(expr["key"]) not in expr["values"]:
            return False
    return True


@pytest.mark.parametrize("case", [c for c in CASES if merged(c)["monitoring"]["podMonitor"]["enabled"]])
def test_pod_monitor_scrapes_head_and_workers(rendered: dict[str, Render], case: str) -> None:
    out = rendered[case]
    monitor = out.one("PodMonitor")
    spec = monitor["spec"]
    assert spec["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    for key, value in merged(case)["monitoring"]["podMonitor"]["labels"].items():
        assert monitor["metadata"]["labels"][key] == value
    (endpoint,) = spec["podMetricsEndpoints"]
    assert endpoint["honorLabels"] is True, "ringtrain's `job` label must not become exported_job"
    templates = dict(out.pod_templates())
    assert len(templates) >= 2
    for group, template in templates.items():
        assert _selects(spec["selector"], template["metadata"]["labels"]), f"the PodMonitor misses {group}"
        assert endpoint["port"] in {p["name"] for p in ray_container(template)["ports"]}, group
    job_config = out.of_kind("ConfigMap")[0]["metadata"]["labels"]
    assert not _selects(spec["selector"], job_config), "the selector must not match non-Ray objects' labels"


def test_monitoring_objects_are_opt_in(rendered: dict[str, Render]) -> None:
    assert {"PodMonitor", "PrometheusRule"}.isdisjoint(rendered["default"].kinds())


def test_dashboards_render_nothing_without_json(render: Callable[..., Render], chart_copy: Path) -> None:
    for board in (chart_copy / "dashboards").glob("*.json"):
        board.unlink()
    out = render({}, chart_dir=chart_copy)
    assert not [cm for cm in out.of_kind("ConfigMap") if "grafana_dashboard" in cm["metadata"]["labels"]]


def test_the_exported_dashboards_each_become_one_sidecar_configmap(rendered: dict[str, Render]) -> None:
    boards = sorted(p.stem for p in CHART.glob("dashboards/*.json"))
    assert boards == ["reliability", "training"]
    found = sorted(
        cm["metadata"]["name"]
        for cm in rendered["default"].of_kind("ConfigMap")
        if cm["metadata"]["labels"].get("grafana_dashboard") == "1"
    )
    assert found == [f"demo-ringtrain-dashboard-{b}" for b in boards]


def test_dashboards_become_sidecar_configmaps(render: Callable[..., Render], chart_copy: Path) -> None:
    boards = {
        "ringtrain_training.json": {"title": "ringtrain / training", "panels": [{"type": "timeseries"}]},
        "ringtrain-faults.json": {"title": "ringtrain / faults", "panels": []},
    }
    for exported in (chart_copy / "dashboards").glob("*.json"):
        exported.unlink()
    for name, board in boards.items():
        (chart_copy / "dashboards" / name).write_text(json.dumps(board, indent=2))
    (chart_copy / "dashboards" / "notes.txt").write_text("not a dashboard")

    out = render({}, chart_dir=chart_copy)
    found = {
        cm["metadata"]["name"]: cm
        for cm in out.of_kind("ConfigMap")
        if cm["metadata"]["labels"].get("grafana_dashboard") == "1"
    }
    assert sorted(found) == ["demo-ringtrain-dashboard-ringtrain-faults", "demo-ringtrain-dashboard-ringtrain-training"]
    for cm in found.values():
        assert cm["metadata"]["annotations"] == {"grafana_folder": "ringtrain"}
        ((key, text),) = cm["data"].items()
        assert json.loads(text) == boards[key]

    relabelled = render(
        {"monitoring": {"dashboards": {"label": "grafana_dashboard_ml", "labelValue": "yes", "folder": ""}}},
        chart_dir=chart_copy,
    )
    labelled = [cm for cm in relabelled.of_kind("ConfigMap") if "grafana_dashboard_ml" in cm["metadata"]["labels"]]
    assert len(labelled) == 2
    assert all(cm["metadata"]["labels"]["grafana_dashboard_ml"] == "yes" for cm in labelled)
    assert all("annotations" not in cm["metadata"] for cm in labelled)
    disabled = render({"monitoring": {"dashboards": {"enabled": False}}}, chart_dir=chart_copy)
    assert disabled.kinds() == ["ConfigMap", "NetworkPolicy", "RayJob", "Secret"]  # the job config, the policy, the RayJob, the auth token
