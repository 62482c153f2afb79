"""Context-parallel attention against a float64 single-rank reference, on gloo process groups.

Each world size is one group of spawned processes that runs every case of that size (spawning
costs seconds, a case milliseconds); the tests then check what each rank reported. The
reference is a plain softmax in float64 over the full, unsharded sequence, its gradients
sharded the same way as the inputs. DeepSpeed's own Ulysses layer is the peer check.

The last part holds the single-process checks: kernels, the LSE merge, kernel selection.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import time
import traceback
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import pytest
import torch
import torch.distributed as dist

from ringtrain.errors import ConfigError
from ringtrain.topology import CPLayout, cp_layout
from ringtrain.train.attention import (
    KernelUnavailableError,
    build_attention,
    count_comm,
    cp_shard,
    get_kernel,
    hybrid_attention,
    local_attention,
    merge_partials,
    ring_attention,
    select_kernel,
    ulysses_attention,
)
from ringtrain.train.attention.documents import Documents
from ringtrain.train.attention.kernels import MATH, CpuFlashKernel
from ringtrain_dev.ranks import rank_process

pytestmark = pytest.mark.dist

Tensor = torch.Tensor

SPAWN_TIMEOUT_S = 150.0
BATCH, HEAD_DIM = 2, 16
TOLERANCE = {"float32": 1e-5, "float16": 4e-3, "bfloat16": 3e-2}


# ---------------------------------------------------------------- reference


def reference_attention(
    q: Tensor, k: Tensor, v: Tensor, *, causal: bool, doc_ids: Optional[Tensor], window: Optional[int] = None,
    family: int = 0, positions: Optional[Tensor] = None,
) -> Tensor:
    """Softmax attention in float64; a query row with no visible key outputs 0 (doc id < 0 is
    padding); ``window``: a query at position id p sees keys at p - window < p' <= p, by
    ``positions`` [B, S] (default: the row's index); ``family``: documents in families of that
    many, the later ones seeing the first's keys too."""
    B, S, H, D = q.shape
    groups = H // k.shape[2]
    k, v = k.repeat_interleave(groups, dim=2), v.repeat_interleave(groups, dim=2)
    scores = torch.einsum("bqhd,bshd->bhqs", q, k) / math.sqrt(D)
    allowed = torch.ones(B, S, S, dtype=torch.bool)
    if causal:
        allowed &= torch.ones(S, S, dtype=torch.bool).tril()
    if window is not None:
        pos = torch.arange(S).expand(B, S) if positions is None else positions
        allowed &= pos[:, :, None] - pos[:, None, :] < window
    if doc_ids is not None:
        same = doc_ids[:, :, None] == doc_ids[:, None, :]
        if family:  # a family's later documents also see its first one's keys
            first = torch.where(doc_ids % family != 0, doc_ids - doc_ids % family, -2)
            same |= first[:, :, None] == doc_ids[:, None, :]
        allowed &= same & (doc_ids >= 0)[:, :, None]
    # A large finite fill (not -inf) keeps fully masked rows free of NaN; the product zeroes them.
    probs = torch.softmax(scores.masked_fill(~allowed[:, None], -1e300), dim=-1) * allowed[:, None]
    return torch.einsum("bhqs,bshd->bqhd", probs, v)


# Preference pairs as families of three documents (a prompt, two completions continuing it):
# each row's (document, length in sixteenths of the row), the rest padding. "pairs": two pairs,
# and one pair filling the row. "pairs-mixed": pairs among plain documents (a family's first
# alone), one pair's second completion more than a zigzag chunk after its prompt (on a ring of
# four, on a rank whose window neighbours hold none of the prompt).
FAMILY_ROWS = {
    "pairs": (((0, 3), (1, 2), (2, 4), (3, 2), (4, 2), (5, 2)), ((0, 7), (1, 4), (2, 5))),
    "pairs-mixed": (((0, 2), (3, 2), (4, 5), (5, 3), (6, 2)), ((0, 4), (1, 3), (2, 3), (3, 4))),
}
PAIR_FAMILY = 3


def make_doc_ids(kind: str, batch: int, seq: int) -> Optional[Tensor]:
    """Packed documents whose boundaries cut across zigzag chunks; "padded" adds padding (-1)
    tokens; "pairs" and "pairs-mixed" hold families of PAIR_FAMILY (FAMILY_ROWS)."""
    if kind == "none":
        return None
    if kind in FAMILY_ROWS:
        doc = torch.full((batch, seq), -1, dtype=torch.long)
        for row, parts in enumerate(FAMILY_ROWS[kind][:batch]):
            bounds = [0, *(seq * sum(n for _, n in parts[: i + 1]) // 16 for i in range(len(parts)))]
            for (doc_id, _), a, b in zip(parts, bounds[:-1], bounds[1:]):
                doc[row, a:b] = doc_id
        return doc
    doc = torch.zeros(batch, seq, dtype=torch.long)
    doc[0, seq // 3 :] = 1
    doc[0, seq // 3 + 5 :] = 2
    doc[1, seq // 2 + 3 :] = 1
    if kind == "padded":
        doc[0, -3:] = -1
        doc[1, 0] = -1
    return doc


def make_position_ids(doc: Tensor, family: int) -> Tensor:
    """Each token's position id as a preference pair's layout gives it: a document's count from 0,
    a family's later documents continue its first's (from its length on)."""
    pos = torch.zeros_like(doc)
    for b in range(doc.shape[0]):
        seen: dict[int, int] = {}
        for s, d in enumerate(doc[b].tolist()):
            first = d - d % family
            pos[b, s] = seen.get(d, 0) + (seen.get(first, 0) if d >= 0 and d != first else 0)
            seen[d] = seen.get(d, 0) + 1
    return pos


# ---------------------------------------------------------------- cases


@dataclass(frozen=True)
class Case:
    impl: str  # "ring" | "ulysses" | "hybrid" | "build" (build_attention, hybrid layout)
    ring: int
    ulysses: int
    heads: int = 4
    kv_heads: int = 4
    causal: bool = True
    docs: str = "none"  # "none" | "packed" | "padded" | "pairs"
    dtype: str = "float32"
    kernel: str = "auto"
    seq_per_rank: int = 8
    kv_exchange: str = "ring"  # how a ring group exchanges K/V: "ring" or "allgather"
    window: Optional[int] = None  # a causal sliding window of this many tokens

    @property
    def name(self) -> str:
        exchange = "" if self.kv_exchange == "ring" else f"-{self.kv_exchange}"
        window = "" if self.window is None else f"-w{self.window}"
        return (
            f"{self.impl}{self.ring}x{self.ulysses}-h{self.heads}k{self.kv_heads}-"
            f"{'causal' if self.causal else 'full'}-{self.docs}-{self.dtype}-{self.kernel}{exchange}{window}"
        )


def _ring_cases(world: int) -> list[Case]:
    cases = [
        Case("ring", world, 1, heads, kv, causal=causal)
        for causal in (True, False)
        for heads, kv in ((4, 4), (4, 2), (4, 1))
    ]
    cases += [
        Case("ring", world, 1, 4, 2, causal=True, docs="packed"),
        Case("ring", world, 1, 4, 2, causal=False, docs="padded"),
        Case("ring", world, 1, 4, 2, causal=True, docs="pairs"),
        Case("ring", world, 1, 4, 2, causal=True, docs="pairs", kv_exchange="allgather"),
    ]
    # The same sequences with K/V all gathered instead of passed around.
    cases += [
        Case("ring", world, 1, heads, kv, causal=causal, docs=docs, kv_exchange="allgather")
        for causal in (True, False)
        for heads, kv, docs in ((4, 4, "none"), (4, 1, "none"), (4, 2, "packed"), (4, 2, "padded"))
    ]
    # Sliding windows shorter than a zigzag chunk (4 tokens), as long, longer than a rank's block
    # and longer than the sequence; with documents, and with K/V all gathered.
    cases += [
        Case("ring", world, 1, 4, 2, window=window, docs=docs, kv_exchange=exchange)
        for window, docs, exchange in ((3, "none", "ring"), (4, "none", "ring"), (6, "none", "ring"),
                                       (13, "none", "ring"), (64, "none", "ring"), (3, "padded", "ring"),
                                       (6, "packed", "ring"), (3, "none", "allgather"), (6, "packed", "allgather"))
    ]
    # Pairs under windows, measured by position ids: shorter than every prompt, between the
    # prompts' lengths, longer than every prompt; among plain documents; both exchanges (which a
    # window no longer than a chunk turns into the neighbours').
    cases += [
        Case("ring", world, 1, 4, 2, window=window, docs=docs, kv_exchange=exchange)
        for window, docs, exchange in ((3, "pairs", "ring"), (3, "pairs-mixed", "ring"), (6, "pairs-mixed", "ring"),
                                       (15, "pairs", "ring"), (3, "pairs-mixed", "allgather"),
                                       (6, "pairs", "allgather"), (15, "pairs-mixed", "allgather"))
    ]
    return cases


CASES: dict[int, list[Case]] = {
    2: _ring_cases(2)
    + [
        Case("ring", 2, 1, 4, 2, causal=True, docs="padded", kernel="math"),
        Case("ring", 2, 1, 4, 1, causal=True, dtype="bfloat16"),
        Case("ring", 2, 1, 4, 1, causal=True, dtype="bfloat16", kv_exchange="allgather"),
        Case("ring", 2, 1, 4, 2, causal=True, docs="packed", dtype="float16"),
        Case("ulysses", 1, 2, 4, 4, causal=True),
        Case("ulysses", 1, 2, 4, 2, causal=False),
        Case("ulysses", 1, 2, 4, 1, causal=True, docs="packed"),
        Case("ulysses", 1, 2, 4, 2, causal=True, docs="pairs"),
        Case("ulysses", 1, 2, 4, 2, window=3, docs="pairs-mixed"),
        Case("ulysses", 1, 2, 3, 1, causal=True),  # heads padded to a multiple of 2
        Case("ulysses", 1, 2, 4, 2, causal=True, dtype="bfloat16"),
    ],
    3: _ring_cases(3),
    4: _ring_cases(4)
    + [
        Case("ring", 4, 1, 4, 2, causal=True, docs="padded", kernel="math"),
        Case("ulysses", 1, 4, 4, 4, causal=True),
        Case("ulysses", 1, 4, 8, 2, causal=False),
        Case("ulysses", 1, 4, 4, 1, causal=True),  # MQA: the one KV head is replicated
        Case("ulysses", 1, 4, 6, 2, causal=True),  # 6 heads do not split into 4: padded
        Case("ulysses", 1, 4, 4, 2, causal=False, docs="padded"),
        Case("hybrid", 2, 2, 4, 4, causal=True),
        Case("hybrid", 2, 2, 4, 2, causal=False),
        Case("hybrid", 2, 2, 4, 1, causal=True, docs="packed"),
        Case("hybrid", 2, 2, 4, 2, causal=False, docs="padded"),
        Case("hybrid", 2, 2, 4, 2, causal=True, docs="packed", kv_exchange="allgather"),
        Case("hybrid", 2, 2, 4, 2, causal=True, docs="pairs"),
        Case("build", 2, 2, 4, 2, causal=True, docs="packed"),
        Case("build", 2, 2, 4, 1, causal=True, docs="padded", kv_exchange="allgather"),
        Case("ulysses", 1, 4, 4, 2, window=5),
        Case("ulysses", 1, 4, 4, 2, window=5, docs="padded"),
        Case("hybrid", 2, 2, 4, 2, window=3),
        Case("hybrid", 2, 2, 4, 1, window=9, docs="packed"),
        Case("build", 2, 2, 4, 2, window=6, docs="padded"),
        Case("ulysses", 1, 4, 4, 2, window=6, docs="pairs"),
        Case("hybrid", 2, 2, 4, 2, window=3, docs="pairs-mixed"),
        Case("hybrid", 2, 2, 4, 1, window=9, docs="pairs"),
        Case("hybrid", 2, 2, 4, 2, window=5, docs="pairs-mixed", kv_exchange="allgather"),
        Case("build", 2, 2, 4, 2, window=6, docs="pairs-mixed"),
    ],
}

# (label, impl, ring, ulysses, docs, kv_exchange) of one forward+backward whose transfers are counted.
COUNTED: dict[int, list[tuple[str, str, int, int, str, str]]] = {
    2: [("ring2", "ring", 2, 1, "none", "ring"), ("ulysses2", "ulysses", 1, 2, "none", "ring")],
    4: [
        ("ring4", "ring", 4, 1, "none", "ring"),
        ("ring4-docs", "ring", 4, 1, "packed", "ring"),
        ("ring4-allgather", "ring", 4, 1, "none", "allgather"),
        ("ring4-allgather-docs", "ring", 4, 1, "packed", "allgather"),
        ("ring4-window3", "ring", 4, 1, "none", "window3"),
        ("ulysses4", "ulysses", 1, 4, "none", "ring"),
        ("ulysses4-docs", "ulysses", 1, 4, "packed", "ring"),
        ("hybrid2x2", "hybrid", 2, 2, "none", "ring"),
    ],
}


# ---------------------------------------------------------------- rank side


class Groups:
    """Every process group the cases of one world use, created in the same order on every rank."""

    def __init__(self, world: int) -> None:
        self.world = world
        self._by_layout: dict[tuple[int, int], tuple[Any, Any]] = {}
        rank = dist.get_rank()
        whole = dist.new_group(list(range(world)))
        self._by_layout[(world, 1)] = (whole, None)
        self._by_layout[(1, world)] = (None, whole)
        if world == 4:
            ring, uly = 2, 2
            mine: dict[str, Any] = {}
            for r in range(ring):
                ranks = [r * uly + u for u in range(uly)]
                group = dist.new_group(ranks)
                if rank in ranks:
                    mine["ulysses"] = group
            for u in range(uly):
                ranks = [r * uly + u for r in range(ring)]
                group = dist.new_group(ranks)
                if rank in ranks:
                    mine["ring"] = group
            self._by_layout[(ring, uly)] = (mine["ring"], mine["ulysses"])

    def __call__(self, ring: int, ulysses: int) -> tuple[Any, Any]:
        return self._by_layout[(ring, ulysses)]


def _attend(
    impl: str, groups: Groups, case_ring: int, case_ulysses: int, q: Tensor, k: Tensor, v: Tensor, **kw: Any
) -> Tensor:
    ring_group, ulysses_group = groups(case_ring, case_ulysses)
    kernel = kw.pop("kernel", "auto")
    exchange = kw.pop("kv_exchange", "ring")
    if impl == "ring":
        return ring_attention(q, k, v, group=ring_group, kernel=kernel, kv_exchange=exchange, **kw)
    if impl == "ulysses":
        return ulysses_attention(q, k, v, group=ulysses_group, kernel=kernel, **kw)
    if impl == "hybrid":
        return hybrid_attention(
            q, k, v, ring_group=ring_group, ulysses_group=ulysses_group, kernel=kernel, kv_exchange=exchange, **kw
        )
    fn = build_attention(CPLayout(case_ring, case_ulysses, exchange), kernel, ring_group=ring_group,
                         ulysses_group=ulysses_group)
    return fn(q, k, v, **kw)


def _inputs(case: Case) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(zlib.crc32(case.name.encode()))
    seq = case.seq_per_rank * case.ring * case.ulysses
    dtype = getattr(torch, case.dtype)

    def rand(*shape: int) -> Tensor:
        # Rounded to the case dtype first, so the reference sees exactly the inputs we do.
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype).double()

    return {
        "q": rand(BATCH, seq, case.heads, HEAD_DIM),
        "k": rand(BATCH, seq, case.kv_heads, HEAD_DIM),
        "v": rand(BATCH, seq, case.kv_heads, HEAD_DIM),
        "dout": rand(BATCH, seq, case.heads, HEAD_DIM),
        "doc": make_doc_ids(case.docs, BATCH, seq),
    }


def _run_case(case: Case, rank: int, groups: Groups) -> dict[str, Any]:
    dtype = getattr(torch, case.dtype)
    x = _inputs(case)
    full = {n: x[n].clone().requires_grad_() for n in ("q", "k", "v")}
    family = PAIR_FAMILY if case.docs in FAMILY_ROWS else 0
    positions = make_position_ids(x["doc"], family) if family else None
    ref_out = reference_attention(full["q"], full["k"], full["v"], causal=case.causal, doc_ids=x["doc"],
                                  window=case.window, family=family, positions=positions)
    ref_out.backward(x["dout"])

    def shard(t: Tensor) -> Tensor:
        return cp_shard(t, dim=1, ring=case.ring, ulysses=case.ulysses, cp_rank=rank)

    mine = {n: shard(x[n]).to(dtype).requires_grad_() for n in ("q", "k", "v")}
    doc: Any = None if x["doc"] is None else shard(x["doc"])
    if family:
        doc = Documents(doc, doc.numpy(), family)
    out = _attend(
        case.impl, groups, case.ring, case.ulysses, mine["q"], mine["k"], mine["v"],
        causal=case.causal, doc_ids=doc, kernel=case.kernel, kv_exchange=case.kv_exchange, window=case.window,
    )
    out.backward(shard(x["dout"]).to(dtype))

    def err(a: Tensor, b: Tensor) -> float:
        return (a.double() - b).abs().max().item()

    result: dict[str, Any] = {"out": err(out, shard(ref_out.detach()))}
    for n in ("q", "k", "v"):
        grad = mine[n].grad
        assert grad is not None
        result["d" + n] = err(grad, shard(full[n].grad))
    result["dtypes"] = [str(t.dtype) for t in (out, mine["q"].grad, mine["k"].grad, mine["v"].grad)]
    return result


def _count(impl: str, ring: int, ulysses: int, docs: str, exchange: str, rank: int, groups: Groups) -> dict[str, int]:
    case = Case(impl, ring, ulysses, 4, 2, docs=docs)
    x = _inputs(case)

    def shard(t: Tensor) -> Tensor:
        return cp_shard(t, dim=1, ring=ring, ulysses=ulysses, cp_rank=rank)

    q, k, v = (shard(x[n]).float().requires_grad_() for n in ("q", "k", "v"))
    doc = None if x["doc"] is None else shard(x["doc"])
    window = int(exchange.removeprefix("window")) if exchange.startswith("window") else None
    exchange = "ring" if window is not None else exchange
    with count_comm() as counts:
        out = _attend(impl, groups, ring, ulysses, q, k, v, doc_ids=doc, kv_exchange=exchange, window=window)
        out.backward(shard(x["dout"]).float())
    return dict(counts)


def _deepspeed_peer(rank: int, groups: Groups) -> dict[str, float]:
    """Our Ulysses against DeepSpeed's DistributedAttention around the same local attention."""
    import deepspeed
    from deepspeed.sequence.layer import DistributedAttention

    from ringtrain.train.trainer import skip_shm_comm_op

    skip_shm_comm_op()  # as every rank of a job does: no JIT build of an op the peer never calls
    deepspeed.init_distributed(dist_backend="gloo")
    world = groups.world
    _, group = groups(1, world)
    case = Case("ulysses", 1, world, 8, 4)
    x = _inputs(case)

    def shard(t: Tensor) -> Tensor:
        return t.chunk(world, dim=1)[rank].float()

    def local(q: Tensor, k: Tensor, v: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        return local_attention(q, k, v, causal=True)

    theirs_in = {n: shard(x[n]).requires_grad_() for n in ("q", "k", "v")}
    ours_in = {n: shard(x[n]).requires_grad_() for n in ("q", "k", "v")}
    theirs = DistributedAttention(local, group, scatter_idx=2, gather_idx=1)(
        theirs_in["q"], theirs_in["k"], theirs_in["v"], batch_dim_idx=0
    )
    theirs.backward(shard(x["dout"]))
    ours = ulysses_attention(ours_in["q"], ours_in["k"], ours_in["v"], group=group, causal=True)
    ours.backward(shard(x["dout"]))
    result = {"out": (ours - theirs).abs().max().item()}
    for n in ("q", "k", "v"):
        a, b = ours_in[n].grad, theirs_in[n].grad
        assert a is not None and b is not None
        result["d" + n] = (a - b).abs().max().item()
    return result


def _guarded(fn: Any, *args: Any) -> Any:
    try:
        return fn(*args)
    except Exception:
        return {"error": traceback.format_exc()}


def _rank_main(rank: int, world: int, store_path: str, out_dir: str) -> None:
    os.environ.update(DS_ACCELERATOR="cpu", RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world)
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60)
    )
    groups = Groups(world)
    report: dict[str, Any] = {"cases": {}, "counts": {}, "peer": None}
    for case in CASES[world]:
        report["cases"][case.name] = _guarded(_run_case, case, rank, groups)
    for label, impl, ring, uly, docs, exchange in COUNTED.get(world, []):
        report["counts"][label] = _guarded(_count, impl, ring, uly, docs, exchange, rank, groups)
    if world in (2, 4):
        report["peer"] = _guarded(_deepspeed_peer, rank, groups)
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(report))
    dist.barrier()
    dist.destroy_process_group()


# ---------------------------------------------------------------- pytest side


def _spawn(world: int, workdir: Path) -> list[dict[str, Any]]:
    """Run every case of ``world`` in one gloo group; each rank's report, bounded in time."""
    store = str(workdir / "store")
    procs = [rank_process(_rank_main, rank, world, store, str(workdir), daemon=True) for rank in range(world)]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + SPAWN_TIMEOUT_S
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
    alive = [p for p in procs if p.is_alive()]
    for proc in alive:
        proc.kill()
        proc.join()
    assert not alive, f"world {world}: {len(alive)} ranks still running after {SPAWN_TIMEOUT_S} s"
    codes = [p.exitcode for p in procs]
    assert codes == [0] * world, f"world {world}: rank exit codes {codes}"
    return [json.loads((workdir / f"rank{r}.json").read_text()) for r in range(world)]


@pytest.fixture(scope="module")
def reports(tmp_path_factory: pytest.TempPathFactory) -> Callable[[int], list[dict[str, Any]]]:
    """Each world's rank reports, spawned on first use and shared by the module's tests.

    A failed spawn is remembered too, so its tests fail at once instead of spawning again.
    """
    cache: dict[int, list[dict[str, Any]]] = {}
    failures: dict[int, str] = {}

    def get(world: int) -> list[dict[str, Any]]:
        if world in failures:
            pytest.fail(failures[world])
        if world not in cache:
            try:
                cache[world] = _spawn(world, tmp_path_factory.mktemp(f"attention-world{world}"))
            except AssertionError as error:
                failures[world] = str(error)
                raise
        return cache[world]

    return get


def _all_cases() -> Iterator[Any]:
    for world, cases in CASES.items():
        for case in cases:
            yield pytest.param(world, case, id=f"w{world}-{case.name}")


@pytest.mark.parametrize(("world", "case"), list(_all_cases()))
def test_matches_float64_reference(world: int, case: Case, reports: Callable[[int], list[dict[str, Any]]]) -> None:
    tolerance = TOLERANCE[case.dtype]
    for rank, report in enumerate(reports(world)):
        result = report["cases"][case.name]
        assert "error" not in result, f"rank {rank}:\n{result.get('error')}"
        assert result["dtypes"] == [f"torch.{case.dtype}"] * 4, f"rank {rank}: {result['dtypes']}"
        for quantity in ("out", "dq", "dk", "dv"):
            assert result[quantity] <= tolerance, f"rank {rank} {quantity}: max error {result[quantity]:.2e}"


# Per rank and forward+backward, counted per tensor sent. Ring of R: the forward passes K/V R-1
# times and the backward K/V R-1 times, each pass K and V as two messages of one group launch;
# the backward passes the stacked dK/dV R times (the last brings each accumulator home):
# 4 (R - 1) + R. All-gathered K/V: one all-gather of the stacked K/V and one reduce-scatter of
# their gradients, whatever R. Ulysses: one packed q/k/v all-to-all and one output all-to-all
# each way. Packed documents add one all-gather of the doc ids per forward, whatever the
# implementation (no ids travel with the K/V).
EXPECTED_COUNTS: dict[int, dict[str, Any]] = {
    2: {"ring2": {"isend": 6, "irecv": 6}, "ulysses2": {"all_to_all": 4}},
    4: {
        "ring4": {"isend": 16, "irecv": 16},
        "ring4-docs": {"isend": 16, "irecv": 16, "all_gather": 1},
        "ring4-allgather": {"all_gather": 1, "reduce_scatter": 1},
        "ring4-allgather-docs": {"all_gather": 2, "reduce_scatter": 1},
        # A 3-token window on 4-token chunks: a rank reads only its ring neighbours' K/V, sent
        # to them directly (forward K and V to each reader, backward dK/dV home to each source);
        # the ends of the ring have one neighbour each.
        "ring4-window3": [{"isend": 3, "irecv": 3}, {"isend": 6, "irecv": 6}, {"isend": 6, "irecv": 6},
                          {"isend": 3, "irecv": 3}],
        "ulysses4": {"all_to_all": 4},
        "ulysses4-docs": {"all_to_all": 4, "all_gather": 1},
        "hybrid2x2": {"all_to_all": 4, "isend": 6, "irecv": 6},
    },
}


@pytest.mark.parametrize("world", sorted(EXPECTED_COUNTS))
def test_transfer_counts_per_forward_backward(world: int, reports: Callable[[int], list[dict[str, Any]]]) -> None:
    for rank, report in enumerate(reports(world)):
        want = {label: counts[rank] if isinstance(counts, list) else counts
                for label, counts in EXPECTED_COUNTS[world].items()}
        assert report["counts"] == want, f"rank {rank}"


@pytest.mark.parametrize("world", [2, 4])
def test_ulysses_matches_deepspeed(world: int, reports: Callable[[int], list[dict[str, Any]]]) -> None:
    for rank, report in enumerate(reports(world)):
        peer = report["peer"]
        assert "error" not in peer, f"rank {rank}:\n{peer.get('error')}"
        for quantity, value in peer.items():
            assert value <= 1e-6, f"rank {rank} {quantity}: {value:.2e} from DeepSpeed's Ulysses"


# ---------------------------------------------------------------- single process


def test_merge_of_two_empty_partials_is_zero_not_nan() -> None:
    out = torch.randn(1, 3, 2, 4)
    lse = torch.tensor([[[-math.inf, 0.5, -math.inf], [-math.inf, -math.inf, 1.0]]])
    blk_lse = torch.tensor([[[-math.inf, -math.inf, 2.0], [-math.inf, 0.0, -math.inf]]])
    out = out.masked_fill((lse == -math.inf).transpose(1, 2)[..., None], 0.0)
    blk_out = torch.randn(1, 3, 2, 4).masked_fill((blk_lse == -math.inf).transpose(1, 2)[..., None], 0.0)
    merged, merged_lse = merge_partials(out, lse, blk_out, blk_lse)
    assert not merged.isnan().any() and not merged_lse.isnan().any()
    assert merged[0, 0].abs().max() == 0 and merged_lse[0, :, 0].eq(-math.inf).all()
    # A row empty on one side takes the other side unchanged.
    torch.testing.assert_close(merged[0, 1, 0], out[0, 1, 0])
    torch.testing.assert_close(merged[0, 2, 0], blk_out[0, 2, 0])


def test_merge_equals_attention_over_the_union() -> None:
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 6, 4, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    halves = [MATH.forward(q, k[:, s], v[:, s], causal=False, scale=8**-0.5) for s in (slice(0, 3), slice(3, 6))]
    merged, lse = merge_partials(halves[0].out_BQHD, halves[0].lse_BHQ, halves[1].out_BQHD, halves[1].lse_BHQ)
    whole = MATH.forward(q, k, v, causal=False, scale=8**-0.5)
    torch.testing.assert_close(merged.double(), whole.out_BQHD, atol=1e-6, rtol=0)
    torch.testing.assert_close(lse.double(), whole.lse_BHQ, atol=1e-6, rtol=0)


@pytest.mark.parametrize("kernel", [MATH, CpuFlashKernel()], ids=["math", "cpu_flash"])
def test_kernel_lse_is_true_and_empty_rows_are_zero(kernel: Any) -> None:
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(2, 5, 4, 8, generator=gen)
    k, v = torch.randn(2, 7, 2, 8, generator=gen), torch.randn(2, 7, 2, 8, generator=gen)
    visible = torch.rand(2, 5, 7, generator=gen) > 0.4
    visible[0, 1] = False  # a query row with no visible key
    res = kernel.forward(q, k, v, causal=False, scale=8**-0.5, visible_BQS=visible)
    scores = torch.einsum("bqhd,bshd->bhqs", q.double(), k.double().repeat_interleave(2, dim=2)) * 8**-0.5
    true_lse = scores.masked_fill(~visible[:, None], -math.inf).logsumexp(-1)
    torch.testing.assert_close(res.lse_BHQ.double(), true_lse, atol=1e-5, rtol=0)
    assert res.out_BQHD[0, 1].abs().max() == 0
    dout = torch.randn(res.out_BQHD.shape, generator=gen)
    grads = kernel.backward(
        dout, q, k, v, res.out_BQHD, res.lse_BHQ, res.aux, causal=False, scale=8**-0.5, visible_BQS=visible
    )
    assert all(not g.isnan().any() for g in grads)
    assert grads[0][0, 1].abs().max() == 0


def test_select_kernel_is_a_pure_choice() -> None:
    cpu = {"cpu_flash", "math"}
    cuda = {"flash_attn", "sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "math"}
    assert select_kernel("auto", device_type="cpu", dtype=torch.float32, available=cpu) == "cpu_flash"
    assert select_kernel("auto", device_type="cpu", dtype=torch.float32, available={"math"}) == "math"
    assert select_kernel("auto", device_type="cuda", dtype=torch.bfloat16, available=cuda) == "flash_attn"
    no_flash_attn = cuda - {"flash_attn"}
    assert select_kernel("auto", device_type="cuda", dtype=torch.bfloat16, available=no_flash_attn) == "sdpa_flash"
    # fp32 on CUDA: only the efficient kernel of the fused ones takes it.
    assert select_kernel("auto", device_type="cuda", dtype=torch.float32, available=cuda) == "sdpa_efficient"
    assert select_kernel("math", device_type="cuda", dtype=torch.float32, available=cuda) == "math"


@pytest.mark.parametrize(
    ("name", "device", "dtype", "available", "reason"),
    [
        ("sdpa", "cuda", torch.bfloat16, {"math"}, "no log-sum-exp"),
        ("sdpa_math", "cpu", torch.float32, {"math"}, "no log-sum-exp"),
        ("flash_attn", "cpu", torch.bfloat16, {"math"}, "runs on cuda, not cpu"),
        ("flash_attn", "cuda", torch.bfloat16, {"math"}, "not importable"),
        ("sdpa_flash", "cuda", torch.float32, {"sdpa_flash"}, "does not take float32"),
        ("cpu_flash", "cuda", torch.float32, {"math"}, "runs on cpu, not cuda"),
        ("nope", "cpu", torch.float32, {"math"}, "unknown"),
    ],
)
def test_select_kernel_refuses_with_the_reason(name: str, device: str, dtype: Any, available: set, reason: str) -> None:
    with pytest.raises(KernelUnavailableError, match=reason) as info:
        select_kernel(name, device_type=device, dtype=dtype, available=available)
    assert name in str(info.value) and isinstance(info.value, ValueError)


def test_unavailable_kernels_refused_at_call_and_build() -> None:
    with pytest.raises(KernelUnavailableError, match="sdpa_flash"):
        get_kernel("sdpa_flash", device_type="cpu", dtype=torch.float16)
    with pytest.raises(KernelUnavailableError, match="no log-sum-exp"):
        build_attention(CPLayout(1, 1), "sdpa", ring_group=None, ulysses_group=None)
    with pytest.raises(ConfigError, match="attention.impl: 'zigzag' is not one of"):  # unknown: named by the layout
        cp_layout("zigzag", 1, None)


def test_local_build_matches_reference_in_one_process() -> None:
    case = Case("build", 1, 1, 4, 2, docs="padded", causal=False)
    x = _inputs(case)
    fn = build_attention(CPLayout(1, 1), "auto", ring_group=None, ulysses_group=None)
    q, k, v = (x[n].float().requires_grad_() for n in ("q", "k", "v"))
    out = fn(q, k, v, causal=False, doc_ids=x["doc"])
    ref = reference_attention(x["q"], x["k"], x["v"], causal=False, doc_ids=x["doc"])
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=0)
    assert out[0, -3:].abs().max() == 0  # padding rows see nothing

