"""Hang diagnosis on hand-built records: each verdict kind, chains, ties and empty buffers.

The job in most cases is a dp=2 x cp=2 grid: data-parallel groups d0 (ranks 0, 2) and d1
(1, 3), rings r0 (0, 1) and r1 (2, 3), and the world w. Every rank runs the same program:
call 0 is a world all-reduce, call 1 the ring exchange, call 2 a data-parallel all-reduce at
site A, call 3 a world all-reduce at site B.
"""

from __future__ import annotations

from typing import Any, Optional

import pytest

from ringtrain.policies.hangs import (
    KINDS,
    CollectiveRecord,
    RankDiagnostics,
    Verdict,
    diagnose,
    stalled,
)

GROUPS = {"w": (0, 1, 2, 3), "d0": (0, 2), "d1": (1, 3), "r0": (0, 1), "r1": (2, 3)}
DP = {0: "d0", 1: "d1", 2: "d0", 3: "d1"}
RING = {0: "r0", 1: "r0", 2: "r1", 3: "r1"}
SITE_A = "ringtrain/train/engine.py:90 reduce_gradients"
SITE_B = "ringtrain/train/mesh.py:140 all_reduce_mean"
SITE_RING = "ringtrain/train/attention/exchanges/ring.py:60 _turn"
T0 = 1000.0


def rec(
    group: str, seq: int, index: int, op: str = "all_reduce", *, shape: tuple[int, ...] = (8,), site: str = SITE_A,
    done: bool = True, dtype: str = "float32", thread: str = "MainThread",
) -> CollectiveRecord:
    return CollectiveRecord(
        group=group, group_ranks=GROUPS[group], seq=seq, index=index, op=op, shapes=(shape,), dtype=dtype,
        start=T0 + index, end=T0 + index + 0.5 if done else None, site=site, thread=thread,
    )


def history(rank: int, upto: int) -> list[CollectiveRecord]:
    """The common program's completed calls 0 .. upto-1 on ``rank``."""
    program = [
        rec("w", 1, 0, site="ringtrain/train/trainer.py:10 start"),
        rec(RING[rank], 1, 1, "batch_isend_irecv", site=SITE_RING),
        rec(DP[rank], 1, 2, site=SITE_A),
        rec("w", 2, 3, site=SITE_B),
    ]
    return program[:upto]


def stack(*frames: tuple[str, int, str, str]) -> tuple[str, ...]:
    return tuple(f'  File "{f}", line {line}, in {func}\n    {code}\n' for f, line, func, code in frames)


TRAIN_STACK = stack(
    ("/job/platform/ringtrain/actors/worker.py", 50, "train_step", "report = self.trainer.train_step()"),
    ("/job/platform/ringtrain/train/trainer.py", 150, "_micro_step", "self.engine.backward(loss)"),
)
SLEEP_STACK = TRAIN_STACK + stack(("/job/platform/ringtrain/train/data.py", 77, "load", "time.sleep(600)"))


def diag(
    rank: int, records: list[CollectiveRecord], waiting_in: Optional[CollectiveRecord] = None, *,
    busy: bool = True, stacks: Optional[tuple[str, ...]] = None,
) -> RankDiagnostics:
    if waiting_in is not None:
        records = records + [waiting_in]
    return RankDiagnostics(
        rank=rank, replica=rank // 2, ring_pos=rank % 2, host=f"node-{rank // 2}", busy=busy,
        records=tuple(records), in_collective=waiting_in, last_progress=T0, last_thread="MainThread",
        stacks={"MainThread (1)": stacks or TRAIN_STACK},
    )


def waiting_dp(rank: int) -> RankDiagnostics:
    """Stuck in call 2, the data-parallel all-reduce."""
    return diag(rank, history(rank, 2), rec(DP[rank], 1, 2, done=False))


def waiting_world(rank: int) -> RankDiagnostics:
    """Past call 2, stuck in call 3, the world all-reduce."""
    return diag(rank, history(rank, 3), rec("w", 2, 3, site=SITE_B, done=False))


def only(verdict: Optional[Verdict]) -> Verdict:
    assert verdict is not None
    return verdict


def test_a_rank_that_skips_a_collective_is_missing_even_though_it_waits_too() -> None:
    # Rank 3 skipped the dp all-reduce and waits in the world one: rank 1 waits for rank 3 in
    # d1, ranks 0, 2 and 3 wait for rank 1 in w. The program order says who left it.
    skipped = diag(3, history(3, 2), rec("w", 2, 2, site=SITE_B, done=False))
    v = only(diagnose([waiting_world(0), waiting_dp(1), waiting_world(2), skipped]))
    assert v.kind == "missing" and v.ranks == (3,)
    c = v.culprits[0]
    assert (c.replica, c.ring_pos, c.host) == (1, 1, "node-1")
    assert (c.op, c.group, c.group_ranks, c.seq) == ("all_reduce", "d1", (1, 3), 1)
    assert "never entered all_reduce #1 on group d1" in c.detail and SITE_B in c.detail
    assert v.waiting == (0, 1, 2, 3) and not v.others
    assert "rank 3 (replica 1, ring_pos 1) on node-1" in v.explanation
    assert c.stack[-1] == "ringtrain/train/trainer.py:150 _micro_step: self.engine.backward(loss)"


