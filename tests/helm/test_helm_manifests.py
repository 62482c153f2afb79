"""The rendered manifests: valid for Kubernetes and KubeRay, and right in what no schema can check."""

from __future__ import annotations

import json
import posixpath
import re
import shlex
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from helmkit import CASES, CHART, DEFAULTS, NAMESPACE, RELEASE, REPO, Render, merged, ray_container, worker_groups

S3_VARS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL", "AWS_DEFAULT_REGION")
S3_KEY_FIELDS = dict(zip(S3_VARS, ("accessKeyId", "secretAccessKey", "endpointUrl", "region")))
FOREIGN_GROUPS = ("ray.io/", "monitoring.coreos.com/")  # kinds kubernetes-validate has no schema for
DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


def kube_versions() -> list[str]:
    lowest = re.search(r"\d+\.\d+", yaml.safe_load((CHART / "Chart.yaml").read_text())["kubeVersion"])
    assert lowest
    kv = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate is not installed")
    return sorted({lowest.group(0), ".".join(kv.latest_version().split(".")[:2])})


# --- Kubernetes' own schemas --------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES)
def test_builtin_kinds_pass_kubernetes_schemas(rendered: dict[str, Render], case: str) -> None:
    """ConfigMaps, Secrets and the NetworkPolicy, and every pod template (the Ray pods', the
    RayJob's submitter's) as a core/v1 PodTemplate, validated strictly (unknown fields fail)
    against the oldest Kubernetes the chart admits and the newest."""
    kv = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate is not installed")
    out = rendered[case]
    objects = [d for d in out.docs if not d["apiVersion"].startswith(FOREIGN_GROUPS)]
    assert {"ConfigMap", "NetworkPolicy"} <= {d["kind"] for d in objects}
    objects += [
        {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": f"{name}-template"}, "template": template}
        for name, template in out.all_pod_templates()
    ]
    for version in kube_versions():
        for obj in objects:
            try:
                kv.validate(obj, version, strict=True)
            except kv.ValidationError as exc:
                name = f"{obj['kind']} {obj['metadata']['name']}"
                pytest.fail(f"{case}: {name} is invalid on Kubernetes {version}: {exc}")


def test_kubernetes_check_catches_typos(rendered: dict[str, Render]) -> None:
    """The strict Kubernetes check fails on an unknown pod field and on a missing required one."""
    kv = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate is not installed")
    _, template = next(rendered["default"].pod_templates())
    typo = json.loads(json.dumps(template))
    typo["spec"]["nodeselector"] = {}
    unmounted = json.loads(json.dumps(template))
    del unmounted["spec"]["containers"][0]["volumeMounts"][0]["mountPath"]
    for bad, message in ((typo, "nodeselector"), (unmounted, "mountPath")):
        obj = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}, "template": bad}
        with pytest.raises(kv.ValidationError, match=message):
            kv.validate(obj, kube_versions()[0], strict=True)


def test_every_object_carries_the_release_labels(rendered: dict[str, Render]) -> None:
    for case, out in rendered.items():
        for doc in out.docs:
            labels = doc["metadata"].get("labels", {})
            assert labels.get("app.kubernetes.io/instance") == RELEASE, f"{case}: {doc['kind']}"
            assert labels.get("app.kubernetes.io/managed-by") == "Helm", f"{case}: {doc['kind']}"
            assert labels.get("helm.sh/chart") == "ringtrain-0.1.0", f"{case}: {doc['kind']}"


# --- KubeRay's CRD schemas --------------------------------------------------------------------


