"""The only place that creates process groups: dp, cp (ring and Ulysses) and DeepSpeed's view of them.

``torch.distributed.new_group`` is collective over the whole world: every rank must create
every group, in the same order, even the groups it is not a member of. So each rank walks the
full list from ``Topology`` and keeps its own.
"""

from __future__ import annotations

import datetime
import os
import socket
import threading
from dataclasses import dataclass, fields
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from ringtrain.topology import RankCoord, Topology

ProcessGroup = Any  # torch.distributed.ProcessGroup; Any keeps mypy quiet across torch versions


def init_process_group(
    *,
    backend: str,
    host: str,
    port: int,
    rank: int,
    world_size: int,
    timeout_s: float,
    device_id: Optional[torch.device] = None,
) -> None:
    """Join the world through rank 0's TCPStore (rank 0 created it on port 0, so no port race).

    ``timeout_s`` bounds forming the group (the rendezvous, and the connections: gloo retries a
    connect to a dead peer's address until it); ``build_mesh`` gives its collectives their own.
    ``device_id`` (CUDA only) binds the NCCL communicators to this rank's device up front.
    """
    # Torch names unnamed groups from a process-wide counter that only destroying a world resets.
    # An init that failed (a peer died as the world formed) left no world to destroy but took a
    # name: this process's groups would be named apart from its peers' ever after, each rank
    # waiting for keys the others write under other names. Every world starts from 0.
    if not dist.is_initialized():
        c10d._world.group_count = 0
    check_store_listens(host, port)
    # Connecting is bounded apart from the join: torch's client retries a connect that fails for
    # twice its timeout, and rank 0 dying while this rank connects would hold it that long.
    connect_s = min(timeout_s, STORE_CONNECT_TIMEOUT_S)
    store = dist.TCPStore(host, port, world_size, is_master=False, timeout=datetime.timedelta(seconds=connect_s))
    store.set_timeout(datetime.timedelta(seconds=timeout_s))
    dist.init_process_group(
        backend,
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
        device_id=device_id,
    )


# How long connecting to rank 0's store may take before the store counts as gone. It is open
# before any rank is asked to join, so a live one answers at once.
STORE_CONNECT_TIMEOUT_S = 5.0


def check_store_listens(host: str, port: int) -> None:
    """Fail now if nothing listens at rank 0's store. A rank is asked to join only once that
    store is open, so a refused connect means its process died, and torch's client would still
    retry it for twice its connect timeout."""
    try:
        with socket.create_connection((host, port), timeout=STORE_CONNECT_TIMEOUT_S):
            pass
    except OSError as exc:
        raise dist.DistNetworkError(f"rank 0's rendezvous store at {host}:{port} is gone ({exc})") from exc


def create_store(host: str, world_size: int, timeout_s: float) -> tuple[dist.TCPStore, int]:
    """Rank 0's rendezvous store on a free port of ``host``; keep the returned store alive for
    the job.

    The store answers anyone who connects, with no authentication, and torch's own server
    listens on every interface whatever host it is given. So its socket is bound here, to
    ``host`` alone (the node's address in the cluster, 127.0.0.1 in an embedded run), and
    handed to torch, which closes it with the store."""
    listener = listen_on(host)
    try:
        store = dist.TCPStore(
            host,
            listener.getsockname()[1],
            world_size,
            is_master=True,
            wait_for_workers=False,
            timeout=datetime.timedelta(seconds=timeout_s),
            master_listen_fd=listener.fileno(),
        )
    except BaseException:
        listener.close()
        raise
    listener.detach()  # the store's now
    return store, store.port


# Connections rank 0's store may hold waiting to be accepted: a world's ranks join at once.
STORE_BACKLOG = 1024


def listen_on(host: str) -> socket.socket:
    """A listening TCP socket on a free port of ``host`` only (IPv4 or IPv6, as it resolves)."""
    family, kind, proto, _, address = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
    listener = socket.socket(family, kind, proto)
    try:
        listener.bind(address)
        listener.listen(STORE_BACKLOG)
    except BaseException:
        listener.close()
        raise
    return listener


