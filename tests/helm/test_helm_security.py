"""The chart's way in: token authentication, the NetworkPolicy, the restricted pod profile, the
values schema's refusal of an open published head, and the job mount path passed to a shell.

Every representative values file (both modes) is checked; the checkers themselves are shown to
catch what they look for, so a pass means something.
"""

from __future__ import annotations

import base64
import copy
import re
import shlex
from collections.abc import Callable
from typing import Any

import pytest
from helmkit import CASES, CHART, NAMESPACE, RELEASE, Render, merged, ray_container, with_defaults

RAY_PORTS = (6379, 8265, 10001)  # GCS, dashboard and job API, Ray client
RENDEZVOUS_PORT = 29500  # any port the trainers' process groups pick: only the release's pods
# Volume types the restricted Pod Security Standard admits.
RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim", "projected", "secret"}


def auth_secret_name(out: Render) -> str:
    auth = out.values.get("auth", {})
    return auth.get("existingSecret") or f"{out.ray_object()['metadata']['name']}-ray-auth"


# --- token authentication -----------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES)
def test_the_cluster_authenticates_with_a_token_from_a_secret(rendered: dict[str, Render], case: str) -> None:
    out = rendered[case]
    assert out.cluster_spec()["authOptions"] == {"mode": "token", "secretName": auth_secret_name(out)}
    (secret,) = [s for s in out.of_kind("Secret") if s["metadata"]["labels"]["app.kubernetes.io/component"] == "ray-auth"]
    assert secret["metadata"]["name"] == auth_secret_name(out)
    token = base64.b64decode(secret["data"]["auth_token"]).decode()
    assert re.fullmatch(r"[A-Za-z0-9]{64}", token)


def test_each_install_draws_its_own_token(render: Callable[..., Render]) -> None:
    tokens = {
        s["data"]["auth_token"] for _ in range(2) for s in render({}).of_kind("Secret") if "auth_token" in s.get("data", {})
    }
    assert len(tokens) == 2


def test_a_named_secret_is_used_and_none_is_created(render: Callable[..., Render]) -> None:
    out = render({"auth": {"existingSecret": "team-ray-token"}})
    assert out.cluster_spec()["authOptions"] == {"mode": "token", "secretName": "team-ray-token"}
    assert out.of_kind("Secret") == []


def test_auth_off_renders_no_auth_options_and_says_so(render: Callable[..., Render]) -> None:
    out = render({"auth": {"enabled": False}})
    assert "authOptions" not in out.cluster_spec()
    assert out.of_kind("Secret") == []
    assert "Token authentication is OFF" in out.notes


@pytest.mark.parametrize("mode", ["rayjob", "raycluster"])
def test_the_notes_say_how_to_read_the_token(render: Callable[..., Render], mode: str) -> None:
    notes = render({"mode": mode}).notes
    command = (
        f"export RAY_AUTH_TOKEN=$(kubectl -n {NAMESPACE} get secret {RELEASE}-ringtrain-ray-auth "
        "-o jsonpath='{.data.auth_token}' | base64 -d)"
    )
    assert command in notes
    assert "RAY_AUTH_TOKEN" in notes


@pytest.mark.parametrize(
    ("values", "refused"),
    [
        ({"auth": {"enabled": False}, "head": {"serviceType": "NodePort"}}, True),
        ({"auth": {"enabled": False}, "head": {"serviceType": "LoadBalancer"}}, True),
        ({"auth": {"enabled": False}, "head": {"serviceType": "ClusterIP"}}, False),
        ({"head": {"serviceType": "NodePort"}}, False),
        ({"head": {"serviceType": "LoadBalancer"}, "mode": "raycluster"}, False),
    ],
)
def test_the_schema_refuses_a_published_head_without_auth(helm: Any, values: dict[str, Any], refused: bool) -> None:
    with helm.Chart.load(CHART) as chart:
        if not refused:
            chart.render(values, name=RELEASE)
            return
        with pytest.raises(helm.HelmValuesError, match=re.escape("at '/head/serviceType': value must be 'ClusterIP'")):
            chart.render(values, name=RELEASE)