def test_a_wrong_shape_is_a_shape_mismatch_decided_by_the_same_call_on_other_ranks() -> None:
    # Two members only, so no majority inside d1: ranks 0 and 2 passed (8,) at that call.
    wrong = diag(3, history(3, 2) + [rec("d1", 1, 2, shape=(0,))], rec("w", 2, 3, site=SITE_B, done=False))
    v = only(diagnose([waiting_world(0), waiting_dp(1), waiting_world(2), wrong]))
    assert v.kind == "mismatch_shape" and v.ranks == (3,)
    assert (v.culprits[0].op, v.culprits[0].group, v.culprits[0].seq) == ("all_reduce", "d1", 1)
    assert "[0] float32" in v.culprits[0].detail and "[8] float32" in v.culprits[0].detail


def test_a_wrong_dtype_is_a_shape_mismatch() -> None:
    wrong = diag(3, history(3, 2), rec("d1", 1, 2, dtype="bfloat16", done=False))
    v = only(diagnose([waiting_world(0), waiting_dp(1), waiting_world(2), wrong]))
    assert v.kind == "mismatch_shape" and v.ranks == (3,) and "bfloat16" in v.culprits[0].detail


def test_another_op_at_the_same_sequence_number_is_an_op_mismatch() -> None:
    wrong = diag(3, history(3, 2), rec("d1", 1, 2, "broadcast", done=False))
    v = only(diagnose([waiting_world(0), waiting_dp(1), waiting_world(2), wrong]))
    assert v.kind == "mismatch_op" and v.ranks == (3,)
    assert v.culprits[0].op == "broadcast" and "where the others passed all_reduce" in v.culprits[0].detail


def test_a_rank_stuck_outside_any_collective_is_compute_with_its_stack() -> None:
    slow = diag(3, history(3, 2), stacks=SLEEP_STACK)
    v = only(diagnose([waiting_world(0), waiting_dp(1), waiting_world(2), slow]))
    assert v.kind == "compute" and v.ranks == (3,)
    c = v.culprits[0]
    assert (c.op, c.group, c.seq) == ("all_reduce", "d1", 1)
    assert c.stack[-1] == "ringtrain/train/data.py:77 load: time.sleep(600)"
    assert "ringtrain/train/data.py:77 load" in c.detail
    assert v.waiting == (0, 1, 2)


def test_a_rank_that_does_not_answer_is_unreachable() -> None:
    v = only(diagnose([waiting_world(0), waiting_dp(1), waiting_world(2),
                       RankDiagnostics.unreachable(3, replica=1, ring_pos=1, host="node-1")]))
    assert v.kind == "unreachable" and v.ranks == (3,)
    c = v.culprits[0]
    assert (c.host, c.op, c.group) == ("node-1", "all_reduce", "d1")
    assert "ranks 0, 1, 2 wait for it" in c.detail


def test_unreachable_outranks_what_the_others_show() -> None:
    slow = diag(2, history(2, 2), stacks=SLEEP_STACK)
    v = only(diagnose([waiting_world(0), waiting_dp(1), slow, RankDiagnostics.unreachable(3)]))
    assert v.kind == "unreachable" and v.ranks == (3,)
    assert [(c.rank, c.kind) for c in v.others] == [(2, "compute")]


def test_several_ranks_in_compute_are_all_named() -> None:
    v = only(diagnose([waiting_world(0), diag(1, history(1, 2)), waiting_world(2), diag(3, history(3, 2))]))
    assert v.kind == "compute" and v.ranks == (1, 3)
    assert {(c.op, c.group) for c in v.culprits} == {("all_reduce", "w")}


def test_a_skipped_call_outranks_a_slow_rank() -> None:
    # Rank 1 is still computing; rank 3 skipped its dp all-reduce (nobody waits on it yet).
    skipped = diag(3, history(3, 2), rec("w", 2, 2, site=SITE_B, done=False))
    v = only(diagnose([waiting_world(0), diag(1, history(1, 2)), waiting_world(2), skipped]))
    assert v.kind == "missing" and v.ranks == (3,)
    assert [(c.rank, c.kind) for c in v.others] == [(1, "compute")]


