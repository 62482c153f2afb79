"""Collective recording, hang diagnosis and SDC probes on real gloo ranks.

- The recorder's bookkeeping (nested calls, async handles, errors, the bounded buffer) on a
  one-rank group in this process.
- A real dp=2 x cp=2 ZeRO-2 training step is recorded on every rank: ring P2P, DeepSpeed's
  reductions and gathers, the loss all-reduce, with the same (group, seq, op, shape) sequence on
  every member of a group, and the same (op, site) at each call index on every rank.
- Injected hangs (rank 3 skips a collective / passes a wrong shape / is stuck in compute) are
  diagnosed as the Ray worker will: a second thread in each rank snapshots the recorder and the
  stacks while the main thread is blocked, rank 0 gathers every rank's snapshot and builds the
  verdict. The ranks then exit from that thread (their main threads cannot be unblocked).
- The SDC probes agree bit for bit across ranks and rounds (judged round by round as the
  Controller judges them: not one false alarm; bench/probes.py runs 2000 such rounds), and a
  flipped bit is named. The chaos flip corrupts the probe's own output, so a rank whose
  arithmetic is wrong (its GEMM, then its attention kernel, one element one ulp off) with no
  flip hook is named too: the detection does not depend on the probe corrupting itself.
"""

from __future__ import annotations

import contextlib
import datetime
import math
import multiprocessing as mp
import os
import socket
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterator, Optional

import pytest

from ringtrain_dev.ranks import rank_context, run_ranks
from ringtrain_dev.tiny import TINY_MODEL