def structural_to_jsonschema(node: Any) -> Any:
    """A CRD structural schema as plain JSON Schema, checked the way the API server checks it.

    - Unknown fields are errors (`fieldValidation=Strict`, kubectl's default), unless the node
      says `x-kubernetes-preserve-unknown-fields`.
    - `x-kubernetes-int-or-string` admits an integer or a string; `nullable` admits null.
    - An `x-kubernetes-embedded-resource` carries apiVersion, kind and metadata.
    - `format: int32/int64` are range-checked by FORMATS below.
    CEL rules (`x-kubernetes-validations`) cannot be evaluated here: see
    test_no_cel_guarded_field_is_set.
    """
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key == "properties":
            out[key] = {name: structural_to_jsonschema(sub) for name, sub in value.items()}
        elif key in ("items", "additionalProperties", "not"):
            out[key] = structural_to_jsonschema(value)
        elif key in ("anyOf", "allOf", "oneOf"):
            out[key] = [structural_to_jsonschema(sub) for sub in value]
        elif key != "default":
            out[key] = value
    if node.get("x-kubernetes-int-or-string") and "anyOf" not in out:
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if node.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    if node.get("x-kubernetes-embedded-resource"):
        props = out.setdefault("properties", {})
        props.setdefault("apiVersion", {"type": "string"})
        props.setdefault("kind", {"type": "string"})
        props.setdefault("metadata", {"type": "object"})
    preserve_unknown = node.get("x-kubernetes-preserve-unknown-fields", False)
    if "properties" in out and "additionalProperties" not in out and not preserve_unknown:
        out["additionalProperties"] = False
    return out


def _format_checker() -> Any:
    jsonschema = pytest.importorskip("jsonschema", reason="jsonschema is not installed")
    checker = jsonschema.FormatChecker(formats=())
    for name, bits in (("int32", 32), ("int64", 64)):
        low, high = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
        checker.checks(name)(lambda value, low=low, high=high: not isinstance(value, int) or low <= value <= high)
    return checker


@pytest.fixture(scope="module")
def crd_validators(kuberay_crds: dict[str, dict[str, Any]]) -> dict[str, Any]:
    jsonschema = pytest.importorskip("jsonschema", reason="jsonschema is not installed")
    checker = _format_checker()
    return {
        kind: jsonschema.Draft7Validator(structural_to_jsonschema(schema), format_checker=checker)
        for kind, schema in kuberay_crds.items()
    }


def crd_errors(validators: dict[str, Any], obj: dict[str, Any]) -> list[str]:
    errors = validators[obj["kind"]].iter_errors(obj)
    return sorted(f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in errors)


@pytest.mark.parametrize("case", CASES)
def test_ray_object_matches_kuberay_crd(rendered: dict[str, Render], crd_validators: dict[str, Any], case: str) -> None:
    obj = rendered[case].ray_object()
    assert obj["kind"] == ("RayCluster" if merged(case)["mode"] == "raycluster" else "RayJob")
    assert crd_errors(crd_validators, obj) == []


def test_crd_check_catches_typos_types_and_ranges(rendered: dict[str, Render], crd_validators: dict[str, Any]) -> None:
    """The CRD check is not vacuous: it fails on what a hand-edited template could get wrong."""
    good = rendered["default"].ray_object()

    worker: tuple[str | int, ...] = ("spec", "rayClusterSpec", "workerGroupSpecs", 0)
    delete = object()
    edits: list[tuple[tuple[str | int, ...], Any, str]] = [
        (("spec", "rayClusterSpec", "headGroupSpec", "template", "spec", "nodeselector"), {}, "nodeselector"),
        (("spec", "shutdownAfterJobFinish"), True, "shutdownAfterJobFinish"),
        ((*worker, "replicas"), "2", "replicas"),
        ((*worker, "rayStartParams", "port"), 6379, "rayStartParams"),
        ((*worker, "maxReplicas"), 2**31, "maxReplicas"),
        ((*worker, "groupName"), delete, "groupName"),
    ]
    for path, value, expected in edits:
        obj = json.loads(json.dumps(good))
        parent = obj
        for key in path[:-1]:
            parent = parent[key]
        if value is delete:
            del parent[path[-1]]
        else:
            parent[path[-1]] = value
        errors = crd_errors(crd_validators, obj)
        assert any(expected in e for e in errors), f"{path}: {errors}"


