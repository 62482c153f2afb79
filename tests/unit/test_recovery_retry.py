"""A failure during a recovery: a worker that dies while the new world joins or restores is
recovered from as a new failure, from the same restore point, not a failed run.

The policy is pure (``policies.retries``); the Controller runs against the scripted group and
recovery of ``test_controller`` with a reform that breaks once; the Recovery runs against a
WorkerGroup whose Ray calls are scripted, to show that the retry reads the same shards.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import pytest

from ringtrain import config
from ringtrain.actors import recovery as recovery_module
from ringtrain.actors.group import WorkerGroup
from ringtrain.actors.protocols import Reform
from ringtrain.actors.recovery import Recovery
from ringtrain.actors.roster import Member, Slot
from ringtrain.chaos import FaultPlan, FaultSpec
from ringtrain.policies import recovery as recovery_policy
from ringtrain.policies.faults import Kind
from ringtrain.policies.retries import RecoveryFault, phase_of, retry_recovery
from ringtrain.errors import WorkerError
from ringtrain.status import WorkerInfo
from tests.unit.controller_fakes import FakeElastic, Fault, elastic_job, elastic_run, incident_files, reform_call, whole


def test_a_worker_dying_in_a_recovery_is_a_failure_of_the_world_being_formed() -> None:
    fault = RecoveryFault(rank=2, kind="died", cause="worker process died", phase="restore")
    retry = retry_recovery(fault, incident=1, restore_to=5, attempts=1, max_recoveries=20)
    assert retry is not None
    assert (retry.failure.kind, retry.failure.ranks, retry.restore_to) == (Kind.CRASH, (2,), 5)
    assert "rank 2" in retry.failure.reason and "while restoring" in retry.failure.reason and "incident 1" in retry.failure.reason
    assert retry.evidence == {"during_recovery": {"incident": 1, "phase": "restore", "restore_to": 5}}
    assert retry.failure.lost_workers and not retry.failure.quarantine  # its seat is refilled, its slot reused
    silent = retry_recovery(RecoveryFault(0, "timeout", "no answer", "join"), incident=3, restore_to=0, attempts=1, max_recoveries=2)
    assert silent is not None and silent.failure.kind is Kind.HANG and "while joining" in silent.failure.reason
    # Each attempt counts: none left, no retry.
    assert retry_recovery(fault, incident=1, restore_to=5, attempts=2, max_recoveries=2) is None


def test_the_phase_a_world_failed_in_is_the_first_it_did_not_finish() -> None:
    assert phase_of({}) == "warm"
    assert phase_of({"warm_s": 0.1}) == "join"
    assert phase_of({"warm_s": 0.1, "join_s": 0.2}) == "restore"


class BreakingElastic(FakeElastic):
    """FakeElastic whose first ``breaks`` reforms die inside: rank ``rank`` of the world being
    formed fails in its restore, before any step ran in that world."""

    def __init__(self, *args: Any, breaks: int = 1, rank: int = 2, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.breaks, self.rank = breaks, rank

    def reform(self, request: Reform) -> Any:
        out = super().reform(request)
        if self.breaks:
            self.breaks -= 1
            self.group.phases = {"warm_s": 0.1, "join_s": 0.2}  # as WorkerGroup leaves them
            raise WorkerError(self.rank, "h", "worker process died (ActorDiedError)", kind="died")
        return out


def breaking_run(tmp_path: Path, job: config.JobConfig, **elastic: Any) -> tuple[dict[str, Any], Any, BreakingElastic]:
    from ringtrain.actors.controller import Controller
    from ringtrain.telemetry.rundir import RunDir
    from tests.unit.controller_fakes import Clock, ElasticGroup

    clock = Clock()
    group = ElasticGroup(job, clock, {6: [Fault("crash", 1)]})
    fake = BreakingElastic(group, tmp_path, **elastic)
    summary = Controller(job, group, RunDir(tmp_path), elastic=fake, clock=clock).run()
    return summary, group, fake


def test_a_second_death_inside_the_recovery_is_retried_from_the_same_restore_point(tmp_path: Path) -> None:
    job = elastic_job(mesh={"spares": 1, "min_dp": 2})
    summary, group, fake = breaking_run(tmp_path, job, spares=1, free_slots=2)

    assert (summary["status"], summary["final_step"], summary["dp"]) == ("finished", 8, 2)
    # The spare took rank 1's seat; rank 2 of that world died restoring; a new worker takes
    # its seat (no spare left, and mesh.min_dp=2 forbids a shrink).
    first, second = fake.named("reform")
    assert first == reform_call({1}, new_dp=2, spares=1, last_step=5)
    assert second["lost"] == frozenset({2}) and second["last_step"] == 5 and second["fired_through"] == 6
    # Nothing completed was lost, every sample trained once: steps 6-8 ran after the restore.
    assert group.attempts == [1, 2, 3, 4, 5, 6, 6, 7, 8]
    assert summary["ledger"] == whole(8)
    crash, during = incident_files(tmp_path).values()
    assert (crash["kind"], crash["ranks"], crash["lost_steps"], crash["dp_after"]) == ("crash", [1], 0, summary["dp"])
    assert crash["recover_s"] is not None  # closed by the first step after the retry
    assert (during["kind"], during["ranks"], during["lost_steps"]) == ("crash", [2], 0)
    assert during["verdict"]["during_recovery"] == {"incident": 1, "phase": "restore", "restore_to": 5}
    assert [r["id"] for r in summary["recoveries"]] == [1, 2]


def test_a_recovery_that_keeps_breaking_fails_the_run_at_max_recoveries(tmp_path: Path) -> None:
    job = elastic_job(mesh={"spares": 1}, max_recoveries=3)
    summary, _, fake = breaking_run(tmp_path, job, spares=1, free_slots=8, breaks=10)

    assert summary["status"] == "failed"
    assert "controllers.max_recoveries=3" in summary["error"]
    assert len(fake.named("reform")) == 3
    assert {r["last_step"] for r in fake.named("reform")} == {5}


# --- the Recovery reads the same shards again ------------------------------------------------


class ScriptedWorlds:
    """A WorkerGroup whose worlds are scripted: ``form_world`` fails ``breaks`` times with rank
    ``rank`` dead in the restore, and every call's arguments are kept."""

    def __init__(self, g: WorkerGroup, breaks: int, rank: int) -> None:
        self.g, self.breaks, self.rank = g, breaks, rank
        self.worlds: list[tuple[list[Member], config.JobConfig, Optional[list[Any]]]] = []
        self.crashing: list[frozenset[int]] = []  # each world's crash_restoring ranks

    def form_world(
        self,
        members: list[Member],
        job: config.JobConfig,
        snapshot: Optional[list[Any]] = None,
        crash_restoring: frozenset[int] = frozenset(),
    ) -> int:
        self.worlds.append((members, job, snapshot))
        self.crashing.append(crash_restoring)
        self.g.job, self.g.members = job, members
        if self.breaks:
            self.breaks -= 1
            self.g.phases = {"warm_s": 0.0, "join_s": 0.0}
            raise WorkerError(self.rank, "h", "worker process died", kind="died")
        return 5


