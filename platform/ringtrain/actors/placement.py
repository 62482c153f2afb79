"""Where the group's workers and snapshot holders go: placement groups, holders, capacity.

One placement group per replica, one bundle per ring position, PACK strategy: a ring's ranks
land on one node when it fits, so the ring's P2P traffic rides the fastest links. Spares get
a SPREAD group of their own; workers started later (replacements, spares, growth) a new PACK
group kept off cordoned nodes. One SnapshotHolder per node that runs a worker keeps copies of
its ranks' snapshots, and a buddy node's holder a second copy.

Workers are started into their slots here too (``start_worker``). They carry no runtime
environment of their own, so Ray can hand each one a worker process it prestarted (Python and
Ray already loaded: a second or more per worker at start); the worker sets its process
environment itself (``worker.process_env``).

Plain functions over what the WorkerGroup owns (its ``placement_groups`` list and ``holders``
dict, node id -> holder): the group decides when, these say how.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

from ringtrain.actors.cluster import worker_resources
from ringtrain.actors.holder import SnapshotHolder
from ringtrain.actors.roster import Slot
from ringtrain.actors.worker import TrainWorker
from ringtrain.config import JobConfig
from ringtrain.errors import CapacityError
from ringtrain.policies.snapshots import buddy_node
from ringtrain.status import WorkerInfo

NODE_ID_LABEL = "ray.io/node-id"


def place_replicas(job: JobConfig, device: str) -> list[Any]:
    """A PACK placement group per replica (and a SPREAD one for the spares), waited for up to
    ``controllers.start_timeout_s``; raises CapacityError if they do not all fit."""
    import ray
    from ray.util.placement_group import placement_group

    bundle = worker_resources(job, device)
    topo = job.topology
    groups = [
        placement_group([dict(bundle) for _ in range(topo.cp)], strategy="PACK", name=f"replica-{d}")
        for d in range(topo.dp)
    ]
    if job.mesh.spares:
        groups.append(placement_group([dict(bundle) for _ in range(job.mesh.spares)], strategy="SPREAD", name="spares"))
    timeout = job.controllers.start_timeout_s
    ready, _ = ray.wait([pg.ready() for pg in groups], num_returns=len(groups), timeout=timeout)
    if len(ready) < len(groups):
        raise CapacityError(
            "mesh.dp",
            f"only {len(ready)} of {len(groups)} placement groups ({topo.cp} x {bundle} per replica, "
            f"mesh.spares={job.mesh.spares}) could be placed within controllers.start_timeout_s={timeout:g}",
        )
    return groups


@functools.cache
def actor_class(cls: type) -> Any:
    """``cls`` as a Ray actor class, made once per process: Ray ships each actor class made to
    the cluster (pickled, with a disassembly of every method) on its first use in a job, so one
    made per worker shipped the same class once per worker."""
    import ray

    return ray.remote(cls)


def start_worker(job: JobConfig, device: str, slot: Slot) -> Any:
    """A TrainWorker actor started in ``slot`` (its handle)."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    bundle = worker_resources(job, device)
    return (
        actor_class(TrainWorker)
        .options(
            num_cpus=bundle["CPU"],
            num_gpus=bundle.get("GPU", 0),
            max_concurrency=2,  # heartbeats and snapshot reads are answered while a step runs
            scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=slot.pg, placement_group_bundle_index=slot.index),
        )
        .remote(job, -1, device, own_process=True)
    )


def new_placement_group(job: JobConfig, device: str, bundles: int, cordoned: set[str]) -> Any:
    """A PACK placement group of ``bundles`` worker-sized bundles, off the cordoned nodes."""
    from ray.util.placement_group import placement_group

    bundle = worker_resources(job, device)
    return placement_group(
        [dict(bundle) for _ in range(bundles)], strategy="PACK", bundle_label_selector=off_cordoned(cordoned, bundles)
    )


def off_cordoned(cordoned: set[str], bundles: int) -> Optional[list[dict[str, str]]]:
    """A label selector per bundle that keeps it off the cordoned nodes (Ray labels every
    node with its id)."""
    if not cordoned:
        return None
    return [{NODE_ID_LABEL: f"!in({','.join(sorted(cordoned))})"} for _ in range(bundles)]


def release_unused(placement_groups: list[Any], in_use: list[Slot]) -> None:
    """Remove (from Ray and from ``placement_groups``) the placement groups no slot of
    ``in_use`` is in, so the cluster can give their resources to whoever needs them."""
    from ray.util.placement_group import remove_placement_group

    used = {id(s.pg) for s in in_use}
    for pg in [pg for pg in placement_groups if id(pg) not in used]:
        try:
            remove_placement_group(pg)
        except Exception:
            pass
        placement_groups.remove(pg)


def free_capacity(job: JobConfig, device: str, free_slots: int) -> int:
    """Worker-sized slots a new worker could take now: ``free_slots`` plus what the cluster has
    unreserved."""
    import ray

    bundle = worker_resources(job, device)
    available = ray.available_resources()
    fits = min(int(available.get(k, 0.0) // v) if v > 0 else 10**6 for k, v in bundle.items())
    return fits + free_slots


def start_holders(job: JobConfig, infos: list[WorkerInfo], holders: dict[str, Any]) -> None:
    """One SnapshotHolder per node that runs a worker, pinned there, reserving no CPU; new
    ones are added to ``holders``."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    if job.checkpoint.snapshot_every == 0:
        return
    for node_id in dict.fromkeys(i.node_id for i in infos):
        if node_id not in holders:
            holders[node_id] = actor_class(SnapshotHolder).options(
                num_cpus=0,
                # The workers' puts and a restore's reads, plus the controller's one wait_for.
                max_concurrency=5,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node_id, soft=False),
            ).remote(job.checkpoint.keep_in_memory)


def holders_of(rank: int, job: JobConfig, infos: list[WorkerInfo], holders: dict[str, Any]) -> list[Any]:
    """This node's holder, and a buddy node's when there is one and buddies are on."""
    if not holders:
        return []
    nodes = list(holders)
    own = infos[rank].node_id
    chosen = [holders[own]]
    if job.checkpoint.buddy:
        buddy = buddy_node(rank, job.topology, [i.node_id for i in infos], nodes)
        if buddy is not None:
            chosen.append(holders[buddy])
    return chosen


def node_alive(holders: dict[str, Any], node_id: str) -> bool:
    """Whether ``node_id`` still runs: its holder answers (a dead node takes its holder with
    it at once, well before the cluster's own health check gives up on the node)."""
    import ray

    holder = holders.get(node_id)
    if holder is not None:
        try:
            ray.get(holder.inventory.remote(), timeout=2.0)
            return True
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            return False
    return any(n["NodeID"] == node_id and n["Alive"] for n in ray.nodes())


def slot_node(slot: Slot) -> str:
    """The node a slot's bundle is placed on ("" when not known)."""
    import ray

    try:
        return str(ray.util.placement_group_table(slot.pg)["bundles_to_node_id"].get(slot.index, ""))
    except Exception:
        return ""
