"""Connecting to Ray: join a given cluster, or start an embedded one and stop it afterwards.

An embedded cluster is started with ``address="local"``, never ``ray.init()`` with no address:
the latter joins whatever cluster was last started on the machine, someone else's included.
What ringtrain starts it stops itself, through ``ray.shutdown()`` (which ends the processes the
driver started); it never runs ``ray stop``, which would end every Ray process on the host.

An embedded cluster's processes lead a process group of their own (``_own_process_group``): a
signal to the driver's group (a shell's `kill %1`, a supervisor's) reaches the driver alone,
which stops cleanly (saving its newest snapshot from the workers) and then ends the cluster.

An embedded cluster listens on 127.0.0.1 only and authenticates with a token made for the run
(``embedded_environment``). Ray 2.60 turns a node address of 127.0.0.1 into the machine's
routable one, and its servers then listen on every interface, unless it is told that the node
is a cluster of one (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, the default on macOS and Windows): an
embedded cluster is exactly that. The token lives in this process's environment, which Ray's
processes inherit and only this user can read, never in a file: left to itself, Ray would write
one to ``~/.ray/auth_token`` with the default umask (readable by every local user) and reuse it
for every later cluster. A token or mode the user chose (RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH,
RAY_AUTH_MODE=disabled) is left as it is. Both are undone when the cluster is closed.

Closing an embedded cluster ends every process it started. ``ray.shutdown()`` ends the ones the
driver started (GCS, raylet, ...), but the raylet's workers exit on their own once they notice
it is gone, a moment later on a loaded machine, and a process a worker started may have left
the process tree altogether. Each process of the cluster inherits a variable naming it
(CLUSTER_MARK_VARIABLE), so close finds the ones still there, waits for them, and ends, by PID,
those that linger.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import secrets
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

from ringtrain.actors.console import quiet_ray_console
from ringtrain.config import JobConfig, validate_gpus_per_worker
from ringtrain.errors import CapacityError, ClusterError
from ringtrain.inputs import anchored

log = logging.getLogger(__name__)


@dataclass
class ClusterHandle:
    address: str
    embedded: bool
    temp_dir: Optional[str]
    # summary.json's startup: the process's start to ray.init's, and ray.init itself
    startup: dict[str, float] = field(default_factory=dict)
    # The environment variables the embedded start set, with the values they had before.
    restore_env: dict[str, Optional[str]] = field(default_factory=dict)

    def for_workers(self, job: JobConfig) -> JobConfig:
        """``job`` as its workers read it: on a cluster this driver joined, outside a submitted
        job's working_dir, the workers run from another folder, so the relative inputs are
        anchored to the driver's (``ringtrain.inputs``)."""
        import ray

        if self.embedded or ray.get_runtime_context().runtime_env.get("working_dir"):
            return job
        return anchored(job, Path.cwd())

    def close(self, *, keep_logs: bool = False) -> None:
        """Disconnect; an embedded cluster's processes end, and its temp dir goes unless kept."""
        import ray

        if ray.is_initialized():
            ray.shutdown()
        if self.embedded and self.temp_dir:
            _end_processes(_processes_marked(self.temp_dir))
        _set_environment(self.restore_env)
        self.restore_env = {}
        if self.temp_dir and not keep_logs:
            shutil.rmtree(self.temp_dir, ignore_errors=True)


def connect(job: JobConfig) -> ClusterHandle:
    """Join ``cluster.address`` (or RAY_ADDRESS), else start an embedded local cluster."""
    before = _since_process_start()
    t0 = time.monotonic()
    handle = connect_to(job.cluster.address, num_cpus=job.cluster.num_cpus, metrics_port=job.telemetry.metrics_port)
    handle.startup = {"before_ray_init_s": before, "ray_init_s": time.monotonic() - t0}
    return handle


def _since_process_start() -> float:
    """Seconds since this process started. On Linux from the kernel's own count (clock ticks
    since boot, read against the boot clock): a start time in wall-clock seconds rests on a
    boot time the kernel rounds to the second, up to a second off."""
    try:
        with open("/proc/self/stat") as f:
            started_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        return max(0.0, time.clock_gettime(time.CLOCK_BOOTTIME) - started_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, AttributeError, IndexError, ValueError):
        import psutil  # comes with Ray

        return max(0.0, time.time() - psutil.Process().create_time())