def _cel_paths(schema: dict[str, Any], path: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    if "x-kubernetes-validations" in schema and path:
        yield path
    for name, sub in schema.get("properties", {}).items():
        yield from _cel_paths(sub, (*path, name))
    if isinstance(schema.get("items"), dict):
        yield from _cel_paths(schema["items"], (*path, "*"))


def _has_path(obj: Any, path: tuple[str, ...]) -> bool:
    if not path:
        return True
    head, rest = path[0], path[1:]
    if head == "*":
        return isinstance(obj, list) and any(_has_path(item, rest) for item in obj)
    return isinstance(obj, dict) and head in obj and _has_path(obj[head], rest)


def test_no_cel_guarded_field_is_set(rendered: dict[str, Render], kuberay_crds: dict[str, dict[str, Any]]) -> None:
    """The CRDs' CEL rules (deletionStrategy, managedBy, ...) are not evaluated here, so the chart
    must not set the fields they guard."""
    for case, out in rendered.items():
        obj = out.ray_object()
        guarded = list(_cel_paths(kuberay_crds[obj["kind"]]))
        assert guarded, "expected the CRD to carry CEL rules"
        assert [p for p in guarded if _has_path(obj, p)] == [], case


def kuberay_controller_problems(obj: dict[str, Any]) -> list[str]:
    """What KubeRay's operator refuses at reconcile time (ray-operator/controllers/ray/utils/
    validation.go), which no CRD schema expresses."""
    problems = []
    name = obj["metadata"]["name"]
    limit = 47 if obj["kind"] == "RayJob" else 53
    if len(name) > limit or not DNS1035.match(name):
        problems.append(f"name {name!r}: a DNS-1035 label of at most {limit} characters")
    spec = obj["spec"]
    cluster = spec["rayClusterSpec"] if obj["kind"] == "RayJob" else spec
    if obj["kind"] == "RayJob":
        if not spec.get("shutdownAfterJobFinishes") and spec.get("ttlSecondsAfterFinished", 0) > 0:
            problems.append("ttlSecondsAfterFinished without shutdownAfterJobFinishes")
        if spec.get("activeDeadlineSeconds") is not None and spec["activeDeadlineSeconds"] <= 0:
            problems.append("activeDeadlineSeconds must be positive")
        if spec.get("runtimeEnvYAML") is not None and not isinstance(yaml.safe_load(spec["runtimeEnvYAML"]), dict):
            problems.append("runtimeEnvYAML is not a YAML mapping")
    groups = [("head", cluster["headGroupSpec"])] + [(g["groupName"], g) for g in cluster.get("workerGroupSpecs", [])]
    names = [n for n, _ in groups[1:]]
    if len(set(names)) != len(names):
        problems.append(f"duplicate worker group names {names}")
    for group_name, group in groups:
        params = group.get("rayStartParams", {})
        if not group["template"]["spec"].get("containers"):
            problems.append(f"{group_name}: no container")
        if "labels" in params:
            problems.append(f"{group_name}: rayStartParams['labels'] is not supported")
        if group.get("resources") and {"num-cpus", "num-gpus", "memory", "resources"} & params.keys():
            problems.append(f"{group_name}: resources set both in rayStartParams and resources")
        if group_name != "head" and not group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]:
            problems.append(f"{group_name}: replicas outside [minReplicas, maxReplicas]")
    return problems


@pytest.mark.parametrize("case", CASES)
def test_kuberay_operator_would_accept(rendered: dict[str, Render], case: str) -> None:
    assert kuberay_controller_problems(rendered[case].ray_object()) == []


def test_ttl_is_left_out_when_the_cluster_is_kept(render: Callable[..., Render]) -> None:
    spec = render({"rayJob": {"shutdownAfterJobFinishes": False}}).ray_object()["spec"]
    assert spec["shutdownAfterJobFinishes"] is False
    assert "ttlSecondsAfterFinished" not in spec


# --- What no schema checks ----------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES)
def test_worker_gpu_limits_equal_requests(rendered: dict[str, Render], case: str) -> None:
    values = merged(case)
    gpu = values["worker"]["gpuResourceName"]
    specs = {g["groupName"]: g for g in rendered[case].cluster_spec()["workerGroupSpecs"]}
    expected = worker_groups(values)
    assert list(specs) == [g["name"] for g in expected]
    for group in expected:
        resources = ray_container(specs[group["name"]]["template"])["resources"]
        if group["gpus"]:
            assert resources["limits"][gpu] == resources["requests"][gpu] == group["gpus"], group["name"]
        else:
            assert gpu not in resources.get("limits", {}) and gpu not in resources.get("requests", {})
    head = ray_container(rendered[case].cluster_spec()["headGroupSpec"]["template"])["resources"]
    assert gpu not in head.get("limits", {}), "the head needs no GPU by default"


