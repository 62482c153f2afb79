"""infra/: the image's Dockerfile, the local Prometheus config and the local-stack script.

No Docker engine is available here, so the Dockerfile is checked for what the chart relies on.
The local-stack script is checked without starting Ray (that takes seconds and gigabytes): its
syntax, its commands, that `stop` kills exactly the processes named in its PID file, and that a
Ray temp folder someone else could have planted is refused before anything starts.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import yaml
from helmkit import CHART, REPO

from tests.tools import tool

INFRA = REPO / "infra"
SCRIPT = INFRA / "local-stack.sh"
DOCKERFILE = INFRA / "Dockerfile"


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile, continuation lines joined, comments dropped."""
    steps, pending = [], ""
    for line in path.read_text().splitlines():
        text = line.strip()
        if not text or text.startswith("#"):
            continue
        if text.endswith("\\"):
            pending += text[:-1] + " "
            continue
        op, _, args = (pending + text).partition(" ")
        steps.append((op.upper(), args.strip()))
        pending = ""
    return steps


def arg_defaults(steps: list[tuple[str, str]]) -> dict[str, str]:
    defaults = {}
    for op, args in steps:
        if op == "ARG" and "=" in args:
            name, value = args.split("=", 1)
            defaults[name] = value.strip('"')
    return defaults


def test_dockerfile_builds_a_cuda_image_with_ringtrain() -> None:
    steps = instructions(DOCKERFILE)
    defaults = arg_defaults(steps)
    base = next(args for op, args in steps if op == "FROM")
    base = re.sub(r"\$\{(\w+)\}", lambda m: defaults[m.group(1)], base)
    assert re.match(r"(nvidia/cuda:|nvcr\.io/nvidia/pytorch:)", base), f"not a CUDA base image: {base}"

    runs = " ".join(args for op, args in steps if op == "RUN")
    # torch pinned to the Makefile's version, installed before ringtrain.
    makefile_torch = re.search(r"^TORCH_VERSION \?= (\S+)$", (REPO / "Makefile").read_text(), re.MULTILINE)
    assert makefile_torch and defaults["TORCH_VERSION"] == makefile_torch.group(1)
    assert runs.index('pip install "torch==${TORCH_VERSION}"') < runs.index("pip install .")
    assert "import ringtrain.cli" in runs, "the build should prove the package imports"
    assert re.search(r"apt-get install[^&]*\bwget\b", runs), "KubeRay's probes call wget in the Ray containers"

    users = [args for op, args in steps if op == "USER"]
    assert users and users[-1] not in ("root", "0"), "Ray containers should not run as root"
    assert any(op == "CMD" and "ringtrain" in args for op, args in steps)


def test_dockerfile_copies_only_what_exists_and_the_context_allows() -> None:
    copied = []
    for op, args in instructions(DOCKERFILE):
        if op == "COPY":
            parts = [p for p in args.split() if not p.startswith("--")]
            copied += parts[:-1]
    assert {"pyproject.toml", "platform/"} <= set(copied)
    for source in copied:
        assert (REPO / source).exists(), f"COPY {source}: no such path in the repository"
    ignore = (INFRA / "Dockerfile.dockerignore").read_text().splitlines()
    assert "**" in ignore, "the build context should be an allowlist"
    allowed = {line[1:] for line in ignore if line.startswith("!")}
    assert set(copied) <= allowed, f"COPY sources the context excludes: {set(copied) - allowed}"


def test_prometheus_config_scrapes_the_ray_head() -> None:
    config = yaml.safe_load((INFRA / "prometheus.yml").read_text())
    (ray,) = [job for job in config["scrape_configs"] if job["job_name"] == "ray"]
    assert ray["honor_labels"] is True, "ringtrain's `job` label must survive the scrape"
    targets = [t for group in ray["static_configs"] for t in group["targets"]]
    metrics_port = yaml.safe_load((CHART / "values.yaml").read_text())["metrics"]["port"]
    assert targets == [f"127.0.0.1:{metrics_port}"]
    assert f"METRICS_PORT=${{METRICS_PORT:-{metrics_port}}}" in SCRIPT.read_text()