def open_sockets() -> dict[int, str]:
    """This process's open sockets: fd -> ``socket:[inode]`` (the inode tells a reused fd apart)."""
    found = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:  # closed while we looked
            continue
        if target.startswith("socket:"):
            found[int(name)] = target
    return found


def abort_all() -> str:
    """Abort every process group of this process, so a collective blocked in it (NCCL) returns
    with an error now; returns how ("" when there is none). The process, its model and its
    in-memory snapshots stay: the next world is joined with ``init_process_group``.

    NCCL's abort of a communicator waits for its proxy thread, which looks at the abort flag
    only between 500 ms polls: 0.5 to 1 s per communicator (measured on an H100 with NCCL
    2.28, bench/nccl_abort.py). torch's helper aborts the groups one after another, so the
    waits add up (6.8 s for a mesh's seven groups); every group aborted at once from a thread
    of its own (the abort releases the GIL) costs one wait. The helper then only tidies torch's
    bookkeeping: a second abort of an aborted communicator returns at once.
    """
    if not dist.is_initialized():
        return ""
    _abort_concurrently(list(c10d._world.pg_map))
    helper = getattr(c10d, "_abort_process_group", None)
    if helper is None:  # torch without the helper: the groups' own aborts were all there is
        return "abort"
    helper()
    return "_abort_process_group"


def _abort_concurrently(groups: list[Any]) -> None:
    """``group.abort()`` for every group at once, each on a thread; the first failure is raised."""
    failures: list[BaseException] = []

    def abort(group: Any) -> None:
        try:
            getattr(group, "abort", lambda: None)()
        except BaseException as error:  # noqa: BLE001 - raised on the caller's thread below
            failures.append(error)

    threads = [threading.Thread(target=abort, args=(group,), name="abort-group", daemon=True) for group in groups]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if failures:
        raise failures[0]


def sever(connections: dict[int, str]) -> int:
    """Shut down the still-open, connected sockets of ``connections``; returns how many.

    Gloo has no working abort: a rank blocked in a collective waits for its peers' bytes until
    the process-group timeout, even after every peer gave up, because a failed peer keeps its
    connections open as long as anything references its process groups. Shutting the sockets
    down makes every peer's pending read fail at once (and this rank's own), which spreads a
    failure through the world in milliseconds. Listening sockets are left alone: gloo's accept
    loop treats their shutdown as fatal.
    """
    current = open_sockets()
    done = 0
    for fd, inode in connections.items():
        if current.get(fd) != inode:  # gloo closed it, or the fd now names another socket
            continue
        try:
            sock = socket.socket(fileno=fd)
        except OSError:  # closed since we looked
            continue
        try:
            if not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                sock.shutdown(socket.SHUT_RDWR)
                done += 1
        except OSError:
            pass
        finally:
            sock.detach()  # the fd stays gloo's to close
    return done


@dataclass
class Mesh:
    topology: Topology
    coord: RankCoord
    dp_group: ProcessGroup
    cp_group: ProcessGroup
    ring_group: ProcessGroup
    ulysses_group: ProcessGroup
    zero_group: ProcessGroup  # all dp x cp ranks: ZeRO partitions and averages gradients over it
    self_group: ProcessGroup  # just this rank, for the parallelisms DeepSpeed asks about but we do not use

    @property
    def rank(self) -> int:
        return self.coord.rank

    def groups(self) -> list[ProcessGroup]:
        """This rank's groups (the ``*_group`` fields), each once: a group can serve two roles."""
        seen: dict[int, ProcessGroup] = {}
        for f in fields(self):
            if f.name.endswith("_group"):
                seen.setdefault(id(getattr(self, f.name)), getattr(self, f.name))
        return list(seen.values())