def whole_snapshots(monkeypatch: pytest.MonkeyPatch, g: WorkerGroup, r: Recovery) -> list[int]:
    """Every survivor holds its own shard of every step, node n's holder every rank's: a
    recovery restores the step asked for, its shards ``shard<step>-<rank>``. Returns the steps
    fetched, in order."""
    from ringtrain.policies.snapshots import Holding, Source

    steps = range(1, 100)
    g.holders = {"n": "holder"}
    fetched: list[int] = []

    def holdings(survivors: dict[int, Member]) -> list[Holding]:
        peers = [Holding(Source.PEER, f"peer:{k}", frozenset((s, k) for s in steps), tuple((s, 4) for s in steps)) for k in survivors]
        node = Holding(Source.NODE, "node:n", frozenset((s, k) for s in steps for k in range(4)), tuple((s, 4) for s in steps))
        return [*peers, node]

    def fetch(plan: Any, survivors: dict[int, Member]) -> list[Any]:
        fetched.append(plan.step)
        return [f"shard{plan.step}-{i}" for i in range(4)]

    monkeypatch.setattr(r, "_holdings", holdings)
    monkeypatch.setattr(r, "_fetch", fetch)
    return fetched


def test_the_retry_reads_the_shards_the_interrupted_recovery_fetched(monkeypatch: pytest.MonkeyPatch) -> None:
    faults = [FaultSpec(kind="crash_restoring", rank=2, step=1), FaultSpec(kind="nan", rank=0, step=9)]
    job = config.JobConfig(mesh=config.MeshConfig(dp=2, cp=2), chaos=config.ChaosConfig(faults=faults))
    g = WorkerGroup(job, "cpu")
    info = WorkerInfo(0, "h", 1, "cpu", "n")
    g.members = [Member(f"a{r}", Slot("pg", r), info=info) for r in range(4)]
    worlds = ScriptedWorlds(g, breaks=1, rank=2)
    monkeypatch.setattr(g, "form_world", worlds.form_world)
    monkeypatch.setattr(g, "kill", lambda members, reuse_slots=True: None)
    monkeypatch.setattr(g, "spawn", lambda count: [Member(f"new{i}", Slot("pg2", i), warm="w") for i in range(count)])
    monkeypatch.setattr(g, "release_unused_placement", lambda: None)
    r = Recovery(g)
    plans = whole_snapshots(monkeypatch, g, r)
    monkeypatch.setattr(r, "_forget_after", lambda step: None)
    monkeypatch.setattr(recovery_module, "produced", lambda refs: [True] * len(refs))

    with pytest.raises(WorkerError):
        r.reform(Reform(lost=frozenset({1}), new_dp=2, spares=0, last_step=5, fired_through=6))
    resumed = r.reform(Reform(lost=frozenset({2}), new_dp=2, spares=0, last_step=5, fired_through=6))

    assert resumed.step == 5
    assert plans == [5]  # planned once: the retry did not ask the holders again
    (_, first_job, first_shards), (members, retry_job, retry_shards) = worlds.worlds
    assert retry_shards == first_shards == [f"shard5-{i}" for i in range(4)]
    # The chaos fault that struck the recovery is for its first attempt only.
    assert worlds.crashing == [frozenset({2}), frozenset()]
    assert [f.kind for f in first_job.chaos.faults] == [f.kind for f in retry_job.chaos.faults] == ["nan"]
    # The next recovery plans afresh.
    r.reform(Reform(lost=frozenset({0}), new_dp=2, spares=0, last_step=7))
    assert plans == [5, 7]