def connect_to(address: Optional[str], *, num_cpus: Optional[int] = None, metrics_port: Optional[int] = None) -> ClusterHandle:
    """Join ``address`` (or RAY_ADDRESS), else start an embedded local cluster of ``num_cpus``
    (default: this machine's) exporting metrics on ``metrics_port`` (default: Ray's choice)."""
    import ray

    quiet_ray_console()
    address = address or os.environ.get("RAY_ADDRESS")
    restore: dict[str, Optional[str]] = {}
    try:
        if address:
            ray.init(address=address, log_to_driver=False, logging_level=logging.WARNING)
            return ClusterHandle(address=address, embedded=False, temp_dir=None)
        # Short path: Ray's unix sockets live under it and must stay below 107 characters.
        # RAY_TMPDIR is Ray's own variable for where its temp dirs go.
        temp_dir = tempfile.mkdtemp(prefix="rt-", dir=os.environ.get("RAY_TMPDIR", "/tmp"))
        # Ray sets RAY_AUTH_MODE itself when it is unset: put that back afterwards too.
        restore = {name: os.environ.get(name) for name in (*EMBEDDED_VARIABLES, CLUSTER_MARK_VARIABLE)}
        _set_environment({**embedded_environment(os.environ), CLUSTER_MARK_VARIABLE: temp_dir})
        with _own_process_group():
            ray.init(
                address="local",
                num_cpus=num_cpus or os.cpu_count() or 1,
                include_dashboard=False,
                log_to_driver=False,
                _metrics_export_port=metrics_port,
                logging_level=logging.WARNING,
                _temp_dir=temp_dir,
                # Its ports on loopback only: other hosts have no business with a one-run cluster.
                _node_ip_address="127.0.0.1",
            )
        return ClusterHandle(address="local", embedded=True, temp_dir=temp_dir, restore_env=restore)
    except ConnectionError as exc:
        _set_environment(restore)
        raise ClusterError(f"cannot reach the Ray cluster at {address}: {exc}") from None
    except BaseException:
        _set_environment(restore)
        raise


@contextlib.contextmanager
def _own_process_group() -> Iterator[None]:
    """While it lasts, the processes Ray starts for an embedded cluster (GCS, raylet, ...; the
    raylet's workers after them) lead a process group of their own instead of joining this
    process's.

    A signal sent to this process's group (a shell's `kill %1`, `kill -TERM -PGID`, a supervisor
    stopping a control group) would otherwise reach the cluster with the driver: the GCS and the
    raylet end while the driver's stop is still saving the newest snapshot from the workers, and
    the save loses that race whenever the machine is busy (the workers gone: "connection
    refused"), after which the driver waits 60 s for a GCS that is not coming back. In a group of
    their own only the driver hears it, stops cleanly, and ends the cluster itself (``close``);
    the cluster still dies with the driver (Ray ties each process's life to its parent's)."""
    import ray._private.services as services

    base = services.ConsolePopen

    class OwnGroup(base):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **{**kwargs, **_NEW_GROUP})

    services.ConsolePopen = OwnGroup
    try:
        yield
    finally:
        services.ConsolePopen = base


# Popen's arguments for a child that leads a process group of its own; before Python 3.11,
# which added process_group, a session of its own (which also leaves the terminal).
_NEW_GROUP: dict[str, Any] = {"process_group": 0} if sys.version_info >= (3, 11) else {"start_new_session": True}


# Inherited by every process of an embedded cluster, naming it (by its temp dir: one per cluster).
CLUSTER_MARK_VARIABLE = "RINGTRAIN_EMBEDDED_CLUSTER"
# How long an embedded cluster's processes get to exit after ray.shutdown(), then to die when killed.
EXIT_WAIT_S = 10.0
KILL_WAIT_S = 5.0


def _processes_marked(mark: str) -> list:
    """The processes other than this one whose CLUSTER_MARK_VARIABLE is ``mark``: the embedded
    cluster's. Another user's processes are not readable, and so never found."""
    import psutil  # comes with Ray

    found = []
    for proc in psutil.process_iter():
        if proc.pid == os.getpid():
            continue
        try:
            if proc.environ().get(CLUSTER_MARK_VARIABLE) == mark:
                found.append(proc)
        except psutil.Error:
            pass
    return found