def build_mesh(
    topology: Topology, rank: int, *, form_timeout_s: Optional[float] = None, timeout_s: Optional[float] = None
) -> Mesh:
    """Create every group of the dp x cp grid; collective, so all ranks call it together.

    ``form_timeout_s`` bounds forming each group (as ``init_process_group``'s does the world's);
    ``timeout_s`` is then every group's collective timeout, the world's included (None: torch's
    defaults)."""
    if dist.get_world_size() != topology.world_size:
        raise RuntimeError(f"world size {dist.get_world_size()} does not match the mesh {topology}")
    forming = datetime.timedelta(seconds=form_timeout_s) if form_timeout_s is not None else None

    def mine(groups: list[list[int]]) -> ProcessGroup:
        found: Optional[ProcessGroup] = None
        for ranks in groups:
            group = dist.new_group(ranks, timeout=forming)
            if rank in ranks:
                found = group
        assert found is not None, f"rank {rank} is in none of {groups}"
        return found

    mesh = Mesh(
        topology=topology,
        coord=topology.coord(rank),
        dp_group=mine(topology.dp_groups()),
        cp_group=mine(topology.cp_groups()),
        ring_group=mine(topology.ring_groups()),
        ulysses_group=mine(topology.ulysses_groups()),
        zero_group=mine([list(range(topology.world_size))]),
        self_group=mine([[r] for r in range(topology.world_size)]),
    )
    if timeout_s is not None:
        for group in (c10d._get_default_group(), *mesh.groups()):
            c10d._set_pg_timeout(datetime.timedelta(seconds=timeout_s), group)
    return mesh


class DeepSpeedMpu:
    """The model-parallel-unit interface DeepSpeed reads its groups from.

    ZeRO sees one data-parallel group of all dp x cp ranks and no sequence parallelism of its
    own. Each rank's loss is its summed token loss over the mean number of labels a rank holds
    (see train/trainer.py), so averaging gradients over dp x cp gives the gradient of the
    global mean loss.
    DeepSpeed's own sequence-parallel mode is avoided on purpose: stages 1-2 then *sum* over
    the sequence ranks while stage 3 averages over them, and stage 3's conversion of an
    existing model partitions over the pure-dp group only (``parameter_offload.py``), so the
    cp ranks' gradients would never meet.
    """

    def __init__(self, mesh: Mesh) -> None:
        self.mesh = mesh

    def get_data_parallel_group(self) -> ProcessGroup:
        return self.mesh.zero_group

    def get_data_parallel_world_size(self) -> int:
        return self.mesh.topology.world_size

    def get_data_parallel_rank(self) -> int:
        return self.mesh.rank

    def get_data_parallel_group_ranks(self) -> list[int]:
        return list(range(self.mesh.topology.world_size))

    get_sequence_data_parallel_group = get_data_parallel_group
    get_sequence_data_parallel_world_size = get_data_parallel_world_size
    get_sequence_data_parallel_rank = get_data_parallel_rank

    # Neither tensor nor DeepSpeed-level sequence parallelism: groups of one rank, so
    # DeepSpeed's reductions over them (gradient norms, clipping) are no-ops.
    def get_model_parallel_group(self) -> ProcessGroup:
        return self.mesh.self_group

    def get_model_parallel_world_size(self) -> int:
        return 1

    def get_model_parallel_rank(self) -> int:
        return 0

    def get_tensor_model_parallel_src_rank(self) -> int:
        return self.mesh.rank

    get_tensor_model_parallel_group = get_model_parallel_group
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_sequence_parallel_group = get_model_parallel_group
    get_sequence_parallel_world_size = get_model_parallel_world_size
    get_sequence_parallel_rank = get_model_parallel_rank


def all_reduce_mean(value: torch.Tensor) -> torch.Tensor:
    """Mean over the world; gloo has no AVG, so sum and divide."""
    out = value.detach().clone()
    dist.all_reduce(out, op=dist.ReduceOp.SUM)
    return out / dist.get_world_size()