pytestmark = [pytest.mark.dist, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
WORLD = 4
SDC_ROUNDS = 100  # a clean run of this many probe rounds must raise no alarm
BAD_GEMM_RANK = 3  # ranks whose arithmetic goes wrong in the last two rounds (not the flipped ones)
BAD_ATTENTION_RANK = 0
WAIT_S = 60.0  # bound on every wait below; the ranks' own process groups time out after it
TINY = [
    *TINY_MODEL,
    "data.seq_len=64",
    "train.global_batch=4",
    "train.steps=4",
    "train.warmup_steps=2",
    "mesh.dp=2",
    "mesh.cp=2",
    "attention.impl=ring",
    "attention.kv_exchange=ring",  # the P2P exchange, whatever auto would pick
    "zero.stage=2",
]


def _init(rank: int, store_path: str) -> None:
    import torch
    import torch.distributed as dist

    from ringtrain.train import forensics

    torch.set_num_threads(1)
    forensics.arm_flight_recorder()
    dist.init_process_group(
        "gloo", store=dist.FileStore(store_path, WORLD), rank=rank, world_size=WORLD,
        timeout=datetime.timedelta(seconds=WAIT_S),
    )


# --- the recorder's bookkeeping, in this process on a one-rank group ----------------------------


@pytest.fixture
def one_rank(tmp_path: Path) -> Any:
    import torch.distributed as dist

    from ringtrain.train import collectives

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        yield collectives
    finally:
        collectives.uninstall()
        dist.destroy_process_group()


def test_the_recorder_counts_outer_calls_ends_async_ones_on_wait_and_keeps_errors(one_rank: Any) -> None:
    import torch
    import torch.distributed as dist

    collectives = one_rank
    recorder = collectives.install(capacity=8)
    t = torch.ones(4, 2)
    dist.all_gather_object([None], {"x": 1})  # gathers sizes, then data: one record, not three
    work = dist.all_reduce(t, async_op=True)
    (pending,) = [r for r in recorder.records() if r["op"] == "all_reduce"]
    assert pending["end"] is None and pending["shapes"] == [[4, 2]] and pending["dtype"] == "float32"
    assert work.wait() and work.is_completed()  # the handle still behaves as torch's
    done = recorder.records()[-1]
    assert done["end"] is not None and done["end"] >= done["start"]
    with pytest.raises(RuntimeError, match="invalid root rank"):
        dist.broadcast(t, src=5)
    failed = recorder.records()[-1]
    assert failed["op"] == "broadcast" and "invalid root rank" in failed["error"]
    assert [r["op"] for r in recorder.records()] == ["all_gather_object", "all_reduce", "broadcast"]
    assert all(r["site"].startswith("dist/test_collectives.py:") for r in recorder.records())
    assert [r["seq"] for r in recorder.records()] == [1, 2, 3] and recorder.records()[0]["group_ranks"] == [0]

    for _ in range(10):  # the buffer keeps the newest ``capacity``; the counters go on
        dist.barrier()
    kept = recorder.records()
    assert len(kept) == 8 and kept[-1]["seq"] == 13 and kept[0]["index"] == 5
    assert recorder.state()["num_issued"] == 13 and recorder.state()["in_collective"] is None
    kept[0]["op"] = "changed"
    assert recorder.records()[0]["op"] == "barrier"  # readers get copies

    recorder.reset()
    dist.barrier()
    assert [(r["seq"], r["index"]) for r in recorder.records()] == [(1, 0)]


# --- a recorded training step, then SDC probe rounds, in one set of processes -----------------


def _one_ulp_up(t: Any, index: tuple[int, ...]) -> Any:
    """A copy of ``t`` with ``t[index]`` moved to the next float up: the smallest wrong answer."""
    import torch

    out = t.clone()
    out[index] = torch.nextafter(out[index], torch.tensor(math.inf, dtype=out.dtype))
    return out


@contextlib.contextmanager
def _gemm_one_ulp_off() -> Iterator[list[str]]:
    """This process's matrix products come back with one element one ulp off, whichever entry
    point computes them (``@``, ``matmul``, ``mm``); yields the names of the corrupted calls."""
    from torch.overrides import TorchFunctionMode

    hits: list[str] = []

    class BadMatrixUnit(TorchFunctionMode):
        def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            out = func(*args, **(kwargs or {}))
            name = getattr(func, "__name__", "")
            if name in ("matmul", "__matmul__", "mm"):
                hits.append(name)
                out = _one_ulp_up(out, (5, 17))
            return out

    with BadMatrixUnit():
        yield hits


@contextlib.contextmanager
def _attention_one_ulp_off(device: Any) -> Iterator[list[str]]:
    """The attention kernel the probe resolves returns one output element one ulp off (its LSE
    intact); yields the names of the corrupted kernels."""
    import torch

    from ringtrain.train.attention.kernels import get_kernel

    kernel = type(get_kernel("auto", device_type=device.type, dtype=torch.float32))
    original = kernel._op_forward
    hits: list[str] = []

    def bad_forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        out, lse, aux = original(self, *args, **kwargs)  # in the op's layout: query 9, head 1
        hits.append(self.name)
        return _one_ulp_up(out, (0, 1, 9, 3) if self.head_major else (0, 9, 1, 3)), lse, aux

    kernel._op_forward = bad_forward  # type: ignore[method-assign]
    try:
        yield hits
    finally:
        kernel._op_forward = original  # type: ignore[method-assign]


def _train_rank(rank: int, world: int, store_path: str, results: mp.Queue) -> None:
    import torch
    import torch.distributed as dist

    from ringtrain import config
    from ringtrain.train import collectives, sdc_probes
    from ringtrain.train.trainer import Trainer, set_rank_env

    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / ".ringtrain-cache" / "torch_extensions"))
    device = torch.device("cpu")
    set_rank_env(rank=rank, world_size=world, device=device)
    _init(rank, store_path)
    try:
        original = dist.all_reduce
        recorder = collectives.install()
        assert collectives.install() is recorder and dist.all_reduce is not original
        trainer = Trainer(config.load(None, TINY), rank=rank, device=device)
        first = recorder.state()["num_issued"]
        trainer.train_step()
        step = [r for r in recorder.records() if r["index"] >= first]
        state = recorder.state()

        rounds = [sdc_probes.digests(sdc_probes.run_probes(device)) for _ in range(SDC_ROUNDS)]
        flips = {2: sdc_probes.BitFlip("gemm_float32", element=17, bit=3),
                 1: sdc_probes.BitFlip("all_reduce_x4", element=5, bit=30)}
        rounds.append(sdc_probes.digests(sdc_probes.run_probes(device, flip=flips.get(rank))))
        # No flip hook from here on: every rank runs the same round, one rank's arithmetic is wrong.
        with _gemm_one_ulp_off() if rank == BAD_GEMM_RANK else contextlib.nullcontext([]) as gemm_hits:
            rounds.append(sdc_probes.digests(sdc_probes.run_probes(device, flip=None)))
        with _attention_one_ulp_off(device) if rank == BAD_ATTENTION_RANK else contextlib.nullcontext([]) as attn_hits:
            rounds.append(sdc_probes.digests(sdc_probes.run_probes(device, flip=None)))

        collectives.uninstall()
        restored = dist.all_reduce is original and torch.distributed.distributed_c10d.all_reduce is original
        out = {"rank": rank, "step": step, "state": state, "rounds": rounds,
               "restored": restored, "corrupted": gemm_hits + attn_hits}
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, out)
        if rank == 0:
            results.put(gathered)
        trainer.close()
    except BaseException as exc:
        results.put(exc)
        raise


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_ranks(_train_rank, WORLD, tmp_path_factory.mktemp("probes"), timeout=180)


