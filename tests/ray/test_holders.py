"""Snapshots outlive the worker that took them: node holders and buddy copies on a 2-node cluster."""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import time
from pathlib import Path
from typing import Iterator

import pytest

from ringtrain import config
from ringtrain.checkpoint.wire import decode
from ringtrain_dev.ray_head import TORCH_EXTENSIONS_DIR

pytestmark = [pytest.mark.ray, pytest.mark.slow]


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    """Two Ray nodes of one CPU each on this machine; the test process is the driver. One cluster
    for the module: each test leaves it as it found it (its actors ended, both nodes up)."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        yield from _two_nodes(tmp_path_factory.mktemp("home"), monkeypatch)


def _two_nodes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[object]:
    import ray
    from ray.cluster_utils import Cluster

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(TORCH_EXTENSIONS_DIR))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    temp_dir = tempfile.mkdtemp(prefix="rth-", dir="/tmp")
    try:
        # Ray records "the current cluster" under its temp root; keep ours out of the shared /tmp/ray.
        monkeypatch.setenv("RAY_TMPDIR", temp_dir)
        (Path(temp_dir) / "ray").mkdir()
        cluster = Cluster(
            initialize_head=True, head_node_args={"num_cpus": 1, "temp_dir": temp_dir, "include_dashboard": False}
        )
        try:
            cluster.add_node(num_cpus=1)
            ray.init(address=cluster.address, log_to_driver=False)
            yield cluster
        finally:
            ray.shutdown()
            cluster.shutdown()
    finally:
        shutil.rmtree(temp_dir, ignore_errors=True)


def test_snapshots_survive_a_killed_worker_on_its_node_and_a_buddy_node(two_nodes: object) -> None:
    import ray

    from ringtrain.actors.group import WorkerGroup

    job = config.load(
        None,
        [
            "model.dim=32", "model.n_layers=1", "model.n_heads=2", "model.n_kv_heads=1",
            "data.seq_len=32", "train.global_batch=2", "train.steps=4",
            "mesh.dp=2", "mesh.cp=1", "cluster.cpus_per_worker=1",
        ],
    )
    group = WorkerGroup(job, "cpu")
    try:
        group.start()
        assert len({i.node_id for i in group.infos}) == 2, "one replica per node"
        assert len(group.holders) == 2
        # Each rank's snapshots go to its node's holder and the other node's, fixed for the world.
        nodes = [i.node_id for i in group.infos]
        assert group.holders_by_rank == [[group.holders[own], group.holders[other]] for own, other in (nodes, nodes[::-1])]
        for _ in range(2):
            group.train_step()
        ray.get(group.snapshot_refs(2))  # step 2 is finished (and so handed to the holders)
        assert group.safe_through(wait_s=30) == 2  # both holders, asked, say they have it

        victim = group.infos[1]
        os.kill(victim.pid, signal.SIGKILL)
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(group.workers[1].info.remote(), timeout=30)

        own = group.holders[victim.node_id]
        buddy = next(h for node, h in group.holders.items() if node != victim.node_id)
        for holder in (own, buddy):
            blob = ray.get(holder.get.remote(1, 2))
            assert blob is not None
            shard = decode(blob)
            assert (shard.rank, shard.step, shard.world_size) == (1, 2, 2)
            assert ray.get(holder.inventory.remote())[2] == (2, [0, 1])
    finally:
        group.shutdown()


def test_a_fetched_shard_outlives_its_producer_and_a_failed_call_is_told_apart(two_nodes: object) -> None:
    """What a retry of an interrupted recovery relies on (``actors.recovery.produced``): the
    result of a finished call stays readable after its actor is killed on a live node; a call the
    death interrupted, and one that raised, are told apart from it without reading a shard."""
    import ray

    from ringtrain.actors.recovery import produced

    @ray.remote(num_cpus=0)
    class Producer:
        def shard(self, size: int) -> bytes:
            return b"s" * size

        def pid(self) -> int:
            return os.getpid()

        def stuck(self) -> bytes:
            signal.pause()
            return b""

        def gone(self) -> bytes:
            raise AssertionError  # as a shard call raised in the recovery that looped on it

    producer = Producer.remote()
    pid = ray.get(producer.pid.remote())
    big, small = producer.shard.remote(4 << 20), producer.shard.remote(64)  # in the object store, inline
    raised = producer.gone.remote()
    ray.wait([big, small, raised], num_returns=3, fetch_local=False)
    interrupted = producer.stuck.remote()
    os.kill(pid, signal.SIGKILL)
    ray.wait([interrupted], fetch_local=False, timeout=30)

    # A retry reusing the call that raised would restore its error again and again.
    assert produced([big, small, interrupted, raised]) == [True, True, False, False]
    assert len(ray.get(big, timeout=30)) == 4 << 20 and ray.get(small, timeout=30) == b"s" * 64
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(interrupted, timeout=30)


def test_safekeeping_hears_a_step_is_safe_only_once_every_holder_has_it(two_nodes: object) -> None:
    import ray

    from ringtrain.actors.holder import SnapshotHolder
    from ringtrain.actors.placement import actor_class
    from ringtrain.actors.safekeeping import Safekeeping
    from ringtrain.checkpoint.wire import checksum

    holders = [actor_class(SnapshotHolder).options(num_cpus=0, max_concurrency=5).remote(2) for _ in range(2)]
    try:
        safe = Safekeeping(lambda step: [h.wait_for.remote([0, 1], step, 30.0) for h in holders])

        def put(rank: int, step: int) -> None:
            blob = bytes([rank, step]) * 8
            ray.get([h.put.remote(rank, step, 2, blob, checksum(blob)) for h in holders])

        safe.taken(3)
        put(0, 3)
        assert not safe.poll(0.2) and safe.safe_through == 0  # rank 1's snapshot is still on its way
        safe.taken(4)  # taken while step 3 is asked about: asked about once step 3 is answered
        put(1, 3)
        deadline = time.monotonic() + 10.0
        while not safe.poll(0.05) and time.monotonic() < deadline:  # step 4's answer is not waited for
            pass
        assert safe.safe_through == 3
        put(0, 4)
        put(1, 4)
        assert safe.poll(10.0) and safe.safe_through == 4
        safe.restart(2)  # a new world from step 2's state: nothing pending
        assert (safe.refs(), safe.safe_through) == ([], 2)
    finally:  # the module's cluster goes on to the next test
        for holder in holders:
            ray.kill(holder)