def _end_processes(procs: list) -> None:
    """Wait for ``procs`` to exit; kill, by PID, those still there after EXIT_WAIT_S.

    Those that are not this process's descendants were left behind by a parent that is gone (a
    daemon a worker started, a worker whose raylet went first): nothing else will end them, so
    they are asked to stop at once (SIGTERM) instead of being waited for."""
    if not procs:
        return
    import psutil

    mine = {p.pid for p in psutil.Process().children(recursive=True)}
    for proc in procs:
        if proc.pid not in mine:
            try:
                proc.terminate()
            except psutil.Error:
                pass
    _, alive = psutil.wait_procs(procs, timeout=EXIT_WAIT_S)
    for proc in alive:
        log.warning("a process of the embedded cluster outlived it: killing pid %d", proc.pid)
        try:
            proc.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=KILL_WAIT_S)


# Ray's variable for "this node is the whole cluster": its node address stays 127.0.0.1.
SINGLE_NODE_VARIABLE = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
TOKEN_PATH_VARIABLE = "RAY_AUTH_TOKEN_PATH"
# What an embedded start may set, so what closing it puts back.
EMBEDDED_VARIABLES = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", SINGLE_NODE_VARIABLE)


# Where gloo and NCCL listen for the connections between ranks: by default gloo on the address
# the machine's hostname resolves to, NCCL on its first interface that is not loopback.
RANK_INTERFACE_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def rank_interfaces(environ: Mapping[str, str]) -> dict[str, str]:
    """The interface variables of a worker process of an embedded cluster: the loopback
    interface, as the cluster's own ports and the rendezvous store, so that no rank listens
    beyond this machine (a value the user set stays). None for a process of another cluster,
    whose ranks find each other on its nodes' addresses."""
    if not environ.get(CLUSTER_MARK_VARIABLE):
        return {}
    loopback = loopback_interface()
    return {name: environ.get(name) or loopback for name in RANK_INTERFACE_VARIABLES} if loopback else {}


def loopback_interface() -> Optional[str]:
    """The name of the interface that holds 127.0.0.1 (``lo`` on Linux), None where none does."""
    import psutil  # comes with Ray

    for name, addresses in psutil.net_if_addrs().items():
        if any(a.address == "127.0.0.1" for a in addresses):
            return str(name)
    return None


def embedded_environment(environ: Mapping[str, str]) -> dict[str, Optional[str]]:
    """The variables an embedded start sets: a cluster of one (loopback only), and a fresh
    per-run token (token authentication is Ray's default; Ray switches it on) unless the user
    turned authentication off or chose a token of their own."""
    chosen: dict[str, Optional[str]] = {SINGLE_NODE_VARIABLE: "0"}
    if environ.get("RAY_AUTH_MODE", "").lower() == "disabled":
        return chosen
    if environ.get("RAY_AUTH_TOKEN", "").strip() or environ.get(TOKEN_PATH_VARIABLE, "").strip():
        return chosen
    return {**chosen, "RAY_AUTH_TOKEN": secrets.token_hex(32)}


def _set_environment(values: dict[str, Optional[str]]) -> None:
    """Set (None: remove) each variable, and have this process's Ray read them again: it reads
    the single-node flag once at import, and caches the token it loaded once per process (a
    later cluster in this process has another)."""
    if not values:
        return
    for name, value in values.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    import ray._private.ray_constants as ray_constants
    from ray._common.utils import env_bool

    ray_constants.ENABLE_RAY_CLUSTER = env_bool(SINGLE_NODE_VARIABLE, not ray_constants.IS_WINDOWS_OR_OSX)
    try:
        from ray._raylet import AuthenticationTokenLoader

        AuthenticationTokenLoader.instance().reset_cache()
    except (ImportError, AttributeError):
        pass


