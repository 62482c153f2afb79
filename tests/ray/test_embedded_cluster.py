"""The embedded cluster a run starts: on loopback only, with a token made for the run and kept in
the process environment, never written under ~/.ray; the user's own choice of token left alone;
none of its processes, nor any its workers started, left once it is closed. Its listeners are
taken once a worker has opened the world's rendezvous store (torch's, unauthenticated), as a
run's rank 0 does.

Each case runs in a fresh Python (as `ringtrain run` does) with its own HOME and RAY_TMPDIR and
no Ray variable of the test's environment; the first case's probe starts the cluster twice in
one process, as a driver that runs and then evaluates does.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from ringtrain.actors.cluster import loopback_interface
from ringtrain_dev.ray_head import REPO, end_processes, processes_using

pytestmark = [pytest.mark.ray, pytest.mark.slow]

PROBE = r"""
import json, os, sys
import psutil, ray
from ringtrain import config
from ringtrain.actors.cluster import connect_to
from ringtrain.actors.worker import TrainWorker

def cluster_processes():
    return [p for p in psutil.Process().children(recursive=True)]

def listening(procs):
    pids = {p.pid for p in procs}
    return sorted({c.laddr.ip for c in psutil.net_connections(kind="inet")
                   if c.status == psutil.CONN_LISTEN and c.pid in pids})

def token_of(procs, name):
    for p in procs:
        try:
            if name in " ".join(p.cmdline()):
                return p.environ().get("RAY_AUTH_TOKEN")
        except psutil.Error:
            pass
    return "no such process"

@ray.remote
class Spawner:
    def spawn(self):
        # A process of the run's own that would outlive its worker: a new session (no SIGHUP),
        # its parent gone at once (so no longer the worker's child).
        import subprocess
        out = subprocess.run(["setsid", "sh", "-c", "sleep 600 >/dev/null 2>&1 & echo $!"], capture_output=True, text=True)
        return [os.getpid(), int(out.stdout)]

def running(pid):
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False

runs = []
for first in [True, False][: int(sys.argv[1])]:
    handle = connect_to(None, num_cpus=1)
    procs = cluster_processes()
    answer = ray.get(ray.remote(lambda: "answered").remote())
    spawned = ray.get(Spawner.remote().spawn.remote()) if first else []
    worker = ray.remote(num_cpus=0)(TrainWorker).remote(config.load(None, []), 0, "cpu", True)
    store_host, _ = ray.get(worker.create_store.remote(2))
    interfaces = ray.get(worker.__ray_call__.remote(lambda self: [os.environ.get(n) for n in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")]))
    runs.append({
        "token": os.environ.get("RAY_AUTH_TOKEN"),
        "gcs_token": token_of(procs, "gcs_server"),
        "store_host": store_host,
        "rank_interfaces": interfaces,
        "listening": listening(cluster_processes()),
        "answer": answer,
        # Process groups of the cluster's processes that are the driver's own: a signal to the
        # driver's group (`kill %1`) must not reach them (actors/cluster.py).
        "in_drivers_group": [p.pid for p in procs if os.getpgid(p.pid) == os.getpgrp()],
    })
    handle.close()
    runs[-1]["after"] = {k: os.environ.get(k) for k in ("RAY_AUTH_TOKEN", "RAY_AUTH_MODE")}
    runs[-1]["spawned"] = len(spawned)
    runs[-1]["left"] = [pid for pid in spawned + [p.pid for p in procs] if running(pid)]
print("PROBE " + json.dumps(runs))
"""


@pytest.fixture
def ray_home(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    home = tmp_path / "home"
    home.mkdir()
    ray_tmp = Path(tempfile.mkdtemp(prefix="rtc-", dir="/tmp"))  # short: Ray's socket paths
    try:
        yield home, ray_tmp
    finally:
        end_processes(ray_tmp)
        left = processes_using(ray_tmp)
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert left == []


def probe(home: Path, ray_tmp: Path, starts: int = 2, **extra: str) -> list[dict[str, object]]:
    """What ``starts`` (1 or 2) clusters started one after the other in one process showed."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(
        HOME=str(home),
        RAY_TMPDIR=str(ray_tmp),
        PYTHONPATH=os.pathsep.join([str(REPO / "platform"), env.get("PYTHONPATH", "")]),
        **extra,
    )
    done = subprocess.run([sys.executable, "-c", PROBE, str(starts)], env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    (line,) = [x for x in done.stdout.splitlines() if x.startswith("PROBE ")]
    runs: list[dict[str, object]] = json.loads(line.removeprefix("PROBE "))
    return runs


def loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    mapped = getattr(ip, "ipv4_mapped", None)
    return (mapped or ip).is_loopback


def test_an_embedded_cluster_listens_on_loopback_with_a_per_run_token_off_disk(ray_home: tuple[Path, Path]) -> None:
    home, ray_tmp = ray_home
    first, second = probe(home, ray_tmp)
    for run in (first, second):
        assert re.fullmatch(r"[0-9a-f]{64}", str(run["token"])), run
        assert run["gcs_token"] == run["token"], "Ray's processes take the token from the environment"
        assert run["answer"] == "answered"
        # Loopback only: 127.0.0.1, or its IPv4-mapped IPv6 form where a server opened an IPv6 socket;
        # the rendezvous store among them (torch alone binds it to '::', every interface).
        assert run["listening"] and all(loopback(address) for address in run["listening"]), run["listening"]
        assert run["store_host"] == "127.0.0.1"
        # gloo and NCCL take the loopback interface for the ranks' connections, not the hostname's.
        assert run["rank_interfaces"] == [loopback_interface()] * 2
        assert run["after"] == {"RAY_AUTH_TOKEN": None, "RAY_AUTH_MODE": None}
        assert run["left"] == [], "every process of the cluster, and what its workers started, ends with close"
        assert run["in_drivers_group"] == [], "a signal to the driver's process group would reach the cluster"
    assert first["spawned"] == 2
    assert first["token"] != second["token"], "a token per run"
    written = [p for p in home.rglob("*") if p.is_file()]
    assert not (home / ".ray" / "auth_token").exists(), written
    for path in written:
        assert str(first["token"]) not in path.read_text(errors="replace"), path


def test_a_token_the_user_chose_is_kept(ray_home: tuple[Path, Path]) -> None:
    home, ray_tmp = ray_home
    token_file = home / "my-token"
    token_file.write_text("b" * 64)
    token_file.chmod(0o600)
    (run,) = probe(home, ray_tmp, starts=1, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(token_file))
    assert run["token"] is None and run["gcs_token"] is None  # read from the file by Ray itself
    assert run["answer"] == "answered"
    assert run["after"] == {"RAY_AUTH_TOKEN": None, "RAY_AUTH_MODE": "token"}