def test_a_training_step_records_every_collective_consistently(trained: list[dict[str, Any]]) -> None:
    assert all(r["restored"] for r in trained), "uninstall restores the original functions"
    for r in trained:
        assert r["step"], f"rank {r['rank']} recorded nothing"
        assert all(rec["end"] is not None and rec["error"] is None for rec in r["step"])
        assert r["state"]["in_collective"] is None
        assert all(rec["site"].startswith("ringtrain/") for rec in r["step"]), {rec["site"] for rec in r["step"]}
        ring = tuple(sorted({r["rank"], r["rank"] ^ 1}))  # rank = replica * cp + ring_pos
        kinds = {(rec["op"], tuple(rec["group_ranks"])) for rec in r["step"]}
        sites = {rec["op"]: rec["site"] for rec in r["step"]}
        assert ("batch_isend_irecv", ring) in kinds and "attention/exchanges/ring.py" in sites["batch_isend_irecv"]
        # ZeRO-2 on gloo reduces gradients with all_reduce and regathers parameters after the step.
        assert {("all_reduce", (0, 1, 2, 3)), ("all_gather_into_tensor", (0, 1, 2, 3))} <= kinds
        assert any("mesh.py" in rec["site"] and "all_reduce_mean" in rec["site"] for rec in r["step"])

    # Every member of a group saw the same calls on it, numbered 1, 2, 3, ... in order.
    by_group: dict[str, dict[int, list[tuple[Any, ...]]]] = defaultdict(dict)
    for r in trained:
        for rec in r["step"]:
            by_group[rec["group"]].setdefault(r["rank"], []).append(
                (rec["seq"], rec["op"], rec["shapes"], rec["dtype"], len(rec["peers"])))
    for group, members in by_group.items():
        ranks = {tuple(rec["group_ranks"]) for r in trained for rec in r["step"] if rec["group"] == group}
        assert len(ranks) == 1 and set(members) == set(next(iter(ranks))), group
        sequences = list(members.values())
        assert all(s == sequences[0] for s in sequences), f"group {group} differs between members"
        seqs = [s[0] for s in sequences[0]]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
    # The program is the same on every rank: call i has one op and one site everywhere.
    programs = [[(rec["index"], rec["op"], rec["site"]) for rec in r["step"]] for r in trained]
    assert all(p == programs[0] for p in programs)


