"""What the Ray-tier tests and the benches share: a Ray head of our own, and its processes.

Everything a Ray cluster of ours starts (the head's daemons, job drivers, training workers)
inherits the RAY_TMPDIR it was given, so that names them all: they are found by it and ended by
PID, never with ``ray stop``, which would end every Ray process on the machine.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Iterator, Optional

import psutil

REPO = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent
# DeepSpeed JIT-compiles a C++ op into ~/.cache; tests and benches give each run its own HOME,
# so the build cache is kept in the repo (git-ignored) instead of being rebuilt by every run.
TORCH_EXTENSIONS_DIR = REPO / ".ringtrain-cache" / "torch_extensions"
# Ray hands out worker ports from this range; a fixed port inside it could be taken by a worker.
RAY_WORKER_PORTS = range(10002, 20000)
HEAD_START_TIMEOUT_S = 120.0


def free_ports(count: int) -> list[int]:
    """Distinct ports free right now, none in Ray's worker range."""
    ports: list[int] = []
    while len(ports) < count:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        if port not in RAY_WORKER_PORTS and port not in ports:
            ports.append(port)
    return ports


def processes_of(path: Path) -> list[psutil.Process]:
    """Live processes started for the cluster whose RAY_TMPDIR is ``path``.

    Ray workers rename themselves (``ray::TrainWorker.train_step``), so the command line is not
    enough; every process the cluster started inherits its environment, which names ``path``.
    Not every one keeps it readable: the raylet's agents (``ray::DashboardAgent``) retitle
    themselves over it, so the descendants of every process found count too.
    """
    found: dict[int, psutil.Process] = {}
    for proc in psutil.process_iter(["pid", "cmdline"]):
        if proc.pid == os.getpid():
            continue
        try:
            env = proc.environ()
        except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
        if env.get("RAY_TMPDIR") == str(path) or str(path) in " ".join(proc.info["cmdline"] or []):
            found[proc.pid] = proc
    for proc in list(found.values()):
        try:
            found.update((child.pid, child) for child in proc.children(recursive=True) if child.pid != os.getpid())
        except psutil.NoSuchProcess:
            pass
    return list(found.values())


def holding_files_under(path: Path) -> list[str]:
    """Processes with a file under ``path`` open (described): whatever a cluster left running,
    found without trusting how its processes name themselves."""
    held = []
    for proc in psutil.process_iter(["pid"]):
        try:
            if any(f.path.startswith(f"{path}/") for f in proc.open_files()):
                held.append(describe(proc))
        except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
    return held


def describe(proc: psutil.Process) -> str:
    try:
        return f"{proc.pid}: {' '.join(proc.cmdline())[:120]}"
    except psutil.Error:
        return f"{proc.pid}: (gone while listed)"


def processes_using(path: Path) -> list[str]:
    """The processes of ``processes_of`` and those holding a file under ``path``, described (pid
    and command line): a test asserts none is left."""
    return sorted({describe(p) for p in processes_of(path)} | set(holding_files_under(path)))


def end_processes(path: Path) -> None:
    """Terminate, then kill, every process of the cluster, by PID.

    In rounds: a worker the raylet was starting while the first round ran shows up in the next.
    """
    for _ in range(3):
        procs = processes_of(path)
        if not procs:
            return
        for proc in procs:
            try:
                proc.terminate()
            except psutil.NoSuchProcess:
                pass
        # gcs_server and the autoscaler monitor sit out SIGTERM for many seconds.
        _, alive = psutil.wait_procs(procs, timeout=3)
        for proc in alive:
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(alive, timeout=10)


# What the `python` of a user's shell that never activated the venv is, made certain: a Python
# without ringtrain's dependencies fails the same way, but whether one is on the PATH varies.
DECOY_PYTHON = '#!/bin/sh\necho "ringtrain test: $0 is the shell\'s python, not the cluster\'s" >&2\nexit 97\n'


def shell_path(decoy_dir: Path) -> str:
    """A PATH as a user's shell has it without the venv: this one minus the venv's folder, led
    by a ``python`` (and ``python3``) that is not the cluster's and fails when run (``DECOY_PYTHON``).
    A job whose entrypoint relies on ``python`` of the head's PATH fails on it."""
    decoy_dir.mkdir(parents=True, exist_ok=True)
    for name in ("python", "python3"):
        decoy = decoy_dir / name
        decoy.write_text(DECOY_PYTHON)
        decoy.chmod(0o755)
    kept = [p for p in os.environ.get("PATH", "").split(os.pathsep) if p and Path(p) != VENV_BIN]
    return os.pathsep.join([str(decoy_dir), *kept])


def head_env(home: Path, temp_dir: Path, *, token: Optional[str] = None) -> dict[str, str]:
    """The environment of a head and of every command run against it: token authentication
    with ``token`` (Ray's daemons, job drivers and clients all read RAY_AUTH_TOKEN), else off.
    The PATH is a user's shell's without the venv (``shell_path``): the head is started by the
    venv's ``ray`` by its path, and jobs name the venv's Python (RINGTRAIN_CLUSTER_PYTHON), as the
    README has it."""
    env = dict(os.environ)
    for name in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        env.pop(name, None)
    if token is not None:
        env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token)
    else:
        env["RAY_AUTH_MODE"] = "disabled"
    env.update(
        HOME=str(home),
        RAY_TMPDIR=str(temp_dir),
        TORCH_EXTENSIONS_DIR=str(TORCH_EXTENSIONS_DIR),
        PATH=shell_path(home / "shell-bin"),
        RINGTRAIN_CLUSTER_PYTHON=sys.executable,
        PYTHONPATH=os.pathsep.join([str(REPO / "platform"), env.get("PYTHONPATH", "")]),
    )
    return env


@contextlib.contextmanager
def running_head(
    temp_dir: Path, env: dict[str, str], *, dashboard: bool, object_store_bytes: Optional[int] = None
) -> Iterator[tuple[int, int]]:
    """``ray start --head`` with 4 CPUs on free loopback ports, its temp dir ``temp_dir`` (short:
    Ray's unix socket paths live below it and must stay under 107 bytes); yields (GCS port,
    dashboard port: the job API when ``dashboard``). Its processes are ended by PID afterwards."""
    # Ray records "the current cluster" under $RAY_TMPDIR/ray; this keeps it out of /tmp/ray.
    (temp_dir / "ray").mkdir(exist_ok=True)
    gcs, dashboard_port, client_server, agent, metrics = free_ports(5)
    command = [
        str(VENV_BIN / "ray"), "start", "--head",
        "--port", str(gcs),
        "--dashboard-host", "127.0.0.1",
        "--dashboard-port", str(dashboard_port),
        "--include-dashboard", "true" if dashboard else "false",
        "--ray-client-server-port", str(client_server),
        "--dashboard-agent-listen-port", str(agent),
        "--metrics-export-port", str(metrics),
        "--num-cpus", "4",
        *(["--object-store-memory", str(object_store_bytes)] if object_store_bytes else []),
        "--temp-dir", str(temp_dir),
        "--disable-usage-stats",
    ]  # fmt: skip
    try:
        started = subprocess.run(command, env=env, capture_output=True, text=True, timeout=HEAD_START_TIMEOUT_S)
        if started.returncode != 0:
            raise RuntimeError(f"ray start --head failed:\n{started.stderr[-3000:]}")
        yield gcs, dashboard_port
    finally:
        end_processes(temp_dir)
