"""How a call's blocks run (train/attention/plan.py, call.py): whole, one masked call, pieces, or
not at all, and which K/V exchange a layout gets; and blocks cut by documents and windows, through
the emulated ring (ringtrain_dev/emulated_cp.py), equal to one call over the sequence, masked and in
pieces alike (the CPU kernels take masks, so short blocks run masked here; the fused GPU kernels
do not, and a kernel refusing masks stands in for them); and an all-gathered chunk's rows against
its prefix and itself as one call, one masked call or split, each equal to one call."""

from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np
import pytest
import torch

from ringtrain.train.attention.call import (
    ALLGATHER_BELOW_TOKENS,
    ALLGATHER_FROM_RANKS,
    PLAN_KEY,
    AttentionCall,
    choose_exchange,
)
from ringtrain.train.attention.documents import Documents
from ringtrain.train.attention.kernels import MATH, MathKernel, default_scale
from ringtrain.train.attention.plan import EMPTY, MASKED, MASKED_BELOW_SCORES, PIECES, WHOLE, exchange_for, plan
from ringtrain_dev.emulated_cp import emulated_ring

HEADS, KV_HEADS, HEAD_DIM = 4, 2, 8


class _NoMasks(MathKernel):
    """The math kernel refusing masks, as the fused GPU kernels do."""

    name = "no-masks"
    supports_mask = False


class _BottomRight(MathKernel):
    """The math kernel taking a causal block wider than tall (its mask aligns bottom-right) and
    no masks, as flash-attn does."""

    name = "bottom-right"
    supports_mask = False
    aligns_causal_bottom_right = True


def test_the_exchange_is_chosen_by_name_layout_and_window() -> None:
    assert choose_exchange("auto", 1, 64, None) == "local"
    assert choose_exchange("auto", ALLGATHER_FROM_RANKS, ALLGATHER_BELOW_TOKENS - 2, None) == "allgather"
    assert choose_exchange("auto", 8, 64, None) == "allgather"
    assert choose_exchange("auto", ALLGATHER_FROM_RANKS, ALLGATHER_BELOW_TOKENS, None) == "ring"
    # A ring of two passes K/V once, hidden behind its diagonal block: passed at any length.
    assert choose_exchange("auto", 2, 64, None) == "ring"
    assert choose_exchange("ring", 4, 64, None) == "ring"
    assert choose_exchange("allgather", 4, 1 << 20, None) == "allgather"
    # A window that reaches only the neighbouring ranks' K/V sends them there, whatever was asked.
    assert choose_exchange("ring", 8, 64, 16) == "neighbours"
    # One that reaches every rank's does not.
    assert choose_exchange("ring", 2, 64, 200) == "ring"
    with pytest.raises(ValueError, match="kv_exchange 'nccl'"):
        choose_exchange("nccl", 4, 64, None)


def _call(docs: Optional[torch.Tensor], *, seq: int, kernel: MathKernel = MATH, window: Optional[int] = None,
          causal: bool = True) -> AttentionCall:
    return AttentionCall.of(None, seq, causal=causal, docs=Documents.of(docs), window=window, scale=0.5,
                            kernel=kernel, kv_exchange="auto")


def _hows(call: AttentionCall) -> list[str]:
    return [blk.how for visit in plan(call, exchange_for(call), 1, torch.device("cpu")) for blk in visit.blocks]


def test_a_short_cut_block_runs_as_one_masked_call_on_a_kernel_that_takes_masks() -> None:
    docs = torch.tensor([[0] * 10 + [1] * 22])
    assert _hows(_call(None, seq=32)) == [WHOLE]
    assert _hows(_call(docs, seq=32)) == [MASKED]
    assert _hows(_call(None, seq=32, window=8)) == [MASKED]
    assert _hows(_call(docs, seq=32, kernel=_NoMasks())) == [PIECES]


