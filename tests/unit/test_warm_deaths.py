"""A worker that dies while it warms up (a spare, or one started for growth) leaves the group.

The WorkerGroup and Recovery run as plain objects; what would ask Ray (polling warm-ups,
killing an actor, finding a slot's node, placing a new worker) is replaced by a scripted
cluster that says which warm-ups finished and how.
"""

from __future__ import annotations

from typing import Any

import pytest

from ringtrain import config
from ringtrain.actors import group as group_module
from ringtrain.actors.group import WorkerGroup
from ringtrain.actors.recovery import Recovery
from ringtrain.actors.roster import MAX_WARM_DEATHS_PER_SLOT, Member, Slot, WarmDeaths, settle
from ringtrain.status import WorkerInfo


class Cluster:
    """Scripted warm-ups: each pending warm() is a token; ``finish`` says how it ends."""

    def __init__(self) -> None:
        self.results: dict[str, WorkerInfo | BaseException] = {}
        self.stopped: list[str] = []
        self.started: list[Slot] = []
        self.pgs = 0

    def poll(self, refs: list[Any]) -> dict[int, WorkerInfo | BaseException]:
        return {i: self.results[r] for i, r in enumerate(refs) if r in self.results}

    def finish(self, member: Member, *, dies: bool = False) -> None:
        token = member.warm
        self.results[token] = RuntimeError("worker died while warming up") if dies else WorkerInfo(0, "h", 1, "cpu", "n")

    def spawn(self, g: WorkerGroup, count: int) -> list[Member]:
        """As WorkerGroup.spawn: free slots first, then a new placement group."""
        slots = [g.free_slots.pop(0) for _ in range(min(count, len(g.free_slots)))]
        if len(slots) < count:
            self.pgs += 1
            slots += [Slot(f"pg{self.pgs}", i) for i in range(count - len(slots))]
        self.started += slots
        return [Member(f"actor{len(self.started)}-{i}", s, warm=f"warm{len(self.started)}-{i}") for i, s in enumerate(slots)]


@pytest.fixture
def scripted(monkeypatch: pytest.MonkeyPatch) -> tuple[WorkerGroup, Recovery, Cluster]:
    cluster = Cluster()
    job = config.JobConfig(mesh=config.MeshConfig(dp=1, cp=2, spares=1))
    g = WorkerGroup(job, "cpu")
    monkeypatch.setattr(group_module, "_poll_warm", cluster.poll)
    monkeypatch.setattr(group_module, "_stop_actor", lambda handle: cluster.stopped.append(handle))
    monkeypatch.setattr(group_module, "_slot_node", lambda slot: "")
    monkeypatch.setattr(g, "spawn", lambda count: cluster.spawn(g, count))
    return g, Recovery(g), cluster


def test_a_spare_that_dies_warming_up_is_removed_and_replaced_in_its_slot(
    scripted: tuple[WorkerGroup, Recovery, Cluster],
) -> None:
    g, recovery, cluster = scripted
    g.spares = g.spawn(1)
    dead = g.spares[0]
    assert not recovery.spares_changed()  # still warming
    cluster.finish(dead, dies=True)
    assert recovery.spares_changed()
    assert dead not in g.spares and cluster.stopped == [dead.handle]
    assert len(g.spares) == 1 and g.spares[0].slot == dead.slot  # replenished, in the freed slot
    assert g.ready_spares() == []
    cluster.finish(g.spares[0])
    assert recovery.spares_changed() and g.ready_spares() == g.spares


def test_growth_does_not_stall_when_a_prepared_worker_dies(scripted: tuple[WorkerGroup, Recovery, Cluster]) -> None:
    g, recovery, cluster = scripted
    recovery.prepare_growth(1)  # one replica: cp = 2 workers
    first, second = g.growing
    cluster.finish(first)
    cluster.finish(second, dies=True)
    assert not recovery.growth_ready()
    assert second not in g.growing and len(g.growing) == 2  # a replacement started
    assert g.growing[1].slot == second.slot
    assert not recovery.growth_ready()
    cluster.finish(g.growing[1])
    assert recovery.growth_ready()


def test_a_slot_that_kills_its_workers_again_is_held_back(scripted: tuple[WorkerGroup, Recovery, Cluster]) -> None:
    g, recovery, cluster = scripted
    g.spares = g.spawn(1)
    slot = g.spares[0].slot
    for _ in range(MAX_WARM_DEATHS_PER_SLOT):
        cluster.finish(g.spares[0], dies=True)
        recovery.spares_changed()
    assert slot in g.quarantined and slot not in g.free_slots
    assert g.spares == []  # no free slot left for a spare (spares only take free slots)


def test_settle_leaves_unfinished_warm_ups_pending() -> None:
    members = [Member("a", Slot("pg", 0), warm="w0"), Member("b", Slot("pg", 1), warm="w1")]
    dead = settle(members, lambda refs: {1: ValueError("boom\nmore")})
    assert dead == [members[1]] and members[1].error == "ValueError: boom" and members[0].warm == "w0"
    deaths = WarmDeaths(limit=2)
    assert deaths.record(Slot("pg", 0)) and not deaths.record(Slot("pg", 0)) and deaths.total == 2
