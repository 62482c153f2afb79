"""infra/local-stack.sh for real: the Ray head runs with token authentication, the token file the
stack keeps (and never prints) opens it, and nothing else does; Prometheus still scrapes the head;
every port of the stack, and of a job's workers on it, listens on loopback only; its S3 answers
the stack's own credentials only; a job submitted from a shell whose PATH has no venv runs on the
head's Python, checkpoints to the stack's S3 with no --env, and succeeds.

The stack runs on free loopback ports with its own state folder, Ray temp folder and HOME, and
`stop` must leave no process of it behind (found by its RAY_TMPDIR, as ringtrain_dev/ray_head.py does).
"""

from __future__ import annotations

import configparser
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from ringtrain_dev.ray_head import REPO, VENV_BIN, end_processes, free_ports, processes_of, processes_using, shell_path
from ringtrain_dev.tiny import TINY
from tests.tools import tool

pytestmark = [pytest.mark.ray, pytest.mark.slow]

SCRIPT = REPO / "infra" / "local-stack.sh"
SCRAPE_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Stack:
    env: dict[str, str]  # the script's settings; no Ray variables of a client
    exports: dict[str, str]  # what `env` printed
    started: subprocess.CompletedProcess[str]
    state: Path
    ports: dict[str, int]


def script(env: dict[str, str], *args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def local_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tool("prometheus")
    state = tmp_path_factory.mktemp("stack")
    ray_tmp = Path(tempfile.mkdtemp(prefix="rts-", dir="/tmp"))  # short: Ray's socket paths
    names = ("RAY_PORT", "RAY_DASHBOARD_PORT", "RAY_AGENT_PORT", "RAY_CLIENT_PORT", "METRICS_PORT", "PROMETHEUS_PORT", "S3_PORT")
    ports = dict(zip(names, free_ports(len(names))))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "AWS_"))}
    env.update({k: str(v) for k, v in ports.items()})
    env.update(
        RINGTRAIN_STACK_DIR=str(state),
        RAY_TEMP_DIR=str(ray_tmp),
        HOME=str(tmp_path_factory.mktemp("home")),
        PYTHON=sys.executable,
        # A user's shell that never activated the venv: its `python` is not the one with
        # ringtrain's dependencies (here one that fails when run).
        PATH=shell_path(state / "shell-bin"),
    )
    try:
        started = script(env, "start")
        assert started.returncode == 0, started.stderr[-3000:]
        printed = script(env, "env")
        assert printed.returncode == 0, printed.stderr
        exports = dict(re.findall(r"^export (\w+)=(\S+)$", printed.stdout, re.MULTILINE))
        yield Stack(env, exports, started, state, ports)
        stopped = script(env, "stop", timeout=120)
        assert stopped.returncode == 0, stopped.stderr
    finally:
        if (state / "pids").exists():  # a failed test above: stop what was started anyway
            script(env, "stop", timeout=120)
        end_processes(ray_tmp)  # by PID, should a process have outlived the stop
        left = processes_using(ray_tmp)
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert left == [], f"the stack left processes behind: {left}"


def client_env(stack: Stack, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in stack.env.items()}
    env.update(PYTHONPATH=os.pathsep.join([str(REPO / "platform"), env.get("PYTHONPATH", "")]), **extra)
    return env


def ringtrain(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ringtrain", *args], env=env, cwd=REPO, capture_output=True, text=True, timeout=120
    )


def test_the_stack_keeps_its_token_in_a_private_file_and_never_prints_it(local_stack: Stack) -> None:
    token_file = local_stack.state / "auth_token"
    token = token_file.read_text().strip()
    assert re.fullmatch(r"[0-9a-f]{64}", token)
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    assert stat.S_IMODE(local_stack.state.stat().st_mode) == 0o700
    assert str(token_file) in local_stack.started.stderr
    assert token not in local_stack.started.stderr + local_stack.started.stdout
    printed = script(local_stack.env, "env")
    assert token not in printed.stdout + printed.stderr
    assert local_stack.exports["RAY_AUTH_MODE"] == "token"
    assert local_stack.exports["RAY_AUTH_TOKEN_PATH"] == str(token_file)
    assert "RAY_AUTH_TOKEN" not in local_stack.exports and "unset RAY_AUTH_TOKEN" in printed.stdout
    assert local_stack.exports["RINGTRAIN_CLUSTER_PYTHON"] == sys.executable
    assert stat.S_IMODE(Path(local_stack.env["RAY_TEMP_DIR"]).stat().st_mode) == 0o700
    # Never on a command line, where every local user can read it.
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True, check=True).stdout
    assert token not in ps