def test_a_long_cut_block_runs_in_pieces_and_makes_no_mask() -> None:
    seq = 2 * int(np.sqrt(MASKED_BELOW_SCORES))
    docs = torch.tensor([[0] * (seq // 3) + [1] * (seq - seq // 3)])
    (visit,) = plan(_call(docs, seq=seq), exchange_for(_call(docs, seq=seq)), 1, torch.device("cpu"))
    (blk,) = visit.blocks
    assert blk.how == PIECES and blk.mask is None and blk.pieces is not None and len(blk.pieces) == 2


def test_a_block_where_nothing_is_visible_runs_no_call() -> None:
    padding = torch.full((1, 16), -1)
    assert _hows(_call(padding, seq=16)) == [EMPTY]
    assert _hows(_call(padding, seq=16, kernel=_NoMasks())) == [EMPTY]


def test_the_plan_is_made_once_a_forward() -> None:
    docs = Documents.of(torch.tensor([[0] * 10 + [1] * 22]))
    call = AttentionCall.of(None, 32, causal=True, docs=docs, window=None, scale=0.5, kernel=MATH, kv_exchange="auto")
    first = plan(call, exchange_for(call), 1, torch.device("cpu"))
    assert plan(call, exchange_for(call), 1, torch.device("cpu")) is first


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, docs: Optional[torch.Tensor],
               window: Optional[int]) -> list[torch.Tensor]:
    seq = q.shape[1]
    visible = torch.ones(1, seq, seq, dtype=torch.bool)
    if docs is not None:
        visible &= (docs[:, :, None] == docs[:, None, :]) & (docs >= 0)[:, :, None]
    if window is not None:
        gap = torch.arange(seq)[:, None] - torch.arange(seq)[None, :]
        visible &= (gap < window)[None]
    scale = default_scale(HEAD_DIM)
    fwd = MATH.forward(q, k, v, causal=True, scale=scale, visible_BQS=visible)
    grads = MATH.backward(dout, q, k, v, fwd.out_BQHD, fwd.lse_BHQ, None, causal=True, scale=scale,
                          visible_BQS=visible)
    return [fwd.out_BQHD, *grads]


@pytest.mark.parametrize("kernel", [MATH, _NoMasks()], ids=["masked", "pieces"])
@pytest.mark.parametrize("cut", ["documents", "window", "documents-and-window"])
@pytest.mark.parametrize("kv_exchange", ["ring", "allgather"])
def test_cut_blocks_through_the_emulated_ring_equal_one_call(kernel: MathKernel, cut: str, kv_exchange: str) -> None:
    world, seq = 4, 64
    gen = torch.Generator().manual_seed(3)
    q, k, v, dout = (torch.randn(1, seq, heads, HEAD_DIM, generator=gen, dtype=torch.float64)
                     for heads in (HEADS, KV_HEADS, KV_HEADS, HEADS))
    # Documents across shard boundaries, and padding at the end (rows that see nothing).
    docs = torch.tensor([[0] * 13 + [1] * 27 + [2] * 18 + [-1] * 6]) if "documents" in cut else None
    window = 11 if "window" in cut else None
    ring = emulated_ring(q, k, v, dout, world=world, kernel=kernel, causal=True, scale=default_scale(HEAD_DIM),
                         doc_ids_BS=docs, kv_exchange=kv_exchange, window=window, timeout_s=20.0)
    got = (ring.out_BSHD, ring.dq_BSHD, ring.dk_BSKD, ring.dv_BSKD)
    for name, g, want in zip(("out", "dq", "dk", "dv"), got, _reference(q, k, v, dout, docs, window)):
        torch.testing.assert_close(g, want, atol=1e-10, rtol=0, msg=name)


@pytest.mark.parametrize("kernel", ["math", "cpu_flash"], ids=["sequence-major", "head-major"])
@pytest.mark.parametrize(("ring", "ulysses", "heads", "kv_heads"), [
    pytest.param(1, 4, 4, 2, id="ulysses-1-4-4-2"),  # each KV head sent to two ranks
    pytest.param(1, 4, 6, 2, id="ulysses-1-4-6-2"),  # 6 query heads padded to 8
    pytest.param(2, 2, 4, 1, id="hybrid-2-2-4-1"),  # MQA
])
def test_ulysses_gathers_into_either_kernel_layout(kernel: str, ring: int, ulysses: int, heads: int,
                                                  kv_heads: int) -> None:
    from ringtrain_dev.emulated_cp import emulated_attention

    seq = 16 * ring * ulysses
    gen = torch.Generator().manual_seed(5)
    q, k, v, dout = (torch.randn(1, seq, n, HEAD_DIM, generator=gen, dtype=torch.float64)
                     for n in (heads, kv_heads, kv_heads, heads))
    docs = torch.tensor([[0] * (seq // 3) + [1] * (seq - seq // 3)])
    out, grads = emulated_attention(q, k, v, dout, ring=ring, ulysses=ulysses, kernel=kernel, doc_ids_BS=docs,
                                    timeout_s=20.0)
    assert grads is not None
    for name, got, want in zip(("out", "dq", "dk", "dv"), (out, *grads), _reference(q, k, v, dout, docs, None)):
        assert got.shape == want.shape, name
        torch.testing.assert_close(got, want, atol=1e-10, rtol=0, msg=name)


def _allgather_blocks(kernel: MathKernel, *, rank: int, world: int,
                      seq: int) -> list[tuple[str, tuple[int, int], bool]]:
    """(how, columns, causal) of each block rank ``rank`` of an all-gathered ring runs."""
    call = AttentionCall(None, rank, world, seq, True, None, None, 0.5, kernel, "allgather")
    (visit,) = plan(call, exchange_for(call), 1, torch.device("cpu"))
    return [(blk.how, blk.cols, blk.causal) for blk in visit.blocks]


def test_a_chunks_rows_against_its_prefix_and_itself_run_as_one_call_where_the_kernel_takes_it() -> None:
    # Rank 1 of 4 holds chunks 1 and 6 (of 8 tokens each): keys [0, 16) and [0, 56).
    assert _allgather_blocks(_BottomRight(), rank=1, world=4, seq=16) == [
        (WHOLE, (0, 16), True), (WHOLE, (0, 56), True)]
    assert _allgather_blocks(MATH, rank=1, world=4, seq=16) == [(MASKED, (0, 16), False), (MASKED, (0, 56), False)]
    # A kernel that takes neither: the square diagonal first, then the prefix.
    assert _allgather_blocks(_NoMasks(), rank=1, world=4, seq=16) == [
        (WHOLE, (8, 16), True), (WHOLE, (0, 8), False), (WHOLE, (48, 56), True), (WHOLE, (0, 48), False)]
    # Rank 0's first chunk is the sequence's first: a square, one call on any kernel.
    assert _allgather_blocks(_NoMasks(), rank=0, world=4, seq=16)[0] == (WHOLE, (0, 8), True)
    # A long block makes no mask: split.
    long = 2 * int(np.sqrt(MASKED_BELOW_SCORES))
    assert [how for how, _, _ in _allgather_blocks(MATH, rank=1, world=4, seq=long)] == [WHOLE] * 4


@pytest.mark.parametrize("kernel", [_BottomRight(), MATH, _NoMasks()], ids=["one-call", "masked", "split"])
def test_all_gathered_blocks_equal_one_call_however_they_run(kernel: MathKernel) -> None:
    world, seq = 4, 64
    gen = torch.Generator().manual_seed(7)
    q, k, v, dout = (torch.randn(1, seq, heads, HEAD_DIM, generator=gen, dtype=torch.float64)
                     for heads in (HEADS, KV_HEADS, KV_HEADS, HEADS))
    ring = emulated_ring(q, k, v, dout, world=world, kernel=kernel, causal=True, scale=default_scale(HEAD_DIM),
                         kv_exchange="allgather", timeout_s=20.0)
    got = (ring.out_BSHD, ring.dq_BSHD, ring.dk_BSKD, ring.dv_BSKD)
    for name, g, want in zip(("out", "dq", "dk", "dv"), got, _reference(q, k, v, dout, None, None)):
        torch.testing.assert_close(g, want, atol=1e-10, rtol=0, msg=name)


class _SilentRing:
    """A ring of two that is never asked to send (a plan reads only the call's rank and world)."""

    def rank(self) -> int:
        return 0

    def size(self) -> int:
        return 2


# A call that differs from _KEYED's in one field the plan is kept under, for every such field; the
# kernel twice, once for each of its traits the plan reads.
_KEYED = dict(transport=None, rank=0, world=2, seq_local=16, causal=True, docs=None, window=None, scale=0.5,
              kernel=_NoMasks(), exchange="ring")
_DIFFERING = [("rank", 1), ("world", 4), ("seq_local", 32), ("causal", False), ("window", 3), ("scale", 0.25),
              ("kernel", MATH), ("kernel", _BottomRight()), ("exchange", "allgather")]


def test_every_field_of_a_call_keys_its_plan_unless_it_says_why_not() -> None:
    """A field added to the call is in the plan's key by its value until it names what of it the
    plan reads: a plan kept for one call is never handed to a call it was not made for."""
    unkeyed = {f.name for f in dataclasses.fields(AttentionCall) if f.metadata.get(PLAN_KEY) == ()}
    assert unkeyed == {"transport", "docs"}  # the rank and the world are the transport's; documents keep their plans
    assert {name for name, _ in _DIFFERING} == {f.name for f in dataclasses.fields(AttentionCall)} - unkeyed
    base = AttentionCall(**_KEYED)
    made = plan(base, exchange_for(base), 1, torch.device("cpu"))
    for name, value in _DIFFERING:
        other = AttentionCall(**{**_KEYED, name: value})
        assert plan(other, exchange_for(other), 1, torch.device("cpu")) is not made, name
    same = AttentionCall(**{**_KEYED, "kernel": _NoMasks(), "transport": _SilentRing()})
    assert plan(same, exchange_for(same), 1, torch.device("cpu")) is made