# --- the NetworkPolicy ------------------------------------------------------------------------


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def who_reaches(policy: dict[str, Any], port: int) -> list[Any]:
    """The peers the policy admits to ``port``; the string "anyone" for a rule without sources."""
    peers: list[Any] = []
    for rule in policy["spec"].get("ingress", []):
        ports = rule.get("ports")
        if ports and not any(p.get("port") == port or (p.get("port", 0) <= port <= p.get("endPort", -1)) for p in ports):
            continue
        peers += rule.get("from") or ["anyone"]
    return peers


def release_pods(out: Render) -> dict[str, Any]:
    return {"podSelector": out.one("NetworkPolicy")["spec"]["podSelector"]}


def operator(out: Render) -> dict[str, Any]:
    np = with_defaults(out.values)["networkPolicy"]
    return {
        "namespaceSelector": {"matchLabels": np["operatorNamespaceSelector"]},
        "podSelector": {"matchLabels": np["operatorPodSelector"]},
    }


def ray_port_violations(out: Render) -> list[str]:
    """Who, beyond the release's pods and the operator's dashboard calls, the policy admits to a
    Ray or rendezvous port; and the pods it leaves unguarded."""
    policy = out.one("NetworkPolicy")
    problems = []
    for name, template in out.all_pod_templates():
        if not selects(policy["spec"]["podSelector"], template["metadata"]["labels"]):
            problems.append(f"the policy does not select the {name} pods")
    allowed = {6379: [release_pods(out)], 10001: [release_pods(out)], RENDEZVOUS_PORT: [release_pods(out)]}
    allowed[8265] = [release_pods(out), operator(out)]
    for port, peers in allowed.items():
        extra = [p for p in who_reaches(policy, port) if p not in peers]
        if extra:
            problems.append(f"port {port} admits {extra}")
    return problems


@pytest.mark.parametrize("case", CASES)
def test_ray_and_rendezvous_ports_admit_only_the_release_and_the_operator(rendered: dict[str, Render], case: str) -> None:
    out = rendered[case]
    policy = out.one("NetworkPolicy")
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    assert policy["spec"]["podSelector"] == {"matchLabels": {"app.kubernetes.io/name": "ringtrain", "app.kubernetes.io/instance": RELEASE}}
    assert ray_port_violations(out) == []
    # The operator reaches the dashboard, and the metrics port is Prometheus' alone.
    assert operator(out) in who_reaches(policy, 8265)
    metrics = merged(case)["metrics"]["port"]
    assert who_reaches(policy, metrics) == [release_pods(out), {"namespaceSelector": {}}]


def test_the_port_check_catches_an_open_rule(rendered: dict[str, Render]) -> None:
    out = copy.deepcopy(rendered["default"])
    policy = out.one("NetworkPolicy")
    policy["spec"]["ingress"].append({"ports": [{"port": 8265}]})  # no `from`: everyone
    assert ray_port_violations(out) == ["port 8265 admits ['anyone']"]
    out = copy.deepcopy(rendered["default"])
    out.one("NetworkPolicy")["spec"]["ingress"].append({"from": [{"ipBlock": {"cidr": "0.0.0.0/0"}}]})
    assert len(ray_port_violations(out)) == 4


def test_metrics_from_nobody_renders_no_rule_rather_than_an_open_one(render: Callable[..., Render]) -> None:
    out = render({"networkPolicy": {"metricsFrom": []}})
    policy = out.one("NetworkPolicy")
    assert all(rule.get("from") for rule in policy["spec"]["ingress"])
    assert who_reaches(policy, 8080) == [release_pods(out)]


