"""The recovery plan (``policies.recovery``), pure: the step restored and from whom, the ranks a
lost node takes, the seats, the chaos faults a new world keeps and what a retry reuses, each
decided once from a view of the cluster. Ray's Recovery and the simulated cluster carry out the
same plans: ``test_chaos_replay`` holds them against each other for every kept chaos run."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import pytest

from ringtrain.actors import recovery as ray_recovery
from ringtrain.actors import simulated
from ringtrain.chaos import FaultSpec
from ringtrain.policies import recovery
from ringtrain.policies.faults import Outcome, RankOutcome
from ringtrain.policies.recovery import Fetched, RecoveryError, node_losses, nodes_to_check, plan_recovery
from ringtrain.policies.snapshots import Holding, RestorePlan, Source
from ringtrain.topology import Topology


@dataclass
class View:
    """A dp 2 x cp 2 world whose every rank holds its own shard of ``peer_steps`` and node n's
    holder every rank's shard of ``node_steps``."""

    peer_steps: Sequence[int] = (5, 6)
    node_steps: Sequence[int] = (5,)
    spares: int = 1
    chaos: Sequence[FaultSpec] = ()
    kept: Optional[Fetched] = None
    readable: bool = True
    start: int = 0  # the step the run began at (a resume's)
    every: int = 5  # checkpoint.snapshot_every
    asked: list[frozenset[int]] = field(default_factory=list)

    @property
    def topology(self) -> Topology:
        return Topology(2, 2)

    def holdings(self, ranks: frozenset[int]) -> list[Holding]:
        self.asked.append(ranks)
        peers = [Holding(Source.PEER, f"peer:{r}", frozenset((s, r) for s in self.peer_steps), tuple((s, 4) for s in self.peer_steps)) for r in sorted(ranks)]
        node = frozenset((s, r) for s in self.node_steps for r in range(4))
        return [*peers, Holding(Source.NODE, "node:n", node, tuple((s, 4) for s in self.node_steps))]

    def ready_spares(self) -> int:
        return self.spares

    def start_step(self) -> int:
        return self.start

    def snapshot_every(self) -> int:
        return self.every

    def faults(self) -> Sequence[FaultSpec]:
        return self.chaos

    def fetched(self) -> Optional[Fetched]:
        return self.kept

    def fetched_readable(self, readers: frozenset[int]) -> bool:
        return self.readable


def test_ray_and_the_simulated_cluster_plan_with_the_one_function() -> None:
    assert ray_recovery.plan_recovery is simulated.plan_recovery is recovery.plan_recovery


def test_a_node_found_gone_takes_every_rank_on_it() -> None:
    outcomes = [RankOutcome(0, Outcome.ERROR, "gloo: peer"), RankOutcome(1, Outcome.DIED), RankOutcome(2, Outcome.OK), RankOutcome(3, Outcome.DIED)]
    node_of = ["a", "a", "b", "b"]
    assert nodes_to_check(outcomes, node_of=node_of) == ["a", "b"]
    taken = node_losses(outcomes, node_of=node_of, gone=["a"])
    assert [(o.outcome, o.node_alive) for o in taken] == [(Outcome.DIED, False), (Outcome.DIED, False), (Outcome.OK, True), (Outcome.DIED, True)]
    assert taken[0].error == "gloo: peer" and taken[1].error == "node lost"


def test_the_restore_point_is_the_newest_whole_step_read_from_the_survivors_and_the_holders() -> None:
    # Rank 3 died after step 6: its shard of 6 is nowhere else, so step 5 is restored, its
    # shard from the node holder.
    view = View()
    plan = plan_recovery(view, lost=frozenset({3}), new_dp=2, spares=1, last_step=6)
    assert (plan.step, plan.restore.fetch if plan.restore else None) == (5, ((0, "peer:0"), (1, "peer:1"), (2, "peer:2"), (3, "node:n")))
    assert view.asked == [frozenset({0, 1, 2})]  # a dead rank's memory is not asked
    assert (plan.seats, plan.spares, plan.new_workers, plan.evicted) == ((0, 1, 2, None), 1, 0, ())
    # A straggler evicted between steps is alive with a state to trust: its own shard counts.
    trusted = plan_recovery(View(), lost=frozenset({3}), new_dp=2, spares=1, last_step=6, fired_through=6, quarantine=True)
    assert (trusted.step, trusted.readers) == (6, {0, 1, 2, 3})
    # Step 0 is the initial state: nothing to read.
    assert plan_recovery(View(), last_step=0).restore is None