def test_a_restoring_fault_never_fires_as_a_step_fault() -> None:
    plan = FaultPlan([FaultSpec(kind="crash_restoring", rank=1, step=2)])
    assert plan.take(1, 2) == [] and plan.faults
    assert plan.restoring_due(1) == [] and plan.restoring_due(2) == plan.faults == plan.restoring_due(3)
    assert recovery_policy.RESTORING_FAULT == "crash_restoring"


def test_a_restoring_fault_strikes_the_first_recovery_from_its_step_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """``{crash_restoring, rank 2, step 30}``: not in the recovery from a failure in step 10,
    nor in its retry; in the first attempt of the recovery from a failure in step 30 or later
    (here 31), and in no recovery after."""
    faults = [FaultSpec(kind="crash_restoring", rank=2, step=30), FaultSpec(kind="crash", rank=0, step=40)]
    job = config.JobConfig(mesh=config.MeshConfig(dp=2, cp=2), chaos=config.ChaosConfig(faults=faults))
    g = WorkerGroup(job, "cpu")
    info = WorkerInfo(0, "h", 1, "cpu", "n")
    g.members = [Member(f"a{r}", Slot("pg", r), info=info) for r in range(4)]
    worlds = ScriptedWorlds(g, breaks=1, rank=1)
    monkeypatch.setattr(g, "form_world", worlds.form_world)
    monkeypatch.setattr(g, "kill", lambda members, reuse_slots=True: None)
    monkeypatch.setattr(g, "spawn", lambda count: [Member(f"new{i}", Slot("pg2", i), warm="w") for i in range(count)])
    monkeypatch.setattr(g, "release_unused_placement", lambda: None)
    r = Recovery(g)
    whole_snapshots(monkeypatch, g, r)
    monkeypatch.setattr(r, "_forget_after", lambda step: None)
    monkeypatch.setattr(recovery_module, "produced", lambda refs: [True] * len(refs))

    with pytest.raises(WorkerError):  # the recovery from step 10 breaks once: retried
        r.reform(Reform(lost=frozenset({1}), new_dp=2, spares=0, last_step=9, fired_through=10))
    r.reform(Reform(lost=frozenset({1}), new_dp=2, spares=0, last_step=9, fired_through=10))
    assert worlds.crashing == [frozenset(), frozenset()]
    assert [f.kind for f in g.job.chaos.faults] == ["crash_restoring", "crash"]  # still to come
    r.reform(Reform(lost=frozenset({3}), new_dp=2, spares=0, last_step=30, fired_through=31))
    assert worlds.crashing[-1] == frozenset({2})
    assert [f.kind for f in g.job.chaos.faults] == ["crash"]
    r.reform(Reform(lost=frozenset({3}), new_dp=2, spares=0, last_step=40, fired_through=41))
    assert worlds.crashing[-1] == frozenset()
    # A rollback in place from step 35 restores on the same workers: struck there, once.
    g.job = job
    monkeypatch.setattr(g, "restore_refs", lambda shards, crash_restoring=frozenset(): worlds.crashing.append(crash_restoring) or 34)
    r.rollback(last_step=34, rejoin=False, fired_through=35)
    r.rollback(last_step=36, rejoin=False, fired_through=37)
    assert worlds.crashing[-2:] == [frozenset({2}), frozenset()]


