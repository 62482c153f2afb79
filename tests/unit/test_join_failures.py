"""A join that fails leaves nothing behind, and a world whose join fails is given up at once.

- The worker: a join whose process group formed but whose Trainer failed (DeepSpeed's broadcast
  meets "Connection closed by peer" when a peer died) leaves that group, so the retry's join
  can form another instead of failing with "trying to initialize the default process group
  twice". A TrainWorker runs as a plain object in a one-rank gloo world (rank 0's TCPStore on
  port 0, this process), with Trainer replaced by a stand-in.
- The group: the first failed join ends ``form_world`` at once, with rank 0's store dropped so
  the other ranks stop waiting in it; their calls are waited for before the next world forms,
  not before the failure is reported. WorkerGroup's Ray calls are scripted on a fake clock.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from typing import Any, Optional

import numpy as np
import pytest
import torch
import torch.distributed as dist

from ringtrain import config
from ringtrain.actors import group as group_module
from ringtrain.actors import reference_keeper
from ringtrain.actors import worker as worker_module
from ringtrain.actors import world as world_module
from ringtrain.actors.group import WorkerGroup
from ringtrain.actors.roster import Member, Slot
from ringtrain.actors.worker import TrainWorker
from ringtrain.errors import WorkerError
from ringtrain.status import WorkerInfo
from ringtrain.train import collectives
from ringtrain.train import mesh as mesh_module
from ringtrain.train import trainer as trainer_module
from ringtrain.train.mesh import create_store

# --- the worker leaves the group of a failed join ----------------------------------------------


class BrokenTrainer:
    """Fails as DeepSpeed's first broadcast does when a peer of the world died."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:10128")


class TinyTrainer:
    """Stands in for a Trainer built in the world joined; ``close`` leaves it, as the real one does."""

    def __init__(self, job: config.JobConfig, *, rank: int, device: torch.device, deliver: Any = None,
                 reference: Any = None) -> None:
        assert dist.is_initialized() and dist.get_world_size() == 1
        self.model = torch.nn.Linear(2, 2)
        self.bad_device = None

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.fixture
def worker(monkeypatch: pytest.MonkeyPatch) -> Any:
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "DS_ACCELERATOR", "TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"):
        monkeypatch.setenv(name, "unset")  # join sets them: put back as they were after the test
        monkeypatch.delenv(name)
    monkeypatch.setattr(worker_module, "_quiet_deepspeed", lambda level=None: None)
    job = config.load(None, ["mesh.dp=1", "mesh.cp=1", "controllers.step_timeout_s=20"])
    w = TrainWorker(job, -1, "cpu")
    monkeypatch.setattr(w, "_bind_device", lambda job: torch.device("cpu"))  # keeps this process's threads
    assert not dist.is_initialized()
    yield w
    w.leave()
    if dist.is_initialized():
        dist.destroy_process_group()
    collectives.uninstall()


def join(w: TrainWorker) -> int:
    store, port = create_store("127.0.0.1", 1, 20.0)
    try:
        return w.join(w.job, 0, "127.0.0.1", port)
    finally:
        del store