def test_extra_ingress_is_added_as_given_and_the_policy_can_be_turned_off(render: Callable[..., Render]) -> None:
    rule = {"from": [{"ipBlock": {"cidr": "10.1.0.0/16"}}], "ports": [{"port": 8265, "protocol": "TCP"}]}
    out = render({"networkPolicy": {"extraIngress": [rule]}, "head": {"serviceType": "LoadBalancer"}})
    assert out.one("NetworkPolicy")["spec"]["ingress"][-1] == rule
    assert "NetworkPolicy admits no client" not in out.notes
    unlisted = render({"head": {"serviceType": "LoadBalancer"}})
    assert "head.serviceType is LoadBalancer, but the NetworkPolicy admits no client" in unlisted.notes
    assert "NetworkPolicy" not in render({"networkPolicy": {"enabled": False}}).kinds()


def test_a_namespace_of_the_operator_narrows_its_rule(render: Callable[..., Render]) -> None:
    out = render({"networkPolicy": {"operatorNamespaceSelector": {"kubernetes.io/metadata.name": "kuberay"}}})
    (peer,) = out.one("NetworkPolicy")["spec"]["ingress"][1]["from"]
    assert peer["namespaceSelector"] == {"matchLabels": {"kubernetes.io/metadata.name": "kuberay"}}


# --- the restricted pod profile -----------------------------------------------------------------


def restricted_violations(template: dict[str, Any], home: str) -> list[str]:
    """What breaks the restricted Pod Security Standard, or the chart's own rules on top of it
    (a read-only root with writable /tmp and home, no service account token)."""
    spec = template["spec"]
    pod = spec.get("securityContext", {})
    problems = []
    for key in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(key):
            problems.append(key)
    if spec.get("automountServiceAccountToken") is not False:
        problems.append("a service account token is mounted")
    if pod.get("seccompProfile", {}).get("type") not in ("RuntimeDefault", "Localhost"):
        problems.append("no RuntimeDefault seccomp profile")
    if pod.get("runAsUser") == 0:
        problems.append("runs as root")
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    for volume in volumes.values():
        kinds = set(volume) - {"name"}
        if not kinds <= RESTRICTED_VOLUMES:
            problems.append(f"volume {volume['name']} is {sorted(kinds)}")
    for container in spec["containers"]:
        ctx, name = container.get("securityContext", {}), container["name"]
        if not (ctx.get("runAsNonRoot") or pod.get("runAsNonRoot")):
            problems.append(f"{name}: may run as root")
        if ctx.get("privileged"):
            problems.append(f"{name}: privileged")
        if ctx.get("allowPrivilegeEscalation") is not False:
            problems.append(f"{name}: privilege escalation allowed")
        caps = ctx.get("capabilities", {})
        if "ALL" not in caps.get("drop", []) or set(caps.get("add", [])) - {"NET_BIND_SERVICE"}:
            problems.append(f"{name}: capabilities not all dropped")
        if ctx.get("readOnlyRootFilesystem") is not True:
            problems.append(f"{name}: writable root file system")
        mounts = {m["mountPath"]: m["name"] for m in container.get("volumeMounts", [])}
        for path in ("/tmp", home):
            if "emptyDir" not in volumes.get(mounts.get(path, ""), {}):
                problems.append(f"{name}: no writable emptyDir at {path}")
    return problems


@pytest.mark.parametrize("case", CASES)
def test_every_pod_runs_under_the_restricted_profile(rendered: dict[str, Render], case: str) -> None:
    out = rendered[case]
    names = []
    for name, template in out.all_pod_templates():
        names.append(name)
        assert restricted_violations(template, "/home/ray") == [], f"{case}: {name}"
        assert template["spec"]["securityContext"]["runAsUser"] == 1000
    assert "head" in names and len(names) >= 2
    if merged(case)["mode"] == "rayjob" and merged(case)["rayJob"]["submissionMode"] == "K8sJobMode":
        assert "submitter" in names