# --- a shard lost in transit, written again from a replica (ZeRO-0) ---------------------------


def test_a_shard_lost_in_transit_is_rebuilt_by_a_survivor_instead_of_redoing_the_step() -> None:
    from ringtrain.policies.snapshots import Holding, Source, plan_restore

    # Rank 1 died right after step 10: its shard of 10 never reached a holder.
    node = Holding(Source.NODE, "node:a", frozenset({(9, 0), (9, 1), (10, 0)}), ((9, 2), (10, 2)))
    peer = Holding(Source.PEER, "peer:0", frozenset({(9, 0), (10, 0)}), ((9, 2), (10, 2)))
    assert plan_restore([node, peer], newest=10).step == 9  # without a rebuild: step 10 redone
    live = Holding(Source.PEER, "peer:0", peer.shards, peer.world_sizes, rebuilds=((10, 2),))
    plan = plan_restore([node, live], newest=10)
    assert plan is not None and plan.step == 10
    assert plan.fetch == ((0, "peer:0"), (1, "rebuild:peer:0"))
    # A held copy beats a rebuild; a rebuild of another world's step is no use.
    assert plan_restore([node, live], newest=9).fetch == ((0, "peer:0"), (1, "node:a"))
    other = Holding(Source.PEER, "peer:0", peer.shards, peer.world_sizes, rebuilds=((10, 4),))
    assert plan_restore([node, other], newest=10).step == 9