def test_a_join_whose_trainer_fails_leaves_its_process_group(worker: TrainWorker, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(trainer_module, "Trainer", BrokenTrainer)
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        join(worker)
    assert not dist.is_initialized()  # the group it formed went with the failure
    # The retry's join forms a new world in the same process.
    monkeypatch.setattr(trainer_module, "Trainer", TinyTrainer)
    assert join(worker) == 6
    assert dist.is_initialized() and worker._trainer is not None


def test_a_join_that_failed_as_its_world_formed_names_the_next_worlds_groups_as_a_fresh_process_does(
    worker: TrainWorker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Torch numbers unnamed groups per process and resets the count only when a world is
    destroyed; an init whose peer never came leaves none. Named apart from its peers', every
    later world of this worker would time out waiting for keys written under other names."""
    import torch.distributed.distributed_c10d as c10d

    one = worker.job
    two = config.load(None, ["mesh.dp=2", "mesh.cp=1", "controllers.join_timeout_s=1"])
    store, port = create_store("127.0.0.1", 2, 20.0)
    with pytest.raises(Exception, match="timeout|timed out"):  # rank 1 never comes
        worker.join(two, 0, "127.0.0.1", port)
    del store
    assert not dist.is_initialized()
    monkeypatch.setattr(trainer_module, "Trainer", TinyTrainer)
    worker.job = one  # the retry's world: this rank alone
    assert join(worker) == 6
    assert c10d._get_default_group().group_name == "0"  # as in a process that never failed


def test_a_join_whose_rank_0_store_is_gone_fails_at_once(worker: TrainWorker) -> None:
    """Rank 0 died after opening the world's store, before this rank connected: the join fails
    in well under a second (torch's client alone retries the connect for twice the timeout,
    here a minute), so the retry forms its next world without waiting."""
    with socket.socket() as sock:  # a port nothing listens on, as the dead rank 0's
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    t0 = time.monotonic()
    with pytest.raises(dist.DistNetworkError, match=f"store at 127.0.0.1:{port} is gone"):
        worker.join(config.load(None, ["mesh.dp=2", "mesh.cp=1", "controllers.join_timeout_s=30"]), 1, "127.0.0.1", port)
    assert time.monotonic() - t0 < 5.0
    assert not dist.is_initialized()


def test_a_join_whose_rank_0_dies_as_it_connects_fails_within_the_connect_bound(
    worker: TrainWorker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 0 died after this rank's connect was accepted, before the store answered it: torch's
    client keeps retrying up to its timeout (35 s here with the join's); the join gives up
    within a few ``STORE_CONNECT_TIMEOUT_S`` instead."""
    monkeypatch.setattr(mesh_module, "STORE_CONNECT_TIMEOUT_S", 0.5)
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(16)
        server.settimeout(0.2)
        stop = threading.Event()

        def hang_up() -> None:  # accepts each connect and closes it, as a dying store does
            while not stop.is_set():
                try:
                    server.accept()[0].close()
                except OSError:
                    continue

        thread = threading.Thread(target=hang_up, daemon=True)
        thread.start()
        t0 = time.monotonic()
        try:
            with pytest.raises(dist.DistNetworkError):
                worker.join(
                    config.load(None, ["mesh.dp=2", "mesh.cp=1", "controllers.join_timeout_s=30"]),
                    1,
                    "127.0.0.1",
                    server.getsockname()[1],
                )
        finally:
            stop.set()
            thread.join()
    assert time.monotonic() - t0 < 10.0
    assert not dist.is_initialized()


def test_a_join_leaves_a_default_group_left_behind(worker: TrainWorker, monkeypatch: pytest.MonkeyPatch) -> None:
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)  # as a join that died half-way left it
    monkeypatch.setattr(trainer_module, "Trainer", TinyTrainer)
    assert join(worker) == 6
    assert dist.get_world_size() == 1 and os.environ["RANK"] == "0"


# --- the group gives up a world at its first failed join ----------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now

    def time(self) -> float:
        return 1e9 + self.now


class Ref:
    """A pending actor call: ends at ``at`` (fake seconds) with ``result``, or raises ``error``."""

    def __init__(self, name: str, at: float, result: Any = None, error: Optional[BaseException] = None) -> None:
        self.name, self.at, self.result, self.error = name, at, result, error

    def __repr__(self) -> str:
        return self.name


class ScriptedRay:
    """``ray.wait`` and ``ray.get`` over Refs on a fake clock; every call is logged."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.log: list[str] = []

    def wait(self, refs: list[Ref], *, num_returns: int = 1, timeout: Optional[float] = None, **_: Any) -> tuple[list[Ref], list[Ref]]:
        self.log.append(f"wait {sorted(r.name for r in refs)} n={num_returns}")
        times = sorted(r.at for r in refs)
        target = times[num_returns - 1] if len(times) >= num_returns else float("inf")
        limit = self.clock.now + timeout if timeout is not None else float("inf")
        self.clock.now = max(self.clock.now, min(target, limit))
        ready = sorted((r for r in refs if r.at <= self.clock.now), key=lambda r: r.at)[:num_returns]
        return ready, [r for r in refs if r not in ready]

    def get(self, ref: Ref, timeout: Optional[float] = None) -> Any:
        import ray

        if ref.at > self.clock.now:
            if timeout is not None and ref.at > self.clock.now + timeout:
                self.clock.now += timeout
                raise ray.exceptions.GetTimeoutError()
            self.clock.now = ref.at
        if ref.error is not None:
            raise ref.error
        return ref.result


class Method:
    def __init__(self, worker: "ScriptedWorker", name: str) -> None:
        self.worker, self.name = worker, name

    def remote(self, *args: Any, **kwargs: Any) -> Ref:
        return self.worker.call(self.name)


class ScriptedWorker:
    """An actor handle whose calls end as ``world`` scripts them."""

    def __init__(self, world: "ScriptedWorlds", rank: int) -> None:
        self.world, self.rank = world, rank

    def __getattr__(self, name: str) -> Method:
        return Method(self, name)

    def call(self, name: str) -> Ref:
        return self.world.call(self.rank, name)


class ScriptedWorlds:
    """Joins of four ranks: rank ``dies`` dies 0.1 s into the first world's join; the others stay
    blocked for ``stuck_s`` (in a collective with a peer that keeps its sockets open), or, with
    ``released_by_drop``, fail 0.05 s after rank 0's store is dropped. Later worlds join in 0.2 s."""

    def __init__(self, ray: ScriptedRay, dies: int = 3, stuck_s: float = 600.0, released_by_drop: bool = False) -> None:
        self.ray, self.dies, self.stuck_s, self.released_by_drop = ray, dies, stuck_s, released_by_drop
        self.dropped_at: Optional[float] = None
        self.joins: list[Ref] = []
        self.worlds = 0

    def call(self, rank: int, name: str) -> Ref:
        import ray

        now = self.ray.clock.now
        self.ray.log.append(f"{name} {rank}")
        if name == "create_store":
            self.worlds += 1
            self.dropped_at = None
            return Ref(f"store{self.worlds}", now, ("h", 1234))
        if name == "drop_store":
            self.dropped_at = now
            for ref in self.joins if self.released_by_drop else []:
                if ref.at > now:
                    ref.at, ref.error = now + 0.05, RuntimeError("Connection reset by peer")
            return Ref("drop", now)
        if name == "join":
            if self.worlds == 1 and rank == self.dies:
                ref = Ref(f"join{self.worlds}.{rank}", now + 0.1, error=ray.exceptions.ActorDiedError())
            elif self.worlds == 1:
                ref = Ref(f"join{self.worlds}.{rank}", now + self.stuck_s, error=RuntimeError("store timeout"))
            else:
                ref = Ref(f"join{self.worlds}.{rank}", now + 0.2, 1000)
            self.joins.append(ref)
            return ref
        raise AssertionError(name)


@pytest.fixture
def scripted(monkeypatch: pytest.MonkeyPatch) -> tuple[WorkerGroup, ScriptedWorlds, ScriptedRay, Clock]:
    import ray

    clock = Clock()
    sray = ScriptedRay(clock)
    monkeypatch.setattr(ray, "wait", sray.wait)
    monkeypatch.setattr(ray, "get", sray.get)
    monkeypatch.setattr(group_module, "time", clock)
    job = config.JobConfig(mesh=config.MeshConfig(dp=2, cp=2))
    g = WorkerGroup(job, "cpu")
    monkeypatch.setattr(g, "seat_holders", lambda: [[] for _ in g.members])  # no holders here
    worlds = ScriptedWorlds(sray)
    info = WorkerInfo(0, "h", 1, "cpu", "n")
    g.members = [Member(ScriptedWorker(worlds, r), Slot("pg", r), info=info) for r in range(4)]
    return g, worlds, sray, clock


def test_a_death_in_the_join_fails_the_world_at_once(scripted: tuple[WorkerGroup, ScriptedWorlds, ScriptedRay, Clock]) -> None:
    g, worlds, sray, clock = scripted
    with pytest.raises(WorkerError) as failed:
        g.form_world(list(g.members), g.job)
    assert failed.value.rank == 3 and failed.value.kind == "died"
    # Seen as it happened: not after the survivors still blocked in the join gave up (the
    # join timeout bounded the wait for them).
    assert clock.now == pytest.approx(0.1)
    assert "drop_store 0" in sray.log  # the others stop waiting for rank 3 in rank 0's store
    assert g.phases.keys() == {"warm_s"}  # failed in the join


def test_the_next_world_forms_once_the_last_worlds_joins_ended(
    scripted: tuple[WorkerGroup, ScriptedWorlds, ScriptedRay, Clock],
) -> None:
    g, worlds, sray, clock = scripted
    worlds.released_by_drop = True
    with pytest.raises(WorkerError):
        g.form_world(list(g.members), g.job)
    sray.log.clear()
    survivors = g.members[:3]
    g.members = survivors + [Member(ScriptedWorker(worlds, 3), Slot("pg", 3), info=g.members[0].info)]
    assert g.form_world(g.members, g.job) == 0
    # The first world's joins still running ended (the store was dropped) before any rank of
    # the second was asked to join: a worker never runs two joins at once.
    first_join = next(i for i, line in enumerate(sray.log) if line.startswith("join"))
    assert any(line.startswith("wait ['join1.0', 'join1.1', 'join1.2']") for line in sray.log[:first_join])
    assert clock.now == pytest.approx(0.1 + 0.05 + 0.2)


def test_a_worker_still_inside_the_last_worlds_join_fails_the_next_world(
    scripted: tuple[WorkerGroup, ScriptedWorlds, ScriptedRay, Clock],
) -> None:
    """A call of the failed world that outlasts the bounded wait (gloo retries a connect to the
    dead peer's address until the process group's timeout) names its worker as a failed rank of
    the next world, before anyone is asked to join it: the retry replaces that worker instead
    of running two joins in one process."""
    g, worlds, sray, clock = scripted
    with pytest.raises(WorkerError):
        g.form_world(list(g.members), g.job)
    sray.log.clear()
    g.members = g.members[:3] + [Member(ScriptedWorker(worlds, 3), Slot("pg", 3), info=g.members[0].info)]
    with pytest.raises(WorkerError) as failed:
        g.form_world(g.members, g.job)
    assert (failed.value.rank, failed.value.kind) == (0, "timeout")
    waited = world_module.leftover_wait(g.job)  # a failed world's joins end within it (their groups' own bound)
    assert f"still inside the failed world's call after {waited:g} s" in str(failed.value)
    assert not any(line.startswith(("create_store", "join")) for line in sray.log)
    assert clock.now == pytest.approx(0.1 + waited)
    # The calls still running stay pending: the next world waits for them again.
    assert sorted(ref.name for ref in g.leftovers.calls) == ["join1.0", "join1.1", "join1.2"]


# --- a join that takes DPO's reference pass -----------------------------------------------------


class SlowJoins(ScriptedWorlds):
    """Every join ends ``join_s`` after it starts; rank 0 hands back the table it computed."""

    def __init__(self, ray: ScriptedRay, join_s: float) -> None:
        super().__init__(ray)
        self.join_s = join_s

    def call(self, rank: int, name: str) -> Ref:
        now = self.ray.clock.now
        if name == "join":
            return Ref(f"join.{rank}", now + self.join_s, 1000)
        if name == "reference_table":
            return Ref("table", now, np.zeros((5, 2)))
        return super().call(rank, name)


@pytest.mark.parametrize("join_s, formed", [(9000.0, True), (20000.0, False)], ids=["within-the-pass", "past-the-pass"])
def test_a_join_that_takes_the_reference_pass_is_given_the_pass_time(
    scripted: tuple[WorkerGroup, ScriptedWorlds, ScriptedRay, Clock], monkeypatch: pytest.MonkeyPatch, join_s: float, formed: bool
) -> None:
    """Before its table is known, a world's join takes DPO's reference pass over the dataset:
    controllers.start_timeout_s (300 s) and a step's timeout (600 s) for each of the 20 rows of
    pairs a replica of dp 2 scores and one more (12,900 s); past that, the timeout says it was
    the reference pass. Once the table is known a join has start_timeout_s."""
    import ray

    g, _, sray, clock = scripted
    job = config.replace(g.job, ["train.objective=dpo"])
    slow = SlowJoins(sray, join_s)
    g.members = [Member(ScriptedWorker(slow, r), Slot("pg", r), info=m.info) for r, m in enumerate(g.members)]
    monkeypatch.setattr(ray, "put", lambda value: value)
    monkeypatch.setattr(reference_keeper, "pair_rows", lambda job: 40)
    g.reference = reference_keeper.ReferenceKeeper({"num_pairs": 5}, None, store=None)
    if not formed:
        with pytest.raises(WorkerError) as failed:
            g.form_world(g.members, job)
        assert failed.value.kind == "timeout" and clock.now == pytest.approx(12_900.0)
        assert str(failed.value).endswith("no answer within 12900 s (ranks [0, 1, 2, 3]) in a join that takes dpo's reference "
                                          "pass over 40 rows of pairs (controllers.start_timeout_s + "
                                          "controllers.step_timeout_s x 21 forwards)")  # fmt: skip
        return
    assert g.form_world(g.members, job) == 0
    assert clock.now == pytest.approx(join_s) and g.reference.table is not None
    with pytest.raises(WorkerError, match=r"no answer within 300 s \(ranks \[0, 1, 2, 3\]\)$"):
        g.form_world(g.members, job)  # the next world is given the table: no pass, no more time