def test_the_profile_check_catches_each_breach(rendered: dict[str, Render]) -> None:
    _, good = next(rendered["default"].pod_templates())
    breaches: list[tuple[Callable[[dict[str, Any]], None], str]] = [
        (lambda t: t["spec"]["securityContext"].pop("seccompProfile"), "seccomp"),
        (lambda t: t["spec"].pop("automountServiceAccountToken"), "service account token"),
        (lambda t: t["spec"]["containers"][0]["securityContext"].update(allowPrivilegeEscalation=True), "escalation"),
        (lambda t: t["spec"]["containers"][0]["securityContext"].update(privileged=True), "privileged"),
        (lambda t: t["spec"]["containers"][0]["securityContext"]["capabilities"].update(add=["SYS_ADMIN"]), "capabilities"),
        (lambda t: t["spec"]["containers"][0]["securityContext"].update(readOnlyRootFilesystem=False), "root file system"),
        (lambda t: t["spec"]["volumes"].append({"name": "h", "hostPath": {"path": "/"}}), "hostPath"),
        (lambda t: t["spec"]["containers"][0]["volumeMounts"].pop(), "/home/ray"),
        (lambda t: t["spec"].update(hostNetwork=True), "hostNetwork"),
    ]
    for breach, expected in breaches:
        bad = copy.deepcopy(good)
        breach(bad)
        assert any(expected in p for p in restricted_violations(bad, "/home/ray")), expected


def test_the_autoscaler_sidecar_is_restricted_and_alone_holds_a_service_account_token(render: Callable[..., Render]) -> None:
    out = render({"mode": "raycluster", "autoscaling": {"enabled": True}})
    options = out.cluster_spec()["autoscalerOptions"]
    ctx = options["securityContext"]
    assert ctx["allowPrivilegeEscalation"] is False and ctx["readOnlyRootFilesystem"] is True
    assert ctx["capabilities"] == {"drop": ["ALL"]} and ctx["runAsNonRoot"] is True
    mounts = {m["mountPath"]: m["name"] for m in options["volumeMounts"]}
    assert mounts["/var/run/secrets/kubernetes.io/serviceaccount"] == "autoscaler-api-token"
    assert {"/tmp", "/home/ray"} <= mounts.keys()
    _, head = next(out.pod_templates())
    (token,) = [v for v in head["spec"]["volumes"] if v["name"] == "autoscaler-api-token"]
    assert "serviceAccountToken" in token["projected"]["sources"][0]
    for _, template in out.all_pod_templates():
        for container in template["spec"]["containers"]:
            assert "autoscaler-api-token" not in {m["name"] for m in container.get("volumeMounts", [])}
    # Without the autoscaler no pod carries a token at all.
    plain = render({"mode": "raycluster"})
    assert all("autoscaler-api-token" not in str(t) for _, t in plain.all_pod_templates())


@pytest.mark.parametrize("mode", ["HTTPMode", "SidecarMode"])
def test_only_k8s_job_mode_gets_a_submitter_pod(render: Callable[..., Render], mode: str) -> None:
    assert render({"rayJob": {"submissionMode": mode}}).submitter_template() is None
    submitter = render({}).submitter_template()
    assert submitter is not None and submitter["spec"]["restartPolicy"] == "Never"
    assert submitter["metadata"]["labels"]["app.kubernetes.io/component"] == "ray-submitter"


def test_a_non_default_user_and_home_follow_the_values(render: Callable[..., Render]) -> None:
    out = render({"podSecurity": {"runAsUser": 2000, "runAsGroup": 2000, "fsGroup": 2000, "homeDir": "/home/trainer"}})
    for name, template in out.all_pod_templates():
        assert template["spec"]["securityContext"]["runAsUser"] == 2000, name
        assert restricted_violations(template, "/home/trainer") == [], name


# --- the job mount path -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("mount_path", "ok"),
    [
        ("/etc/ringtrain", True),
        ("/opt/ringtrain/config/", True),
        ("/etc/ring train", False),
        ("/etc/$(id)", False),
        ("/etc/ringtrain;touch x", False),
        ("/etc/`id`", False),
        ("/etc/'x'", False),
        ("/etc/../root", False),
        ("/etc/./x", False),
        ("etc/ringtrain", False),
        ("/", False),
    ],
)
def test_the_mount_path_pattern_admits_only_plain_folders(helm: Any, mount_path: str, ok: bool) -> None:
    with helm.Chart.load(CHART) as chart:
        if ok:
            chart.render({"job": {"mountPath": mount_path}}, name=RELEASE)
            return
        with pytest.raises(helm.HelmValuesError, match=re.escape("/job/mountPath")):
            chart.render({"job": {"mountPath": mount_path}}, name=RELEASE)