def test_a_retry_reads_a_dead_workers_shard_while_its_node_lives(monkeypatch: pytest.MonkeyPatch) -> None:
    """A fetched shard stays in its producer's node after the producer dies: when the second
    failure takes a worker that served one, the retry reads the shards as they are while that
    node lives, and plans the restore again once the node is gone, or when a call failed."""
    from ringtrain.policies.snapshots import Holding, Source

    job = config.JobConfig(mesh=config.MeshConfig(dp=2, cp=2))
    g = WorkerGroup(job, "cpu")
    g.members = [Member(f"a{r}", Slot("pg", r), info=WorkerInfo(r, "h", 1, "cpu", f"n{r}")) for r in range(4)]
    g.holders = {f"n{r}": "holder" for r in range(4)}
    worlds = ScriptedWorlds(g, breaks=4, rank=2)
    monkeypatch.setattr(g, "form_world", worlds.form_world)
    monkeypatch.setattr(g, "kill", lambda members, reuse_slots=True: None)
    monkeypatch.setattr(g, "spawn", lambda count: [Member(f"new{i}", Slot("pg2", i), warm="w") for i in range(count)])
    monkeypatch.setattr(g, "release_unused_placement", lambda: None)
    r = Recovery(g)
    plans: list[tuple[str, ...]] = []

    def holdings(survivors: dict[int, Member]) -> list[Holding]:
        # Each rank's shard from its own survivor, the lost one's from node n1's holder.
        plans.append(tuple(m.handle for m in survivors.values()))
        peers = [Holding(Source.PEER, f"peer:{k}", frozenset({(5, k)}), ((5, 4),)) for k in survivors]
        return [*peers, Holding(Source.NODE, "node:n1", frozenset((5, k) for k in range(4)), ((5, 4),))]

    monkeypatch.setattr(r, "_holdings", holdings)
    monkeypatch.setattr(r, "_fetch", lambda plan, survivors: [f"shard{len(plans)}-{i}" for i in range(4)])
    monkeypatch.setattr(r, "_forget_after", lambda step: None)
    monkeypatch.setattr(recovery_module, "produced", lambda refs: [True] * len(refs))

    with pytest.raises(WorkerError):
        r.reform(Reform(lost=frozenset({1}), new_dp=2, spares=0, last_step=5))
    # The world being formed lost its rank 2, a2, which served rank 2's shard; its node n2
    # lives, and the shard with it: the retry reads the same shards.
    with pytest.raises(WorkerError):
        r.reform(Reform(lost=frozenset({2}), new_dp=2, spares=0, last_step=5))
    assert len(plans) == 1 and worlds.worlds[1][2] == worlds.worlds[0][2] == [f"shard1-{i}" for i in range(4)]
    # Node n2 is found gone: a2's shard went with it, so the restore is planned again.
    g.forget_node("n2")
    with pytest.raises(WorkerError):
        r.reform(Reform(lost=frozenset({2}), new_dp=2, spares=0, last_step=5))
    assert len(plans) == 2 and "a2" not in plans[1]
    assert worlds.worlds[2][2] == [f"shard2-{i}" for i in range(4)]
    # The third world loses its rank 2 too, a fresh worker that served nothing (rank 2's shard
    # came from node n1's holder, which lives): the second plan's shards are read as they are.
    with pytest.raises(WorkerError):
        r.reform(Reform(lost=frozenset({2}), new_dp=2, spares=0, last_step=5))
    assert len(plans) == 2 and worlds.worlds[3][2] == worlds.worlds[2][2]
    # A call that failed holds an error, not a shard (its producer died before answering), even
    # with its node alive: read again, or every retry would restore the same error.
    monkeypatch.setattr(recovery_module, "produced", lambda refs: [ref != "shard2-3" for ref in refs])
    r.reform(Reform(lost=frozenset({2}), new_dp=2, spares=0, last_step=5))
    assert len(plans) == 3 and worlds.worlds[4][2] == [f"shard3-{i}" for i in range(4)]


def test_a_shard_is_readable_while_its_producer_or_the_producers_node_lives() -> None:
    from ringtrain.policies.snapshots import RestorePlan

    g = WorkerGroup(config.JobConfig(mesh=config.MeshConfig(dp=2, cp=2)), "cpu")
    r = Recovery(g)
    a0, a1 = (Member(f"a{k}", Slot("pg", k), info=WorkerInfo(k, "h", 1, "cpu", "n0")) for k in range(2))
    survivors = {0: a0}
    plan = RestorePlan(5, 3, ((0, "peer:0"), (1, "node:n1"), (2, "rebuild:peer:0")))
    sources = recovery_module.producers(plan, survivors)
    assert sources == [a0, "n1", a0]
    g.holders = {"n0": "holder", "n1": "holder"}
    assert all(r._readable(s, survivors) for s in sources)
    assert r._readable(a1, survivors)  # dead, on a live node
    g.holders = {"n0": "holder"}  # node n1 was found dead: its holder's shards went with it
    assert not r._readable("n1", survivors)
    g.holders = {"n1": "holder"}  # node n0 was found dead: a0 survives only if it answers
    assert r._readable(a0, survivors) and not r._readable(a1, survivors)
    g.holders = {}  # no holders: no node is known to live, a dead worker's shard is read again
    assert r._readable(a0, survivors) and not r._readable(a1, survivors)


# --- a straggler's own newest shard counts ------------------------------------------------------


