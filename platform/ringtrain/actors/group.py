"""WorkerGroup: places, spawns, drives and tears down the dp x cp TrainWorker actors.

One placement group per replica, one bundle per ring position, PACK strategy: a ring's ranks
land on one node when it fits, so the ring's P2P traffic rides the fastest links, and a
replica stays the unit that can later come and go as a whole.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Optional, TypeVar

from ringtrain.actors.cluster import worker_resources
from ringtrain.actors.holder import SnapshotHolder
from ringtrain.actors.worker import TrainWorker
from ringtrain.config import JobConfig
from ringtrain.errors import CapacityError, WorkerError
from ringtrain.status import StepReport, WorkerInfo
from ringtrain.topology import Topology

log = logging.getLogger(__name__)
T = TypeVar("T")


class WorkerGroup:
    def __init__(self, job: JobConfig, device: str) -> None:
        self.job = job
        self.device = device
        self.topology = Topology(job.mesh.dp, job.mesh.cp, job.ulysses_degree)
        self.placement_groups: list[Any] = []
        self.workers: list[Any] = []  # actor handles, index = rank
        self.infos: list[WorkerInfo] = []
        self.holders: dict[str, Any] = {}  # node id -> SnapshotHolder
        self.num_params = 0

    def start(self) -> None:
        """Place and spawn every rank, then join them into one process group."""
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        bundle = worker_resources(self.job, self.device)
        self.placement_groups = [
            placement_group([dict(bundle) for _ in range(self.topology.cp)], strategy="PACK", name=f"replica-{d}")
            for d in range(self.topology.dp)
        ]
        timeout = self.job.controllers.start_timeout_s
        ready, _ = ray.wait([pg.ready() for pg in self.placement_groups], num_returns=self.topology.dp, timeout=timeout)
        if len(ready) < self.topology.dp:
            raise CapacityError(
                "mesh.dp",
                f"only {len(ready)} of {self.topology.dp} replicas ({self.topology.cp} x {bundle} each) "
                f"could be placed within controllers.start_timeout_s={timeout:g}",
            )
        actor_cls = ray.remote(TrainWorker)
        for rank in range(self.topology.world_size):
            c = self.topology.coord(rank)
            self.workers.append(
                actor_cls.options(
                    num_cpus=bundle["CPU"],
                    num_gpus=bundle.get("GPU", 0),
                    max_concurrency=2,  # a diagnostic call can be answered while a step runs
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        placement_group=self.placement_groups[c.replica], placement_group_bundle_index=c.ring_pos
                    ),
                    runtime_env={"env_vars": _worker_env(self.device)},
                ).remote(self.job, rank, self.device)
            )
        self.infos = self._gather(lambda _, w: w.info.remote(), timeout)
        self._start_holders()
        host, port = self._call(self.workers[0].create_store.remote(), rank=0, timeout=timeout)
        counts = self._gather(
            lambda rank, w: w.setup.remote(host, port, self._holders_of(rank)), timeout
        )
        self.num_params = counts[0]

    def _start_holders(self) -> None:
        """One SnapshotHolder per node that runs a worker, pinned there, reserving no CPU."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        if self.job.checkpoint.snapshot_every == 0:
            return
        holder_cls = ray.remote(SnapshotHolder)
        for node_id in dict.fromkeys(i.node_id for i in self.infos):
            self.holders[node_id] = holder_cls.options(
                num_cpus=0,
                max_concurrency=4,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node_id, soft=False),
            ).remote(self.job.checkpoint.keep_in_memory)

    def _holders_of(self, rank: int) -> list[Any]:
        """This node's holder, and a buddy node's when there is one and buddies are on."""
        if not self.holders:
            return []
        nodes = list(self.holders)
        own = self.infos[rank].node_id
        chosen = [self.holders[own]]
        if self.job.checkpoint.buddy:
            buddy = buddy_node(rank, self.topology, [i.node_id for i in self.infos], nodes)
            if buddy is not None:
                chosen.append(self.holders[buddy])
        return chosen

    def snapshot_refs(self, step: int) -> list[Any]:
        """Pending results of every rank's ``snapshot(step)``, in rank order; the workers answer
        on their second concurrency slot, so this never waits for the step in flight."""
        return [w.snapshot.remote(step) for w in self.workers]

    def restore(self, blobs: list[bytes]) -> int:
        import ray

        ref = ray.put(blobs)  # one copy in the object store, read by every rank
        steps = self._gather(lambda _, w: w.restore.remote(ref), self.job.controllers.start_timeout_s)
        return steps[0]

    def train_step(self) -> list[StepReport]:
        return self._gather(lambda _, w: w.train_step.remote(), self.job.controllers.step_timeout_s)

    def shutdown(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        for handle in self.workers:
            try:
                ray.kill(handle, no_restart=True)
            except Exception:  # already dead: nothing to stop
                pass
        for handle in self.holders.values():
            try:
                ray.kill(handle, no_restart=True)
            except Exception:
                pass
        for pg in self.placement_groups:
            try:
                remove_placement_group(pg)
            except Exception:
                pass
        self.workers, self.placement_groups, self.holders = [], [], {}

    def _gather(self, call: Callable[[int, Any], Any], timeout: float) -> list[Any]:
        """Call every worker (with its rank), wait for all; the first failure names its rank."""
        import ray

        rank_of = {call(rank, w): rank for rank, w in enumerate(self.workers)}
        results: dict[int, Any] = {}
        deadline = time.monotonic() + timeout
        pending = list(rank_of)
        while pending:
            done, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not done:
                stuck = sorted(rank_of[r] for r in pending)
                raise WorkerError(
                    stuck[0], self._host(stuck[0]), f"no answer within {timeout:g} s (ranks {stuck})", kind="timeout"
                )
            rank = rank_of[done[0]]
            results[rank] = self._call(done[0], rank=rank, timeout=0)
        return [results[rank] for rank in range(len(self.workers))]

    def _call(self, ref: Any, *, rank: int, timeout: float) -> Any:
        import ray

        try:
            return ray.get(ref, timeout=timeout or None)
        except ray.exceptions.RayActorError as exc:
            raise WorkerError(rank, self._host(rank), f"worker process died ({type(exc).__name__})", kind="died") from None
        except ray.exceptions.RayTaskError as exc:
            cause = exc.cause if getattr(exc, "cause", None) is not None else exc
            raise WorkerError(rank, self._host(rank), f"{type(cause).__name__}: {_first_line(cause)}") from None

    def _host(self, rank: int) -> str:
        return self.infos[rank].host if rank < len(self.infos) else "?"


def buddy_node(rank: int, topology: Topology, rank_nodes: list[str], nodes: list[str]) -> Optional[str]:
    """Another node to keep a copy of ``rank``'s snapshots: the node of the same ring position in
    the next replica when that is elsewhere (spreads the copies evenly), else any other node."""
    own = rank_nodes[rank]
    c = topology.coord(rank)
    peer = rank_nodes[topology.rank_of((c.replica + 1) % topology.dp, c.ring_pos)]
    if peer != own:
        return peer
    others = [n for n in nodes if n != own]
    return others[rank % len(others)] if others else None


def _worker_env(device: str) -> dict[str, str]:
    env = {"DS_ACCELERATOR": "cuda" if device == "cuda" else "cpu"}
    # Quiet the per-process banners; errors still surface through the controller.
    env["PYTHONWARNINGS"] = "ignore"
    return env


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""
