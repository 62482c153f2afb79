"""The chart as Helm sees it: lint, the values schema, template-time checks, the chart's own docs."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from helmkit import BAD_CASES, CASES, CHART, REPO, VALUES_DIR, Render, case_values

HERE = Path(__file__).resolve().parent

WARNING = 2  # helm lint severities: 1 info, 2 warning, 3 error


def min_kube_version() -> str:
    """The lowest Kubernetes version Chart.yaml's kubeVersion admits, e.g. "1.26.0"."""
    constraint = yaml.safe_load((CHART / "Chart.yaml").read_text())["kubeVersion"]
    match = re.fullmatch(r">=\s*(\d+\.\d+\.\d+)(-0)?", constraint)
    assert match, f"Chart.yaml kubeVersion {constraint!r} is not a plain lower bound"
    return match.group(1)


@pytest.mark.parametrize("case", CASES)
def test_lint_is_clean(helm: Any, case: str) -> None:
    report = helm.lint(CHART, case_values(case), strict=True, kube_version=f"v{min_kube_version()}")
    problems = [m for m in report["messages"] if m["severity"] >= WARNING]
    assert report["errors"] == [] and problems == [], f"helm lint ({case}): {problems or report['errors']}"


@pytest.mark.parametrize("case", BAD_CASES)
def test_schema_rejects_bad_values_file(helm: Any, case: str) -> None:
    """Each bad-*.yaml says, in an `# expect:` line, what helm must report."""
    text = (VALUES_DIR / f"{case}.yaml").read_text()
    expect = re.search(r"^# expect: (.+)$", text, re.MULTILINE)
    assert expect, f"{case}.yaml needs an '# expect: <part of helm's message>' line"
    values = yaml.safe_load(text)

    report = helm.lint(CHART, values, strict=True)
    reported = any(expect.group(1) in e for e in report["errors"])
    assert reported, f"helm lint did not report {expect.group(1)!r}: {report}"
    with pytest.raises(helm.HelmValuesError, match=re.escape(expect.group(1))), helm.Chart.load(CHART) as chart:
        chart.render(values, name="demo")


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"mode": "rayservice"}, "at '/mode': value must be one of"),
        ({"workerGroups": [{"name": "gpu", "replicas": 1, "gpu": 8}]}, "additional properties 'gpu' not allowed"),
        ({"workerGroups": [{"name": "GPU_1", "replicas": 1}]}, "/workerGroups/0/name"),
        ({"workerGroups": [{"name": "gpu"}]}, "missing property 'replicas'"),
        ({"worker": {"gpus": -1}}, "/worker/gpus"),
        ({"head": {"shmSizeLimit": "lots"}}, "/head/shmSizeLimit"),
        ({"job": {"overrides": ["train.steps=5; rm -rf /"]}}, None),  # allowed: quoted, see entrypoint test
        ({"job": {"overrides": ["name=it's"]}}, "/job/overrides/0"),
        ({"job": {"overrides": ["no-equals-sign"]}}, "/job/overrides/0"),
        ({"job": {"mountPath": "/"}}, "/job/mountPath"),
        ({"metrics": {"port": 12000}}, "/metrics/port"),
        ({"rayJob": {"activeDeadlineSeconds": 0}}, "/rayJob/activeDeadlineSeconds"),
        ({"monitoring": {"prometheusRule": {"alerts": {"noProgress": {"window": "15 minutes"}}}}}, "/window"),
        ({"monitoring": {"podMonitor": {"enabeld": True}}}, "additional properties 'enabeld' not allowed"),
        ({"s3": {"endpointUrl": "minio:9000"}}, "/s3/endpointUrl"),
    ],
)
def test_schema_checks_nested_values(helm: Any, values: dict[str, Any], message: str | None) -> None:
    with helm.Chart.load(CHART) as chart:
        if message is None:
            chart.render(values, name="demo")
            return
        with pytest.raises(helm.HelmValuesError, match=re.escape(message)):
            chart.render(values, name="demo")


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (
            {"workerGroups": [{"name": "gpu", "replicas": 1}, {"name": "gpu", "replicas": 2}]},
            'the name "gpu" is used twice',
        ),
        ({"s3": {"accessKeyId": "AKIA"}}, "s3.secretAccessKey is required when s3.accessKeyId is set"),
        ({"fullnameOverride": "9lives"}, "must be lowercase letters, digits and '-', starting with a letter"),
    ],
)
def test_templates_fail_with_a_message_naming_the_value(helm: Any, values: dict[str, Any], message: str) -> None:
    with helm.Chart.load(CHART) as chart, pytest.raises(helm.HelmError, match=re.escape(message)):
        chart.render(values, name="demo")