def test_a_victim_waiting_elsewhere_is_followed_to_the_rank_it_waits_for() -> None:
    # Rank 2 never reached the ring exchange; rank 3 waits for it there, rank 1 waits for rank 3
    # in d1, rank 0 waits for rank 2 in d0.
    ranks = [
        waiting_dp(0),
        waiting_dp(1),
        diag(2, history(2, 1), stacks=SLEEP_STACK),
        diag(3, history(3, 1), rec("r1", 1, 1, "batch_isend_irecv", site=SITE_RING, done=False)),
    ]
    v = only(diagnose(ranks))
    assert v.kind == "compute" and v.ranks == (2,) and not v.others


def test_every_rank_outside_collectives_is_compute_for_all() -> None:
    v = only(diagnose([diag(r, history(r, 4), stacks=SLEEP_STACK) for r in range(4)]))
    assert v.kind == "compute" and v.ranks == (0, 1, 2, 3) and v.waiting == ()
    assert v.explanation.startswith("no rank is in a collective")


def test_empty_buffers() -> None:
    v = only(diagnose([diag(r, []) for r in range(4)]))
    assert v.kind == "compute" and v.ranks == (0, 1, 2, 3)
    assert diagnose([diag(r, [], busy=False) for r in range(4)]) is None  # idle, nothing owed
    assert diagnose([]) is None


def test_a_rank_that_finished_without_the_call_is_missing() -> None:
    v = only(diagnose([waiting_world(0), waiting_dp(1), waiting_world(2), diag(3, history(3, 2), busy=False)]))
    assert v.kind == "missing" and v.ranks == (3,) and "finished its work" in v.culprits[0].detail


def test_every_member_inside_the_same_call_is_a_transport_stall() -> None:
    v = only(diagnose([waiting_dp(0), waiting_dp(1), waiting_dp(2), waiting_dp(3)]))
    assert v.kind == "transport" and v.ranks == (0, 1, 2, 3)


def two_ranks(r0: CollectiveRecord, r1: CollectiveRecord) -> list[RankDiagnostics]:
    return [
        RankDiagnostics(rank=0, records=(r0,), in_collective=r0 if r0.end is None else None),
        RankDiagnostics(rank=1, records=(r1,), in_collective=r1 if r1.end is None else None),
    ]


def test_two_ranks_disagreeing_with_no_majority_are_both_named() -> None:
    a = CollectiveRecord("g", (0, 1), 1, 0, "all_reduce", ((8,),), "float32", T0, None, SITE_A)
    b = CollectiveRecord("g", (0, 1), 1, 0, "all_reduce", ((4,),), "float32", T0, None, SITE_A)
    v = only(diagnose(two_ranks(a, b)))
    assert v.kind == "mismatch_shape" and v.ranks == (0, 1)
    assert "no majority" in v.culprits[0].detail


def test_a_two_rank_wait_cycle_without_a_majority_names_both() -> None:
    # Each waits in a call the other never entered, on two groups of the same two ranks.
    a = CollectiveRecord("g", (0, 1), 1, 0, "all_reduce", ((8,),), "float32", T0, None, SITE_A)
    b = CollectiveRecord("h", (0, 1), 1, 0, "barrier", (), "", T0, None, SITE_B)
    v = only(diagnose(two_ranks(a, b)))
    assert v.kind == "missing" and v.ranks == (0, 1)


def test_records_and_diagnostics_come_from_the_recorder_dicts() -> None:
    record = {
        "group": "3", "group_ranks": [1, 3], "seq": 5, "index": 12, "op": "all_reduce", "shapes": [[4, 2]],
        "dtype": "float32", "peers": [], "start": T0, "end": None, "site": SITE_A, "thread": "MainThread",
        "error": None,
    }
    probe: dict[str, Any] = {
        "records": [record],
        "state": {"in_collective": record, "last_progress": T0 - 5, "group_seqs": {"3": 5}, "num_issued": 13,
                  "last_thread": "MainThread"},
        "stacks": {"MainThread (140)": list(TRAIN_STACK)},
    }
    d = RankDiagnostics.from_probe(1, probe, replica=0, ring_pos=1, host="h")
    assert d.in_collective is not None and d.in_collective.key == ("3", 5)
    assert d.in_collective.shapes == ((4, 2),) and d.records[0] == d.in_collective
    assert d.last_progress == T0 - 5 and d.stacks["MainThread (140)"] == TRAIN_STACK
    v = only(diagnose([d, RankDiagnostics.unreachable(3, host="h3")]))
    out = v.to_dict()
    assert out["kind"] == "unreachable" and out["ranks"] == [3] and out["culprits"][0]["group_ranks"] == [1, 3]
    assert out["kind"] in KINDS


def test_stalled() -> None:
    assert not stalled(100.0, 159.0, 60.0)
    assert stalled(100.0, 160.0, 60.0)
    with pytest.raises(ValueError, match="hang_timeout_s"):
        stalled(100.0, 160.0, 0)