def test_promtool_accepts_the_prometheus_config() -> None:
    promtool = tool("promtool")
    result = subprocess.run(
        [promtool, "check", "config", str(INFRA / "prometheus.yml")],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_local_stack_script_parses_and_never_runs_ray_stop() -> None:
    result = subprocess.run(["bash", "-n", str(SCRIPT)], check=False, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert os.access(SCRIPT, os.X_OK), "infra/local-stack.sh should be executable"
    code = [line for line in SCRIPT.read_text().splitlines() if not line.lstrip().startswith("#")]
    assert not [line for line in code if re.search(r"\bray\b[\"']?\s+stop\b", line)]
    assert any("--metrics-export-port" in line for line in code)
    assert any('"$REPO/infra/prometheus.yml" >"$PROMETHEUS_CONFIG"' in line for line in code)
    assert any('--config.file="$PROMETHEUS_CONFIG"' in line for line in code)
    assert any('"$PYTHON" "$REPO/infra/s3_server.py" --port "$S3_PORT"' in line for line in code)
    # Token authentication on, with the token kept off every command line.
    (ray_start,) = [line for line in code if '"$PYTHON" -m ray.scripts.scripts start --head' in line]
    assert "RAY_AUTH_MODE=token" in ray_start and 'RAY_AUTH_TOKEN="$(cat "$TOKEN_FILE")"' in ray_start
    assert not [line for line in code if "RAY_AUTH_MODE=disabled" in line]
    # Every Ray port on loopback: a cluster of one, its client server's port given too.
    head = " ".join(code[code.index(ray_start) - 3 : code.index(ray_start) + 4])
    assert "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0" in head and '--ray-client-server-port="$RAY_CLIENT_PORT"' in head
    assert 'AWS_SHARED_CREDENTIALS_FILE="$CREDENTIALS_FILE"' in head and "-u AWS_ACCESS_KEY_ID" in head


def test_local_stack_script_passes_shellcheck() -> None:
    shellcheck = tool("shellcheck")
    result = subprocess.run([shellcheck, str(SCRIPT)], check=False, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout


def stack(*args: str, state: Path, **settings: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(RINGTRAIN_STACK_DIR=str(state), **settings)
    command = ["bash", str(SCRIPT), *args]
    return subprocess.run(command, check=False, capture_output=True, text=True, env=env, timeout=60)


def test_local_stack_usage_env_and_status(tmp_path: Path) -> None:
    assert stack(state=tmp_path).returncode == 2
    assert "stop" in stack("--help", state=tmp_path).stdout
    # No stack, no token: nothing to export.
    before = stack("env", state=tmp_path)
    assert before.returncode == 1 and "run" in before.stderr and "start" in before.stderr
    token = "ab" * 32
    (tmp_path / "auth_token").write_text(token + "\n")
    (tmp_path / "cluster_python").write_text("/opt/the cluster/bin/python\n")
    printed = stack("env", state=tmp_path).stdout
    assert token not in printed
    exports = dict(re.findall(r"^export (\w+)=(\S+)$", printed, re.MULTILINE))
    assert exports["RAY_ADDRESS"] == "127.0.0.1:6379"
    assert exports["RAY_API_SERVER_ADDRESS"] == "http://127.0.0.1:8265"
    assert exports["AWS_ENDPOINT_URL"] == "http://127.0.0.1:9000"
    assert exports["RAY_AUTH_MODE"] == "token"
    assert exports["RAY_AUTH_TOKEN_PATH"] == str(tmp_path / "auth_token")
    # What a shell gets from eval: the head's Python, quoted; no token of an earlier cluster.
    shell = f'RAY_AUTH_TOKEN=stale; {printed}\nprintf "%s|%s" "$RINGTRAIN_CLUSTER_PYTHON" "${{RAY_AUTH_TOKEN-unset}}"'
    evaluated = subprocess.run(["bash", "-c", shell], check=True, capture_output=True, text=True).stdout
    assert evaluated == "/opt/the cluster/bin/python|unset"
    # The stack's S3 credentials by their file, never as values; a shell's own keys would win over it.
    assert exports["AWS_SHARED_CREDENTIALS_FILE"] == str(tmp_path / "s3_credentials")
    assert "AWS_DEFAULT_REGION" in exports and not {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"} & exports.keys()
    assert "unset AWS_ACCESS_KEY_ID AWS_SECRET_ACCESS_KEY" in printed
    assert stack("status", state=tmp_path).stdout.strip() == "not running"
    stopped = stack("stop", state=tmp_path)
    assert stopped.returncode == 0 and "nothing to stop" in stopped.stderr
    assert not (tmp_path / "auth_token").exists(), "the token dies with the stack"


def _gone(pid: int) -> bool:
    """Exited (a zombie waiting to be reaped counts as exited)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    return state == "Z"


@pytest.fixture
def fake_services() -> Iterator[Callable[..., subprocess.Popen[str]]]:
    """Stand-ins for the stack's services: sleeping Pythons whose command lines carry a marker,
    each leading a process group of its own (as `start` runs them)."""
    if not Path("/proc").is_dir():
        pytest.skip("needs /proc")
    started: list[subprocess.Popen[str]] = []

    def spawn(*marker: str, child: bool = False) -> subprocess.Popen[str]:
        code = "import subprocess, sys, time\n"
        if child:  # a grandchild left behind in the group, as a dashboard's forkserver can be
            code += "print(subprocess.Popen(['sleep', '60']).pid, flush=True)\n"
        code += "time.sleep(60)\n"
        proc = subprocess.Popen(
            [sys.executable, "-c", code, *marker], stdout=subprocess.PIPE, text=True, start_new_session=True
        )
        started.append(proc)
        return proc

    yield spawn
    for proc in started:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)


def test_stop_kills_exactly_the_recorded_processes(
    tmp_path: Path, fake_services: Callable[..., subprocess.Popen[str]]
) -> None:
    s3 = fake_services("infra/s3_server.py", "--port", child=True)
    assert s3.stdout is not None
    grandchild = int(s3.stdout.readline())
    bystander = fake_services("infra/s3_server.py", "--port")  # the same command line, not in the PID file
    reused = fake_services("something-else")  # recorded as prometheus, but that PID is now another program
    (tmp_path / "pids").write_text(f"prometheus {reused.pid}\ns3 {s3.pid}\n")

    try:
        result = stack("stop", state=tmp_path)
        assert result.returncode == 0, result.stderr
        assert s3.wait(timeout=10) != 0
        assert _gone(grandchild), "what the service left in its process group must be stopped too"
        assert bystander.poll() is None and reused.poll() is None
        assert f"PID {reused.pid} is no longer prometheus" in result.stderr
        assert not (tmp_path / "pids").exists()
    finally:
        if not _gone(grandchild):
            os.kill(grandchild, 9)


def test_a_ray_temp_dir_that_is_a_link_is_refused_before_anything_starts(tmp_path: Path) -> None:
    state, elsewhere, link = tmp_path / "state", tmp_path / "elsewhere", tmp_path / "ray"
    elsewhere.mkdir(mode=0o700)
    link.symlink_to(elsewhere)
    result = stack("start", state=state, RAY_TEMP_DIR=str(link))
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip() == (
        f"local-stack: RAY_TEMP_DIR {link} is a link or not a folder; "
        "remove it, or set RAY_TEMP_DIR to a folder of your own"
    )
    assert not state.exists(), "nothing may start, no token be made"


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a folder to another user needs root")
def test_a_ray_temp_dir_of_another_user_is_refused(tmp_path: Path) -> None:
    state, planted = tmp_path / "state", tmp_path / "ray"
    planted.mkdir(mode=0o777)
    nobody = 65534
    os.chown(planted, nobody, nobody)
    result = stack("start", state=state, RAY_TEMP_DIR=str(planted))
    assert result.returncode == 2, result.stderr
    line = result.stderr.strip()
    assert line.startswith(f"local-stack: RAY_TEMP_DIR {planted} belongs to another user (uid {nobody})"), line
    assert len(line.splitlines()) == 1
    assert not state.exists()


def test_a_ray_temp_dir_is_made_or_kept_private(tmp_path: Path) -> None:
    """A missing folder is made 0700 and an open one of ours made 0700, before anything else
    (here the stack then stops, at a Python without Ray)."""
    made, opened = tmp_path / "new" / "ray", tmp_path / "open"
    opened.mkdir(mode=0o755)
    opened.chmod(0o777)
    for folder in (made, opened):
        result = stack("start", state=tmp_path / "state", RAY_TEMP_DIR=str(folder), PYTHON="/bin/false")
        assert result.returncode == 1 and "ray is missing" in result.stderr, result.stderr
        assert folder.is_dir() and not folder.is_symlink()
        assert folder.stat().st_mode & 0o777 == 0o700


PORT_VARIABLES = ("RAY_PORT", "RAY_DASHBOARD_PORT", "RAY_AGENT_PORT", "RAY_CLIENT_PORT", "METRICS_PORT", "PROMETHEUS_PORT", "S3_PORT")


def test_start_names_the_variable_of_each_port_it_finds_taken(tmp_path: Path) -> None:
    """Ports another service holds (here two of them, held by this test; the defaults are another
    Ray head's or an embedded run's) are named with the variable that moves each, before anything
    starts: no state folder, no token, no process."""
    import socket

    tool("prometheus")
    held, ports = [], {}
    try:
        for name in PORT_VARIABLES:
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            ports[name] = str(sock.getsockname()[1])
            if name in ("RAY_DASHBOARD_PORT", "RAY_AGENT_PORT"):
                sock.listen()
                held.append(sock)
            else:
                sock.close()  # a port nobody listens on: free
        state = tmp_path / "state"
        result = stack("start", state=state, RAY_TEMP_DIR=str(tmp_path / "ray"), PYTHON=sys.executable, **ports)
    finally:
        for sock in held:
            sock.close()
    assert result.returncode == 1, result.stderr
    (line,) = result.stderr.strip().splitlines()
    dashboard, agent = ports["RAY_DASHBOARD_PORT"], ports["RAY_AGENT_PORT"]
    assert line.startswith(f"local-stack: ports in use on 127.0.0.1: {dashboard} (RAY_DASHBOARD_PORT), {agent} (RAY_AGENT_PORT) "), line
    assert "RAY_DASHBOARD_PORT=<free port> RAY_AGENT_PORT=<free port>" in line
    assert not state.exists()


def test_start_names_the_s3_server_it_needs_and_how_to_install_it(tmp_path: Path) -> None:
    tool("prometheus")
    poison = tmp_path / "poison" / "moto"
    poison.mkdir(parents=True)
    (poison / "__init__.py").write_text("raise ImportError('no moto here')\n")
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\nPYTHONPATH={poison.parent} exec "{sys.executable}" "$@"\n')
    python.chmod(0o755)
    state = tmp_path / "state"
    result = stack("start", state=state, RAY_TEMP_DIR=str(tmp_path / "ray"), PYTHON=str(python))
    assert result.returncode == 1
    assert result.stderr.strip() == (
        f"local-stack: moto, the S3 server, is missing: {python} -m pip install 'moto[s3,server]' flask flask-cors "
        "(make venv-test installs them)"
    )
    assert not state.exists()
