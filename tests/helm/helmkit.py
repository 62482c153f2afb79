"""Helpers of the Helm chart tests: render the chart with Helm's own engine, read the values cases.

The chart is rendered in-process by ``helm-python-sdk`` (Helm's Go engine behind a C ABI), the
same code path as ``helm template``: it enforces values.schema.json and runs every template
function. KubeRay's CRDs are read from the shared data folder next to the repository, never
copied into it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "ringtrain"
VALUES_DIR = Path(__file__).resolve().parent / "values"
CRD_DIR = REPO.parent / "shared" / "data" / "kuberay-crds"
RELEASE = "demo"
NAMESPACE = "ml"

# The representative values files rendered by every manifest check ("default" is no file).
CASES = ["default"] + sorted(p.stem for p in VALUES_DIR.glob("*.yaml") if not p.stem.startswith("bad-"))
BAD_CASES = sorted(p.stem for p in VALUES_DIR.glob("bad-*.yaml"))

Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
DEFAULTS = yaml.load((CHART / "values.yaml").read_text(), Loader=Loader)


def case_values(case: str) -> dict[str, Any]:
    if case == "default":
        return {}
    data = yaml.load((VALUES_DIR / f"{case}.yaml").read_text(), Loader=Loader)
    assert isinstance(data, dict), f"{case}.yaml must hold a mapping"
    return data


@dataclass
class Render:
    """One `helm template` of the chart: its manifests (parsed) and its install notes."""

    values: dict[str, Any]
    docs: list[dict[str, Any]]
    sources: dict[str, str]  # template path -> rendered text
    notes: str

    def kinds(self) -> list[str]:
        return [d["kind"] for d in self.docs]

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        return [d for d in self.docs if d["kind"] == kind]

    def one(self, kind: str) -> dict[str, Any]:
        found = self.of_kind(kind)
        assert len(found) == 1, f"expected one {kind}, rendered {self.kinds()}"
        return found[0]

    def ray_object(self) -> dict[str, Any]:
        """The RayJob or the RayCluster: exactly one of them is rendered."""
        ray = [d for d in self.docs if d["apiVersion"] == "ray.io/v1"]
        assert len(ray) == 1, f"expected one RayJob or RayCluster, rendered {self.kinds()}"
        return ray[0]

    def cluster_spec(self) -> dict[str, Any]:
        ray = self.ray_object()
        return ray["spec"]["rayClusterSpec"] if ray["kind"] == "RayJob" else ray["spec"]

    def pod_templates(self) -> Iterator[tuple[str, dict[str, Any]]]:
        """(group name, pod template) of the head ("head") and of every worker group."""
        spec = self.cluster_spec()
        yield "head", spec["headGroupSpec"]["template"]
        for group in spec.get("workerGroupSpecs", []):
            yield group["groupName"], group["template"]

    def submitter_template(self) -> dict[str, Any] | None:
        """The RayJob's submitter pod template (K8sJobMode), or None."""
        ray = self.ray_object()
        return ray["spec"].get("submitterPodTemplate") if ray["kind"] == "RayJob" else None

    def all_pod_templates(self) -> Iterator[tuple[str, dict[str, Any]]]:
        """Every pod template the chart writes: the Ray pods', then the submitter's ("submitter")."""
        yield from self.pod_templates()
        submitter = self.submitter_template()
        if submitter is not None:
            yield "submitter", submitter


def render_chart(
    helm: Any, values: dict[str, Any] | None = None, chart_dir: Path = CHART, *, name: str = RELEASE
) -> Render:
    with helm.Chart.load(chart_dir) as chart:
        sources = chart.render(values or {}, name=name, namespace=NAMESPACE, is_install=True)
    docs: list[dict[str, Any]] = []
    notes = ""
    for path, text in sorted(sources.items()):
        if path.endswith("NOTES.txt"):
            notes = text
            continue
        docs.extend(d for d in yaml.load_all(text, Loader=Loader) if d)
    return Render(values=values or {}, docs=docs, sources=sources, notes=notes)


def merged(case: str) -> dict[str, Any]:
    """The values a render of `case` used: the chart defaults with the case file on top."""
    return with_defaults(case_values(case))


def with_defaults(values: dict[str, Any]) -> dict[str, Any]:
    """``values`` over the chart defaults, as Helm coalesces them: mappings merge, anything else
    replaces."""

    def coalesce(base: Any, top: Any) -> Any:
        if isinstance(base, dict) and isinstance(top, dict):
            return {**base, **{k: coalesce(base.get(k), v) for k, v in top.items()}}
        return top

    return coalesce(DEFAULTS, values)


def worker_groups(values: dict[str, Any]) -> list[dict[str, Any]]:
    """Each worker group over the `worker` defaults (top-level keys: enough for the scalars compared)."""
    return [{**values["worker"], **group} for group in values["workerGroups"]]


def ray_container(template: dict[str, Any]) -> dict[str, Any]:
    return template["spec"]["containers"][0]