@pytest.mark.parametrize("case", CASES)
def test_every_pod_mounts_an_in_memory_dev_shm(rendered: dict[str, Render], case: str) -> None:
    values = merged(case)
    sizes = {"head": values["head"]["shmSizeLimit"], **{g["name"]: g["shmSizeLimit"] for g in worker_groups(values)}}
    for group, template in rendered[case].pod_templates():
        mounts = {m["mountPath"]: m["name"] for m in ray_container(template)["volumeMounts"]}
        assert "/dev/shm" in mounts, group
        volume = next(v for v in template["spec"]["volumes"] if v["name"] == mounts["/dev/shm"])
        assert volume["emptyDir"] == {"medium": "Memory", "sizeLimit": sizes[group]}, group


def _entrypoint(out: Render) -> str:
    obj = out.ray_object()
    if obj["kind"] == "RayJob":
        return obj["spec"]["entrypoint"]
    # A RayCluster runs what the install notes tell the user to submit.
    match = re.search(r"ray job submit --address \S+ -- (.+)$", out.notes, re.MULTILINE)
    assert match, f"the RayCluster notes show no `ray job submit` command:\n{out.notes}"
    return match.group(1)


@pytest.mark.parametrize("case", CASES)
def test_entrypoint_runs_the_mounted_job_config(rendered: dict[str, Render], case: str) -> None:
    out, values = rendered[case], merged(case)
    args = shlex.split(_entrypoint(out))
    assert args[:4] == ["python", "-m", "ringtrain", "run"]
    config_path = args[4]
    assert args[5:] == values["job"]["overrides"], "each override, once, in order, unchanged by the shell"

    job = values["job"]
    expected = yaml.safe_load(job["configYaml"]) if job["configYaml"] else job["config"]
    config_maps = {cm["metadata"]["name"]: cm for cm in out.of_kind("ConfigMap")}
    directory, filename = posixpath.split(config_path)
    # The driver runs on the head; the workers get the same mount.
    for group, template in out.pod_templates():
        volumes = {v["name"]: v for v in template["spec"]["volumes"]}
        mounts = [m for m in ray_container(template)["volumeMounts"] if m["mountPath"] == directory]
        assert len(mounts) == 1, f"{group}: nothing is mounted at {directory}"
        config_map = config_maps[volumes[mounts[0]["name"]]["configMap"]["name"]]
        assert yaml.safe_load(config_map["data"][filename]) == expected, group


def test_overrides_reach_ringtrain_verbatim(render: Callable[..., Render]) -> None:
    """Shell metacharacters in an override stay inside its argument."""
    overrides = ["run_dir=/tmp/a b", "name=x;touch /tmp/pwned", "data.path=$HOME/*.txt"]
    args = shlex.split(render({"job": {"overrides": overrides}}).ray_object()["spec"]["entrypoint"])
    assert args[5:] == overrides


@pytest.mark.parametrize("case", CASES)
def test_metrics_port_is_exported_and_declared(rendered: dict[str, Render], case: str) -> None:
    port = merged(case)["metrics"]["port"]
    assert port == 8080
    spec = rendered[case].cluster_spec()
    for group in [spec["headGroupSpec"], *spec["workerGroupSpecs"]]:
        assert group["rayStartParams"]["metrics-export-port"] == str(port)
        ports = {p["name"]: p["containerPort"] for p in ray_container(group["template"])["ports"]}
        assert ports["metrics"] == port