def test_long_release_names_are_cut_to_kuberay_limit(render: Callable[..., Render]) -> None:
    name = "a-release-name-long-enough-to-overflow-kuberays-limit"
    out = render({}, name=name)
    assert len(out.ray_object()["metadata"]["name"]) <= 47


def test_schema_is_draft7_and_accepts_the_chart_defaults() -> None:
    jsonschema = pytest.importorskip("jsonschema", reason="jsonschema is not installed")
    schema = json.loads((CHART / "values.schema.json").read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    assert schema["additionalProperties"] is False, "the top level must reject unknown keys"
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())
    jsonschema.Draft7Validator(schema).validate(defaults)
    assert set(defaults) == set(schema["properties"]), "values.yaml and the schema list different top-level keys"


def test_values_yaml_documents_every_key() -> None:
    """Every key the schema declares has a comment right above it in values.yaml.

    Keys inside free-form maps (the job config, resources, node selectors) are data, not chart
    settings, and are left alone.
    """
    schema = json.loads((CHART / "values.schema.json").read_text())
    lines = (CHART / "values.yaml").read_text().splitlines()
    stack: list[tuple[int, str]] = []  # (indent, key) of the enclosing mappings
    undocumented = []
    for number, line in enumerate(lines):
        match = re.match(r"^( *)([A-Za-z][\w.-]*):", line)
        if not match:
            continue
        indent, key = len(match.group(1)), match.group(2)
        while stack and stack[-1][0] >= indent:
            stack.pop()
        path = [k for _, k in stack] + [key]
        stack.append((indent, key))
        node: dict[str, Any] | None = schema
        for part in path:
            # A $ref'd definition (resources, tolerations, ...) is Kubernetes structure: its
            # key is documented, what is inside it is not a chart setting.
            props = node.get("properties") if node is not None and "$ref" not in node else None
            node = props.get(part) if props else None
        if node is None:
            continue  # a key of a free-form map
        previous = next((lines[i].strip() for i in range(number - 1, -1, -1) if lines[i].strip()), "")
        if not previous.startswith("#"):
            undocumented.append(".".join(path))
    assert not undocumented, f"values.yaml keys without a comment above them: {undocumented}"


def test_chart_metadata() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["apiVersion"] == "v2"
    assert chart["name"] == "ringtrain"
    assert chart["version"] == "0.1.0"
    assert str(chart["appVersion"]) == "0.1.0"


def test_chart_readme_shows_the_lifecycle_commands() -> None:
    readme = (CHART / "README.md").read_text()
    for command in ("helm install", "helm upgrade", "helm uninstall", "--set-file job.configYaml="):
        assert command in readme, f"helm/ringtrain/README.md does not show {command!r}"


def test_dashboards_folder_explains_where_the_json_comes_from() -> None:
    readme = CHART / "dashboards" / "README.md"
    assert readme.is_file()
    assert "ringtrain dashboards export" in readme.read_text()


YAML_FILES = sorted(
    [*CHART.glob("*.yaml"), REPO / "infra" / "prometheus.yml", *HERE.glob("*.yaml"), *VALUES_DIR.glob("*.yaml")]
)


@pytest.mark.parametrize("path", YAML_FILES, ids=lambda p: str(p.relative_to(REPO)))
def test_yaml_files_pass_yamllint(path: Path) -> None:
    linter = pytest.importorskip("yamllint.linter", reason="yamllint is not installed")
    config = pytest.importorskip("yamllint.config", reason="yamllint is not installed")
    conf = config.YamlLintConfig("extends: default\nrules:\n  line-length: {max: 100}\n  document-start: disable\n")
    problems = list(linter.run(path.read_text(), conf))
    assert not problems, "\n".join(f"{path.name}:{p.line}:{p.column} {p.message}" for p in problems)