def resolve_device(job: JobConfig) -> str:
    """'cuda' or 'cpu': what the workers will run on, given the config and the cluster.

    With ``cluster.device=auto`` the device is known only here, so the CUDA-only rule on
    ``cluster.gpus_per_worker`` is checked here too (``validate`` checks it for an explicit cuda).
    """
    import ray

    if job.cluster.device != "auto":
        device = job.cluster.device
    else:
        device = "cuda" if ray.cluster_resources().get("GPU", 0) > 0 else "cpu"
    if device == "cuda":
        validate_gpus_per_worker(job.cluster.gpus_per_worker)
    return device


def cuda_device_index(gpu_ids: Sequence[Union[int, str]], visible_devices: Optional[str]) -> int:
    """The CUDA index, among the devices this process sees, of the first GPU Ray assigned it.

    ``gpu_ids`` is ``ray.get_gpu_ids()``: the actor's GPUs in the node's numbering (integers,
    or UUIDs where the node lists its GPUs by UUID). ``visible_devices`` is this process's
    CUDA_VISIBLE_DEVICES, None when unset. Ray normally narrows that variable to the actor's
    own GPUs, which makes the answer 0; but with RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES
    set (or a runtime that lists the whole node) every GPU of the node stays visible, and a
    hard-coded ``cuda:0`` would put every worker on the same device. So the index is the
    id's position in the visible list, or the id itself when the variable is unset (all
    devices visible, in the node's order).
    """
    if not gpu_ids:
        raise ValueError(
            "Ray assigned this worker no GPU (ray.get_gpu_ids() is empty): a CUDA worker needs "
            "cluster.gpus_per_worker >= 1"
        )
    assigned = str(gpu_ids[0]).strip()
    if visible_devices is None:
        if not assigned.isdigit():
            raise ValueError(f"GPU {assigned!r} assigned by Ray is not an index and CUDA_VISIBLE_DEVICES is unset")
        return int(assigned)
    visible = [v.strip() for v in visible_devices.split(",") if v.strip()]
    if assigned not in visible:
        raise ValueError(
            f"GPU {assigned!r} assigned by Ray is not among CUDA_VISIBLE_DEVICES={visible_devices!r}"
        )
    return visible.index(assigned)


def worker_resources(job: JobConfig, device: str) -> dict[str, float]:
    res = {"CPU": job.cluster.cpus_per_worker}
    if device == "cuda":
        res["GPU"] = job.cluster.gpus_per_worker
    return res


def check_capacity(job: JobConfig, device: str) -> None:
    """Refuse a mesh the cluster can never place, naming the keys to change."""
    import ray

    capacity_problem(job, worker_resources(job, device), ray.cluster_resources())


def check_embedded_capacity(job: JobConfig) -> None:
    """Before an embedded cluster starts (no cluster.address, no RAY_ADDRESS): refuse a mesh its
    CPUs (cluster.num_cpus, else this machine's) can never place, with a setting that fits. A
    joined cluster's resources are known only once joined (``check_capacity``)."""
    if job.cluster.address or os.environ.get("RAY_ADDRESS"):
        return
    capacity_problem(job, {"CPU": job.cluster.cpus_per_worker}, {"CPU": float(job.cluster.num_cpus or os.cpu_count() or 1)})


def capacity_problem(job: JobConfig, per_worker: dict[str, float], total: dict[str, float]) -> None:
    """CapacityError when ``total`` cannot hold every worker (and spare) of ``per_worker`` each."""
    workers = job.world_size + job.mesh.spares
    for resource, each in per_worker.items():
        need = each * workers
        have = total.get(resource, 0.0)
        if need > have + 1e-9:
            per_key = "cluster.gpus_per_worker" if resource == "GPU" else "cluster.cpus_per_worker"
            keys, values = "mesh.dp x mesh.cp", f"{job.mesh.dp} x {job.mesh.cp}"
            if job.mesh.spares:
                keys, values = f"{keys} + mesh.spares", f"{values} + {job.mesh.spares}"
            fits = math.floor(have / workers * 10) / 10  # Ray's fractional CPUs, to a tenth
            hint = f"; {per_key}={fits:g} fits" if resource == "CPU" and fits > 0 else ""
            raise CapacityError(
                "mesh.dp",
                f"{keys} = {values} = {workers} workers need {need:g} {resource} ({per_key}={each:g}) "
                f"but the cluster has {have:g}{hint}",
            )