def test_sdc_probes_agree_across_ranks_and_rounds_and_a_flipped_bit_is_named(trained: list[dict[str, Any]]) -> None:
    from ringtrain.policies.sdc import SdcScanner

    clean = [r["rounds"][:SDC_ROUNDS] for r in trained]
    names = set(clean[0][0])
    assert {"gemm_float32", "all_reduce_x4"} <= names and any(p.startswith("attention_") for p in names)
    assert all(rounds == [clean[0][0]] * SDC_ROUNDS for rounds in clean), "every rank, every round: the same bits"

    scanner = SdcScanner()
    alarms = [v for i in range(SDC_ROUNDS) if (v := scanner.check(i, {r["rank"]: r["rounds"][i] for r in trained}))]
    assert alarms == []
    verdict = scanner.check(SDC_ROUNDS, {r["rank"]: r["rounds"][SDC_ROUNDS] for r in trained})
    assert verdict is not None and verdict.kind == "outlier"
    assert verdict.ranks == (1, 2) and verdict.probes == ("all_reduce_x4", "gemm_float32")
    assert {(f.rank, f.probe, f.basis) for f in verdict.findings} == {
        (1, "all_reduce_x4", "majority"), (2, "gemm_float32", "majority")}


def test_a_rank_whose_gemm_or_attention_kernel_computes_wrong_is_named(trained: list[dict[str, Any]]) -> None:
    """No flip hook: the arithmetic the probe measures is wrong on one rank, by one ulp in one element."""
    from ringtrain.policies.sdc import SdcScanner

    clean = trained[0]["rounds"][0]
    (attention,) = [p for p in clean if p.startswith("attention_")]
    # The corruption ran where it was meant to: once per round (one fp32 GEMM, one attention
    # block on CPU), on its rank only.
    assert {r["rank"]: len(r["corrupted"]) for r in trained} == {
        r: int(r in (BAD_GEMM_RANK, BAD_ATTENTION_RANK)) for r in range(WORLD)}

    scanner = SdcScanner()
    assert scanner.check(0, {r["rank"]: r["rounds"][0] for r in trained}) is None  # the golden values
    cases = ((BAD_GEMM_RANK, "gemm_float32"), (BAD_ATTENTION_RANK, attention))
    for i, (bad, probe) in enumerate(cases, start=SDC_ROUNDS + 1):
        digests = {r["rank"]: r["rounds"][i] for r in trained}
        moved = {(r, p) for r, d in digests.items() for p in d if d[p] != clean[p]}
        assert moved == {(bad, probe)}, f"round {i}: {sorted(moved)} moved"
        verdict = scanner.check(i, digests)
        assert verdict is not None and verdict.kind == "outlier", verdict
        assert verdict.ranks == (bad,) and verdict.probes == (probe,), verdict.explanation
        (finding,) = verdict.findings
        assert (finding.rank, finding.basis, finding.expected) == (bad, "majority", clean[probe])


# --- injected hangs ----------------------------------------------------------------------------

# dp=2 x cp=2: data-parallel groups (0, 2) and (1, 3), rings (0, 1) and (2, 3). Rank 3 is the
# culprit; rank 1, its data-parallel peer, ends blocked in their all-reduce; ranks 0 and 2 (and
# rank 3 unless it is computing) end blocked in the world all-reduce that follows.
SCENARIOS = ("missing", "mismatch_shape", "compute")


def _stuck_in_compute(entering: threading.Event) -> None:
    entering.set()
    time.sleep(WAIT_S)  # the injected fault: busy outside any collective