@pytest.mark.parametrize("case", CASES)
def test_s3_variables_come_from_the_secret(rendered: dict[str, Render], case: str) -> None:
    out, s3 = rendered[case], merged(case)["s3"]
    secrets = {
        s["metadata"]["name"]: s
        for s in out.of_kind("Secret")
        if s["metadata"]["labels"]["app.kubernetes.io/component"] == "s3-credentials"
    }
    enabled = bool(s3["existingSecret"] or s3["accessKeyId"])
    for group, template in out.pod_templates():
        env = {e["name"]: e for e in ray_container(template).get("env", [])}
        if not enabled:
            assert not set(S3_VARS) & env.keys(), f"{group}: S3 variables without a Secret"
            continue
        for var in S3_VARS:
            ref = env[var]["valueFrom"]["secretKeyRef"]
            assert ref["key"] == s3["secretKeys"][S3_KEY_FIELDS[var]], (group, var)
            assert ref.get("optional", False) == (var in ("AWS_ENDPOINT_URL", "AWS_DEFAULT_REGION")), (group, var)
            if s3["existingSecret"]:
                assert ref["name"] == s3["existingSecret"], (group, var)
            else:
                assert ref["name"] in secrets, f"{group}: {var} names Secret {ref['name']}, which is not rendered"
    if enabled and not s3["existingSecret"]:
        (secret,) = secrets.values()
        for var, field in S3_KEY_FIELDS.items():
            if s3[field]:
                assert secret["stringData"][s3["secretKeys"][field]] == s3[field]
    else:
        assert secrets == {}, "the chart creates a Secret only from s3.accessKeyId"


# --- The job itself and the notes ---------------------------------------------------------------


def test_default_job_config_loads_and_fits_the_default_workers(rendered: dict[str, Render], tmp_path: Path) -> None:
    """The chart's default job passes ringtrain's own validation, and the default worker groups
    hold enough GPUs for its dp x cp workers."""
    quickstart = yaml.safe_load((REPO / "jobs" / "quickstart.yaml").read_text())
    assert DEFAULTS["job"]["config"] == quickstart, "values.yaml says its job config is jobs/quickstart.yaml"
    config = pytest.importorskip("ringtrain.config", reason="ringtrain is not importable")
    out = rendered["default"]
    path = tmp_path / "job.yaml"
    (job_map,) = [cm for cm in out.of_kind("ConfigMap") if "job.yaml" in cm.get("data", {})]
    path.write_text(job_map["data"]["job.yaml"])
    job = config.load(path, list(DEFAULTS["job"]["overrides"]))
    gpus = sum(g["replicas"] * g["gpus"] for g in worker_groups(DEFAULTS))
    assert gpus >= job.world_size * job.cluster.gpus_per_worker


def test_notes_tell_how_to_follow_or_submit(rendered: dict[str, Render]) -> None:
    rayjob = rendered["default"].notes
    assert f"kubectl -n {NAMESPACE} get rayjob demo-ringtrain" in rayjob
    assert "python -m ringtrain run '/etc/ringtrain/job.yaml'" in rayjob
    raycluster = rendered["raycluster-autoscaling"].notes
    assert f"kubectl -n {NAMESPACE} port-forward svc/demo-ringtrain-head-svc 8265:8265" in raycluster
    assert "RAY_AUTH_MODE=token ray job submit --address http://127.0.0.1:8265 -- python -m ringtrain run" in raycluster


@pytest.mark.parametrize("case", CASES)
def test_rendered_yaml_passes_yamllint(rendered: dict[str, Render], case: str) -> None:
    linter = pytest.importorskip("yamllint.linter", reason="yamllint is not installed")
    config = pytest.importorskip("yamllint.config", reason="yamllint is not installed")
    # Rendered YAML: long lines (entrypoints, descriptions) and toYaml's unindented lists are fine;
    # duplicate keys, bad indentation, trailing spaces and stray documents are not.
    conf = config.YamlLintConfig(
        "extends: default\n"
        "rules:\n"
        "  line-length: disable\n"
        "  document-start: disable\n"
        "  indentation: {spaces: 2, indent-sequences: whatever}\n"
        "  comments: {min-spaces-from-content: 1}\n"
    )
    for path, text in rendered[case].sources.items():
        if path.endswith(".txt") or not text.strip():
            continue
        problems = list(linter.run(text.lstrip("\n"), conf))
        assert not problems, "\n".join(f"{case} {path}:{p.line}:{p.column} {p.message}" for p in problems)