def test_a_run_goes_back_to_its_start_when_no_snapshot_is_whole() -> None:
    """A failure before the first snapshot (every 5 steps here: none at or before step 4):
    a run that began at step 0 restarts from its initial state, which forming a world builds;
    one that resumed from step 3 kept that step as a snapshot, and without it whole has no way
    back."""
    fresh = plan_recovery(View(), lost=frozenset({3}), new_dp=2, spares=1, last_step=4)
    assert (fresh.restore, fresh.step, fresh.seats, fresh.spares) == (None, 0, (0, 1, 2, None), 1)
    rollback = plan_recovery(View(chaos=(FaultSpec(kind="crash_restoring", rank=2, step=5),)), last_step=4)
    assert rollback.restore is None and rollback.crashes == ()  # a restoring fault waits for a restore
    with pytest.raises(RecoveryError, match="no snapshot at or before step 4 is whole .* not even of step 3, which the run resumed from"):
        plan_recovery(View(start=3), lost=frozenset({3}), new_dp=2, last_step=4)
    resumed = plan_recovery(View(start=3, peer_steps=(3,), node_steps=(3,)), lost=frozenset({3}), new_dp=2, last_step=4)
    assert resumed.step == 3


@pytest.mark.parametrize("every", [0, 2])
def test_snapshots_taken_and_lost_end_the_run_rather_than_train_every_step_again(every: int) -> None:
    """At step 6 with snapshots every 2 steps (or none taken), none whole: the run ends, its
    durable checkpoints kept, instead of going back to step 0."""
    with pytest.raises(RecoveryError, match="no snapshot at or before step 6 is whole in the survivors' memory or the node holders \\("):
        plan_recovery(View(peer_steps=(), node_steps=(), every=every), lost=frozenset({3}), new_dp=2, last_step=6)


def test_empty_seats_go_to_the_ready_spares_first_then_to_new_workers() -> None:
    plan = plan_recovery(View(spares=1), lost=frozenset({1, 3}), new_dp=2, spares=2, last_step=5)
    assert (plan.seats, plan.spares, plan.new_workers) == ((0, None, 2, None), 1, 1)
    shrink = plan_recovery(View(), lost=frozenset({3}), new_dp=1, last_step=5)
    assert (shrink.dp, shrink.seats, shrink.evicted) == (1, (0, 1), (2,))


def test_a_new_world_keeps_the_faults_due_later_and_the_restoring_ones_still_waiting() -> None:
    crash, nan, restoring, later = (
        FaultSpec(kind="crash", rank=1, step=6), FaultSpec(kind="nan", rank=0, step=9),
        FaultSpec(kind="crash_restoring", rank=2, step=6), FaultSpec(kind="crash_restoring", rank=0, step=20),
    )  # fmt: skip
    plan = plan_recovery(View(chaos=(crash, nan, restoring, later)), lost=frozenset({1}), new_dp=2, last_step=5)
    assert plan.faults == (nan, later) and plan.crashes == (restoring,) and plan.crash_ranks == {2}
    # No snapshot to restore: the restoring fault waits for a recovery that has one.
    first = plan_recovery(View(chaos=(restoring,)), lost=frozenset({1}), new_dp=2, last_step=0, fired_through=7)
    assert first.crashes == () and first.faults == (restoring,)


def test_a_retry_reads_what_the_interrupted_recovery_fetched_while_it_is_readable() -> None:
    fetched = Fetched(6, RestorePlan(5, 4, ((0, "peer:0"), (1, "peer:1"), (2, "peer:2"), (3, "node:n"))))
    restoring = FaultSpec(kind="crash_restoring", rank=2, step=6)
    view = View(kept=fetched, chaos=(restoring,))
    plan = plan_recovery(view, lost=frozenset({2}), new_dp=2, spares=1, last_step=6)
    assert (plan.retry, plan.reused, plan.restore, plan.crashes) == (True, True, fetched.restore, ())
    assert view.asked == []  # nothing read again
    # A shard of it lost: read again (rank 2's memory went with it), still no restoring fault.
    again = plan_recovery(View(kept=fetched, readable=False, chaos=(restoring,)), lost=frozenset({2}), new_dp=2, last_step=6)
    assert (again.retry, again.reused, again.step, again.crashes) == (True, False, 5, ())
    # Another step asked for: a new recovery, planned afresh.
    fresh = plan_recovery(View(kept=fetched), lost=frozenset({1}), new_dp=2, last_step=5)
    assert (fresh.retry, fresh.reused) == (False, False)


