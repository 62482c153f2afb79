"""Fixtures of the Helm chart tests (helpers live in helmkit.py)."""

from __future__ import annotations

import copy
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from helmkit import CASES, CHART, CRD_DIR, Loader, Render, case_values, render_chart

from tests.tools import missing


@pytest.fixture(scope="session")
def helm() -> Any:
    return pytest.importorskip(
        "helm_python", reason="helm-python-sdk is not installed (the project's test extras install it)"
    )


@pytest.fixture(scope="session")
def render(helm: Any) -> Callable[..., Render]:
    """Render the chart with values (a dict): ``render({"mode": "raycluster"})``."""

    def _render(values: dict[str, Any] | None = None, **kwargs: Any) -> Render:
        return render_chart(helm, copy.deepcopy(values), **kwargs)

    return _render


@pytest.fixture(scope="session")
def rendered(render: Callable[..., Render]) -> dict[str, Render]:
    """Every representative values file, rendered once per session."""
    return {case: render(case_values(case)) for case in CASES}


@pytest.fixture
def chart_copy(tmp_path: Path) -> Path:
    """A scratch copy of the chart, for tests that add files to it (dashboards)."""
    target = tmp_path / "ringtrain"
    shutil.copytree(CHART, target)
    return target


@pytest.fixture(scope="session")
def kuberay_crds() -> dict[str, dict[str, Any]]:
    """KubeRay's served ``ray.io/v1`` openAPIV3Schema of each kind: {"RayJob": schema, ...}."""
    if not CRD_DIR.is_dir():
        missing(f"KubeRay CRDs not found at {CRD_DIR} (the shared data folder next to the repository)")
    schemas: dict[str, dict[str, Any]] = {}
    for path in sorted(CRD_DIR.glob("*.yaml")):
        with path.open() as fh:
            crd = yaml.load(fh, Loader=Loader)
        if not isinstance(crd, dict) or crd.get("kind") != "CustomResourceDefinition":
            continue
        for version in crd["spec"]["versions"]:
            if version["name"] == "v1" and version.get("served", False):
                schemas[crd["spec"]["names"]["kind"]] = version["schema"]["openAPIV3Schema"]
    absent = {"RayJob", "RayCluster"} - schemas.keys()
    assert not absent, f"{CRD_DIR} lacks the ray.io/v1 CRD of {sorted(absent)}"
    return schemas