def evicting(monkeypatch: pytest.MonkeyPatch) -> tuple[Recovery, list[str], list[Any]]:
    """A dp 2 x cp 2 Recovery with one ready spare whose Ray side is scripted: every rank asked
    holds its own shards of steps 5 and 6, node n's holder every shard of step 5 and of 6 all
    but rank 3's (still in transit). Returns the recovery, the events in order and the plans."""
    from ringtrain.policies.snapshots import Holding, Source

    g = WorkerGroup(config.JobConfig(mesh=config.MeshConfig(dp=2, cp=2)), "cpu")
    info = WorkerInfo(0, "h", 1, "cpu", "n")
    g.members = [Member(f"a{r}", Slot("pg", r), info=info) for r in range(4)]
    spare = Member("spare", Slot("spares", 0), info=info)
    g.spares = [spare]
    events: list[str] = []
    plans: list[Any] = []
    monkeypatch.setattr(g, "ready_spares", lambda: list(g.spares))
    monkeypatch.setattr(g, "spawn", lambda count: [])
    monkeypatch.setattr(g, "release_unused_placement", lambda: None)
    monkeypatch.setattr(g, "kill", lambda members, reuse_slots=True: events.append(f"kill {[m.handle for m in members]}") if members else None)
    monkeypatch.setattr(g, "quarantine", lambda members: events.append(f"quarantine {[m.handle for m in members]}"))

    def form_world(members: list[Member], job: config.JobConfig, snapshot: Optional[list[Any]] = None, **_: Any) -> int:
        g.job, g.members = job, members
        events.append(f"form {[m.handle for m in members]}")
        return int(str(snapshot[0]).split("@")[1]) if snapshot else 0

    monkeypatch.setattr(g, "form_world", form_world)
    r = Recovery(g)

    def holdings(survivors: dict[int, Member]) -> list[Holding]:
        events.append(f"holdings {sorted(survivors)}")
        peers = [Holding(Source.PEER, f"peer:{k}", frozenset({(5, k), (6, k)}), ((5, 4), (6, 4))) for k in survivors]
        node = frozenset({(5, 0), (5, 1), (5, 2), (5, 3), (6, 0), (6, 1), (6, 2)})
        return peers + [Holding(Source.NODE, "node:n", node, ((5, 4), (6, 4)))]

    def fetch(plan: Any, survivors: dict[int, Member]) -> list[Any]:
        plans.append(plan)
        return [f"{where}@{plan.step}" for _, where in plan.fetch]

    monkeypatch.setattr(r, "_holdings", holdings)
    monkeypatch.setattr(r, "_fetch", fetch)
    monkeypatch.setattr(r, "_forget_after", lambda step: None)
    return r, events, plans


def test_a_straggler_eviction_restores_the_step_it_finished_from_its_own_shard(monkeypatch: pytest.MonkeyPatch) -> None:
    r, events, plans = evicting(monkeypatch)
    # As the Controller evicts a straggler after step 6: restore_to = fired_through = 6.
    resumed = r.reform(Reform(lost=frozenset({3}), new_dp=2, spares=1, last_step=6, fired_through=6, quarantine=True))

    assert resumed.step == 6  # no step redone
    assert plans[0].fetch == ((0, "peer:0"), (1, "peer:1"), (2, "peer:2"), (3, "peer:3"))
    # Read while it lives, stopped (its slot held) once its shard was fetched, then replaced.
    assert events == ["holdings [0, 1, 2, 3]", "quarantine ['a3']", "form ['a0', 'a1', 'a2', 'spare']"]


def test_a_rank_evicted_for_corrupting_data_is_never_read(monkeypatch: pytest.MonkeyPatch) -> None:
    r, events, plans = evicting(monkeypatch)
    # An SDC scan failed in step 7; the last clean scan was after step 6.
    resumed = r.reform(Reform(lost=frozenset({3}), new_dp=2, spares=1, last_step=6, fired_through=7, quarantine=True))

    assert events[:2] == ["quarantine ['a3']", "holdings [0, 1, 2]"]
    assert resumed.step == 5 and (3, "node:n") in plans[0].fetch  # its shard of 6 was in transit
    assert recovery_module.evicted_alive(quarantine=True, last_step=6, fired_through=6)
    assert not recovery_module.evicted_alive(quarantine=False, last_step=6, fired_through=6)  # a retry's dead rank