def _hang_rank(
    rank: int, world: int, store_path: str, scenario: str, gather: mp.Queue, release: Any, results: mp.Queue
) -> None:
    import torch
    import torch.distributed as dist

    from ringtrain.policies.hangs import RankDiagnostics, diagnose
    from ringtrain.topology import Topology
    from ringtrain.train import collectives
    from ringtrain.train.attention.transport import ProcessGroupTransport
    from ringtrain.train.mesh import all_reduce_mean

    _init(rank, store_path)
    try:
        topology = Topology(2, 2, 1)
        timeout = datetime.timedelta(seconds=WAIT_S)

        def mine(groups: list[list[int]]) -> Any:
            made = [(ranks, dist.new_group(ranks, timeout=timeout)) for ranks in groups]
            return next(g for ranks, g in made if rank in ranks)

        dp_group, ring_group = mine(topology.dp_groups()), mine(topology.ring_groups())
        recorder = collectives.install()
        ring = ProcessGroupTransport(ring_group)
        nxt, prev = (ring.rank() + 1) % ring.size(), (ring.rank() - 1) % ring.size()
        kv = torch.full((2, 8), float(rank))

        def reduce_gradients(grad: torch.Tensor) -> None:
            dist.all_reduce(grad, group=dp_group)

        def step(fault: bool) -> None:
            ring.send_recv({nxt: [kv]}, {prev: [torch.empty_like(kv)]}, tag=0).wait()
            if fault and rank == 3 and scenario == "compute":
                _stuck_in_compute(entering)
            elif fault and rank == 3 and scenario == "missing":
                pass
            elif fault and rank == 3 and scenario == "mismatch_shape":
                reduce_gradients(torch.zeros(0))  # gloo returns at once; rank 1 waits for data
            else:
                if fault and rank == 1:
                    mark()
                reduce_gradients(torch.ones(8))
            if fault:
                mark()
            all_reduce_mean(torch.tensor(1.0))

        entering = threading.Event()
        final_index: list[int] = []

        def mark() -> None:
            final_index.append(recorder.state()["num_issued"])
            entering.set()

        def diagnostician() -> None:
            try:
                diagnose_from_here()
            except BaseException as exc:  # fail the test with the reason, not a queue timeout
                results.put(exc)
                results.close()
                results.join_thread()
                os._exit(1)
            os._exit(0)

        def diagnose_from_here() -> None:
            assert entering.wait(WAIT_S), "the main thread never reached its final position"
            deadline = time.monotonic() + WAIT_S
            while final_index:  # wait until the main thread is inside the call it ends blocked in
                inside = recorder.state()["in_collective"]
                if inside is not None and inside["index"] >= final_index[0]:
                    break
                assert time.monotonic() < deadline, "the main thread never blocked"
                release.wait(0.005)
            c = topology.coord(rank)
            gather.put((rank, c.replica, c.ring_pos, socket.gethostname(), recorder.diagnostics(flight_recorder=True)))
            if rank == 0:
                reports = sorted(gather.get(timeout=WAIT_S) for _ in range(world))
                ranks = [RankDiagnostics.from_probe(r, d, replica=rep, ring_pos=pos, host=host)
                         for r, rep, pos, host, d in reports]
                verdict = diagnose(ranks)
                results.put({"verdict": verdict.to_dict() if verdict else None,
                             "flight_recorder": [bool(d.get("flight_recorder")) for *_, d in reports]})
                results.close()
                results.join_thread()
                release.set()
            else:
                release.wait(WAIT_S)

        for _ in range(2):  # history: two healthy steps
            step(False)
        threading.Thread(target=diagnostician, name="diagnostics", daemon=True).start()
        step(True)
        raise AssertionError(f"rank {rank} finished a step that was meant to hang")
    except BaseException as exc:
        results.put(exc)
        raise


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_an_injected_hang_is_diagnosed_from_every_ranks_records_and_stacks(scenario: str, tmp_path: Path) -> None:
    import torch

    ctx = rank_context()
    out = run_ranks(_hang_rank, WORLD, tmp_path, scenario, ctx.Queue(), ctx.Event(), timeout=2 * WAIT_S)
    verdict: Optional[dict[str, Any]] = out["verdict"]
    assert verdict is not None
    assert verdict["kind"] == scenario and verdict["ranks"] == [3], verdict["explanation"]
    (culprit,) = verdict["culprits"]
    assert (culprit["replica"], culprit["ring_pos"], culprit["host"]) == (1, 1, socket.gethostname())
    assert (culprit["op"], culprit["group_ranks"]) == ("all_reduce", [1, 3])
    assert 1 in verdict["waiting"] and not verdict["others"]
    if scenario == "compute":
        assert any("_stuck_in_compute" in frame for frame in culprit["stack"]), culprit["stack"]
        assert verdict["waiting"] == [0, 1, 2]
    else:
        assert any("step" in frame for frame in culprit["stack"]), culprit["stack"]
    if scenario == "mismatch_shape":
        assert "[0] float32" in culprit["detail"] and "[8] float32" in culprit["detail"]
    if hasattr(torch._C._distributed_c10d, "_dump_fr_trace_json"):
        assert all(out["flight_recorder"]), "torch's flight recorder was armed and recorded"