def test_a_grow_restores_the_step_it_grows_at_or_none() -> None:
    plan = plan_recovery(View(), last_step=6, new_dp=3, fired_through=6, grow=True)
    assert (plan.step, plan.seats, plan.spares, plan.new_workers) == (6, (0, 1, 2, 3, None, None), 0, 2)
    with pytest.raises(RecoveryError, match="the snapshot of step 7 is not whole; cannot grow at this step"):
        plan_recovery(View(), last_step=7, new_dp=3, fired_through=7, grow=True)


def test_rays_recovery_goes_back_to_the_step_its_run_began_at(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ray's worker group answers the plan's start: 0 (no snapshot whole: the new world forms
    from the initial state, no shard fetched), or the step a resume's checkpoint restored."""
    import ray

    from ringtrain import config
    from ringtrain.actors.group import WorkerGroup
    from ringtrain.actors.protocols import Reform
    from ringtrain.actors.roster import Member, Slot
    from ringtrain.status import WorkerInfo

    every_5 = config.CheckpointConfig(snapshot_every=5)
    g = WorkerGroup(config.JobConfig(mesh=config.MeshConfig(dp=2, cp=2), checkpoint=every_5), "cpu")
    g.members = [Member(f"a{r}", Slot("pg", r), info=WorkerInfo(r, "h", 1, "cpu", "n")) for r in range(4)]
    formed: list[Optional[list[str]]] = []
    monkeypatch.setattr(g, "form_world", lambda members, job, snapshot=None, crash_restoring=frozenset(): formed.append(snapshot) or 0)
    monkeypatch.setattr(g, "kill", lambda members, reuse_slots=True: None)
    monkeypatch.setattr(g, "spawn", lambda count: [Member(f"new{i}", Slot("pg2", i), warm="w") for i in range(count)])
    monkeypatch.setattr(g, "release_unused_placement", lambda: None)
    r = ray_recovery.Recovery(g)
    monkeypatch.setattr(r, "_holdings", lambda survivors: [])  # a failure before the first snapshot
    monkeypatch.setattr(r, "_forget_after", lambda step: None)

    resumed = r.reform(Reform(lost=frozenset({3}), new_dp=2, spares=0, last_step=4))
    assert (resumed.step, formed) == (0, [None])
    monkeypatch.setattr(ray, "put", lambda blob: blob)
    monkeypatch.setattr(g, "restore_refs", lambda shards: 3)
    assert g.restore([b"shard0", b"shard1"]) == 3 and g.start_step == 3  # the run resumed from step 3
    with pytest.raises(RecoveryError, match="not even of step 3, which the run resumed from"):
        r.reform(Reform(lost=frozenset({3}), new_dp=2, spares=0, last_step=4))


def test_the_simulated_retry_reads_again_what_a_node_found_gone_served() -> None:
    """As on Ray: a shard the interrupted recovery fetched from a node's holder went with that
    node, so the retry plans the restore again from what is left instead of reusing it."""
    from ringtrain import config
    from ringtrain.actors.protocols import Reform
    from ringtrain.errors import WorkerError

    job = config.JobConfig(mesh=config.MeshConfig(dp=2, cp=2), chaos=config.ChaosConfig(faults=[
        FaultSpec(kind="crash_restoring", rank=0, step=6)]))  # fmt: skip
    group = simulated.SimulatedGroup(job, simulated.Clock())  # a ring to a node: ranks 0-1 on node-0, 2-3 on node-1
    for _ in range(5):
        group.train_step()
    group.safe_through()  # the holders have every step's snapshots
    sim = simulated.SimulatedRecovery(group, free_slots=1, job=job)
    with pytest.raises(WorkerError):  # rank 3 died in step 6; rank 0 of the new world dies restoring
        sim.reform(Reform(lost=frozenset({3}), new_dp=2, spares=0, last_step=5))
    fetched = sim.unfinished
    assert fetched is not None and fetched.restore is not None
    assert dict(fetched.restore.fetch)[3] == "node:node-0"  # the dead rank's shard, from the buddy holder
    assert plan_recovery(sim, lost=frozenset({0}), new_dp=2, last_step=5, fired_through=6).reused
    group.snapshots.gone.add("node-0")  # found gone while the recovery ran
    again = plan_recovery(sim, lost=frozenset({0}), new_dp=2, last_step=5, fired_through=6)
    assert (again.retry, again.reused, again.step) == (True, False, 5)
    assert "node:node-0" not in dict(again.restore.fetch if again.restore else ()).values()