def test_the_head_answers_only_with_the_token(local_stack: Stack) -> None:
    dashboard = f"http://127.0.0.1:{local_stack.ports['RAY_DASHBOARD_PORT']}"
    without = ringtrain(client_env(local_stack, RAY_AUTH_MODE="disabled"), "status", "--address", dashboard)
    assert without.returncode == 2, without.stderr
    assert "requires a token" in without.stderr and "--token" in without.stderr
    wrong = ringtrain(client_env(local_stack, RAY_AUTH_TOKEN="0" * 64), "status", "--address", dashboard)
    assert wrong.returncode == 2 and "refused the token" in wrong.stderr, wrong.stderr
    # What `eval "$(infra/local-stack.sh env)"` gives a shell: the address and the token.
    with_env = ringtrain(client_env(local_stack, **local_stack.exports), "status")
    assert with_env.returncode == 0, with_env.stderr
    assert with_env.stdout.strip() == "no submitted jobs"
    # Ray's own CLI, from the same exports.
    listed = subprocess.run(
        [str(VENV_BIN / "ray"), "job", "list"], env=client_env(local_stack, **local_stack.exports),
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert listed.returncode == 0, listed.stderr[-2000:]


def test_prometheus_scrapes_the_head_with_auth_on(local_stack: Stack) -> None:
    url = f"http://127.0.0.1:{local_stack.ports['PROMETHEUS_PORT']}/api/v1/query?query=up%7Bjob%3D%22ray%22%7D"
    deadline = time.monotonic() + SCRAPE_TIMEOUT_S
    while True:
        with urllib.request.urlopen(url, timeout=10) as response:
            result = json.load(response)["data"]["result"]
        if result and result[0]["value"][1] == "1":
            break
        assert time.monotonic() < deadline, f"Prometheus did not scrape the head: {result}"
        time.sleep(1)
    assert result[0]["metric"]["instance"] == f"127.0.0.1:{local_stack.ports['METRICS_PORT']}"


LOOPBACK = {"127.0.0.1", "::1", "::ffff:127.0.0.1"}


def stack_processes(stack: Stack) -> set[int]:
    """The PIDs of every process of the stack: its services and all the Ray head started (the
    GCS, raylet, agents, dashboard, and a job's driver and workers)."""
    pids = {int(line.split()[1]) for line in (stack.state / "pids").read_text().splitlines() if line.strip()}
    return pids | {p.pid for p in processes_of(Path(stack.env["RAY_TEMP_DIR"]))}


def off_loopback(pids: set[int]) -> list[str]:
    """Listening sockets of ``pids`` on an address other than loopback, described. A training
    worker's own sockets are the trainers' (rank 0's rendezvous store, train/mesh.py), not the
    stack's: left out here."""
    import psutil

    found = []
    for c in psutil.net_connections(kind="inet"):
        if c.pid not in pids or c.status != psutil.CONN_LISTEN or c.laddr.ip in LOOPBACK:
            continue
        try:
            command = " ".join(psutil.Process(c.pid).cmdline())
        except psutil.Error:
            continue
        if "TrainWorker" not in command:
            found.append(f"pid {c.pid} ({command[:80]}): {c.laddr.ip}:{c.laddr.port}")
    return sorted(found)


def test_every_port_of_the_stack_listens_on_loopback_only(local_stack: Stack) -> None:
    import psutil

    pids = stack_processes(local_stack)
    listening = [c for c in psutil.net_connections(kind="inet") if c.pid in pids and c.status == psutil.CONN_LISTEN]
    ports = {c.laddr.port for c in listening}
    assert {int(p) for p in local_stack.ports.values()} <= ports, "a port of the stack is not listening: the check would see nothing"
    assert off_loopback(pids) == []


def test_the_stacks_s3_answers_its_own_credentials_only(local_stack: Stack) -> None:
    import boto3
    from botocore.exceptions import ClientError

    credentials = Path(local_stack.exports["AWS_SHARED_CREDENTIALS_FILE"])
    assert credentials.parent == local_stack.state and stat.S_IMODE(credentials.stat().st_mode) == 0o600
    keys = configparser.ConfigParser()
    keys.read(credentials)
    key_id, secret = keys["default"]["aws_access_key_id"], keys["default"]["aws_secret_access_key"]
    printed = script(local_stack.env, "env")
    assert secret not in local_stack.started.stdout + local_stack.started.stderr + printed.stdout + printed.stderr
    endpoint = local_stack.exports["AWS_ENDPOINT_URL"]
    ours = boto3.session.Session(aws_access_key_id=key_id, aws_secret_access_key=secret, region_name="us-east-1")
    assert ours.client("s3", endpoint_url=endpoint).list_objects_v2(Bucket="ringtrain")["KeyCount"] >= 0
    for key, secret_key in (("testing", "testing"), (key_id, "wrong")):
        other = boto3.session.Session(aws_access_key_id=key, aws_secret_access_key=secret_key, region_name="us-east-1")
        with pytest.raises(ClientError) as refused:
            other.client("s3", endpoint_url=endpoint).list_objects_v2(Bucket="ringtrain")
        assert refused.value.response["Error"]["Code"] in ("InvalidAccessKeyId", "SignatureDoesNotMatch")
    # moto's control API, which would turn the check off (or empty every bucket), is refused.
    for path in ("/moto-api/reset-auth", "//moto-api/reset-auth", "/moto-api/data.json"):
        request = urllib.request.Request(f"{endpoint}{path}", data=b"inf", method="POST", headers={"Content-Type": "text/plain"})
        with pytest.raises(urllib.error.HTTPError) as answered:
            urllib.request.urlopen(request, timeout=10)
        assert answered.value.code in (403, 308), path
    with pytest.raises(ClientError):
        boto3.session.Session(aws_access_key_id="testing", aws_secret_access_key="testing", region_name="us-east-1").client(
            "s3", endpoint_url=endpoint
        ).list_objects_v2(Bucket="ringtrain")


def test_a_job_submitted_from_a_shell_without_the_venv_checkpoints_to_the_stacks_s3(local_stack: Stack) -> None:
    """`ringtrain submit` as the README has it, from a shell whose `python` is not the venv's (nor
    was it when the stack started): the job's entrypoint names the head's Python, which `env`
    exported as RINGTRAIN_CLUSTER_PYTHON, and its checkpoints go to the stack's S3 with no --env
    (the head hands every job the stack's endpoint and credentials file). While it trains, its
    driver and workers listen on loopback only, as the stack does."""
    env = client_env(local_stack, **local_stack.exports)
    submitted = ringtrain(
        env, "submit", "jobs/quickstart.yaml", *TINY, "train.steps=2", "mesh.dp=1", "mesh.cp=2",
        "checkpoint.uri=s3://ringtrain/submitted", "checkpoint.persist_every=1", "--no-wait",
    )  # fmt: skip
    assert submitted.returncode == 0, submitted.stderr[-2000:]
    assert "started: its inputs passed their checks on the cluster" in submitted.stderr
    submission_id = submitted.stdout.strip().splitlines()[0]
    deadline = time.monotonic() + 300
    status = ""
    exposed: list[str] = []
    while time.monotonic() < deadline:
        exposed += off_loopback(stack_processes(local_stack))
        status = ringtrain(env, "status", submission_id).stdout
        if any(word in status for word in ("SUCCEEDED", "FAILED", "STOPPED")):
            break
        time.sleep(3)
    logs = ringtrain(env, "logs", submission_id).stdout
    assert "SUCCEEDED" in status, f"{status}\n{logs[-3000:]}"
    assert exposed == []
    assert "checkpoint step 2: " in logs and "-> s3://ringtrain/submitted/step-000000002" in logs, logs[-3000:]