@pytest.mark.parametrize("mount_path", ["/tmp", "/dev/shm", "/home/ray/"])
def test_a_mount_path_on_a_writable_volume_is_refused(helm: Any, mount_path: str) -> None:
    with helm.Chart.load(CHART) as chart, pytest.raises(helm.HelmError, match="is where the chart mounts a writable volume"):
        chart.render({"job": {"mountPath": mount_path}}, name=RELEASE)


@pytest.mark.parametrize("mode", ["rayjob", "raycluster"])
def test_the_config_path_reaches_ringtrain_quoted(render: Callable[..., Render], mode: str) -> None:
    out = render({"mode": mode, "job": {"mountPath": "/opt/ring-train.d/"}})
    text = out.ray_object()["spec"]["entrypoint"] if mode == "rayjob" else out.notes
    assert "run '/opt/ring-train.d/job.yaml'" in text
    if mode == "rayjob":
        assert shlex.split(text)[4] == "/opt/ring-train.d/job.yaml"
    for _, template in out.pod_templates():
        assert "/opt/ring-train.d" in {m["mountPath"] for m in ray_container(template)["volumeMounts"]}


def admits(policy: dict[str, Any], namespace: dict[str, str], pod: dict[str, str], port: int, *, same_namespace: bool) -> bool:
    """Whether a pod with labels ``pod`` in a namespace labelled ``namespace`` reaches ``port``
    through the policy (a peer without a namespaceSelector means the policy's own namespace)."""
    for peer in who_reaches(policy, port):
        if peer == "anyone":
            return True
        in_namespace = selects(peer["namespaceSelector"], namespace) if "namespaceSelector" in peer else same_namespace
        if in_namespace and selects(peer.get("podSelector", {}), pod):
            return True
    return False


def test_a_spoofed_operator_label_from_another_namespace_is_not_admitted(render: Callable[..., Render]) -> None:
    policy = render({}).one("NetworkPolicy")
    operator_pod = {"app.kubernetes.io/name": "kuberay-operator"}
    tenant = {"kubernetes.io/metadata.name": "tenant-a"}
    assert not admits(policy, tenant, operator_pod, 8265, same_namespace=False)
    operator_namespace = {"kubernetes.io/metadata.name": "ray-system"}
    assert admits(policy, operator_namespace, operator_pod, 8265, same_namespace=False)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        # null removes the default's key (Helm merges maps): the selector left is empty.
        ({"networkPolicy": {"operatorNamespaceSelector": {"kubernetes.io/metadata.name": None}}},
         "at '/networkPolicy/operatorNamespaceSelector'"),
        ({"auth": {"enabled": False}, "networkPolicy": {"enabled": False}}, "at '/auth/allowInsecure'"),
        ({"env": [{"name": "RAY_AUTH_MODE", "value": "disabled"}]}, "at '/env/0/name'"),
        ({"env": [{"name": "RAY_AUTH_TOKEN", "value": "x"}]}, "at '/env/0/name'"),
    ],
)
def test_the_schema_refuses_what_would_open_the_cluster(helm: Any, values: dict[str, Any], message: str) -> None:
    with helm.Chart.load(CHART) as chart:
        with pytest.raises(helm.HelmValuesError, match=re.escape(message)):
            chart.render(values, name=RELEASE)


def test_auth_and_policy_both_off_only_when_meant(render: Callable[..., Render]) -> None:
    out = render({"auth": {"enabled": False, "allowInsecure": True}, "networkPolicy": {"enabled": False}})
    assert "NetworkPolicy" not in out.kinds() and "authOptions" not in out.cluster_spec()
