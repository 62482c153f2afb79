"""Sliding windows in the attention plugin (train/attention/window.py, blocks.py): the tiles a
window leaves cover exactly its band, a windowed layer costs a fraction of a full causal one, a
rank reads only its neighbours' K/V, and local attention under a window equals the float64
reference. The context-parallel implementations' exactness is tests/dist/test_attention.py's
("-w" cases); the windowed transfers are counted there too.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import numpy as np
import pytest
import torch

from ringtrain.train.attention import cp_shard, local_attention
from ringtrain.train.attention.documents import Documents, position_lags
from ringtrain.train.attention.kernels import MathKernel
from ringtrain.train.attention.window import (
    CAUSAL,
    FULL,
    MASKED,
    UPPER,
    band_mask,
    family_sources,
    needed_sources,
    needs,
    shard_positions,
    window_tiles,
)


def _covered(q_pos: np.ndarray, k_pos: np.ndarray, window: int) -> np.ndarray:
    """Which (query, key) pairs the tiles compute as visible."""
    seen = np.zeros((q_pos.size, k_pos.size), dtype=np.int64)
    for t in window_tiles(q_pos, k_pos, window):
        if t.kind == FULL:
            seen[t.rows, t.cols] += 1
        elif t.kind == CAUSAL:
            seen[t.rows, t.cols] += np.tril(np.ones((t.rows.stop - t.rows.start, t.cols.stop - t.cols.start), dtype=np.int64))
        elif t.kind == UPPER:
            seen[t.rows, t.cols] += np.triu(np.ones((t.rows.stop - t.rows.start, t.cols.stop - t.cols.start), dtype=np.int64), 1)
        else:
            assert t.kind == MASKED
            seen[t.rows, t.cols] += band_mask(q_pos[t.rows], k_pos[t.cols], window)
    return seen


@pytest.mark.parametrize("window", [1, 63, 64, 65, 100, 128, 300, 5000])
@pytest.mark.parametrize("layout", ["whole", "zigzag-rank1-of-4", "chunks-apart"])
def test_the_tiles_cover_the_band_once_and_nothing_else(window: int, layout: str) -> None:
    if layout == "whole":
        q_pos = k_pos = np.arange(1000)
    elif layout == "zigzag-rank1-of-4":
        q_pos, k_pos = shard_positions(4, 1, 512), shard_positions(4, 2, 512)
    else:
        q_pos, k_pos = np.arange(700, 900), np.arange(500, 760)
    want = band_mask(q_pos, k_pos, window).astype(np.int64)
    assert np.array_equal(_covered(q_pos, k_pos, window), want)


def _computed_pairs(q_pos: np.ndarray, k_pos: np.ndarray, window: Optional[int]) -> float:
    """Score entries the kernels compute: a causal square counts half, a masked tile whole."""
    if window is None:
        return q_pos.size * k_pos.size / 2
    total = 0.0
    for t in window_tiles(q_pos, k_pos, window):
        area = (t.rows.stop - t.rows.start) * (t.cols.stop - t.cols.start)
        total += area / 2 if t.kind in (CAUSAL, UPPER) else area
    return total


@pytest.mark.parametrize("cp", [1, 4])
def test_a_1k_window_at_32k_tokens_costs_under_a_tenth_of_full_causal(cp: int) -> None:
    seq, window = 32768, 1024
    if cp == 1:
        full, windowed = _computed_pairs(np.arange(seq), np.arange(seq), None), _computed_pairs(
            np.arange(seq), np.arange(seq), window)
    else:
        local = seq // cp
        positions = [shard_positions(cp, r, local) for r in range(cp)]
        # Each rank's queries against every rank's keys: the ring's blocks, summed over the ring.
        full = seq * seq / 2 / cp  # what one rank computes under full causal (zigzag balances it)
        windowed = max(sum(_computed_pairs(positions[r], positions[j], window) for j in range(cp)) for r in range(cp))
    assert windowed / full <= 0.1, windowed / full


def test_a_window_no_longer_than_a_chunk_reads_only_the_ring_neighbours() -> None:
    assert needed_sources(4, 8, 3) == [[0, 1], [0, 1, 2], [1, 2, 3], [2, 3]]
    assert needed_sources(4, 8, 4) == [[0, 1], [0, 1, 2], [1, 2, 3], [2, 3]]
    # Longer than a chunk: the second-nearest chunks too.
    assert needed_sources(4, 8, 6)[1] == [0, 1, 2, 3]


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int,
               doc: Optional[torch.Tensor] = None) -> torch.Tensor:
    S = q.shape[1]
    groups = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(groups, dim=2), v.repeat_interleave(groups, dim=2)
    scores = torch.einsum("bqhd,bshd->bhqs", q, k) / math.sqrt(q.shape[-1])
    allowed = torch.ones(S, S, dtype=torch.bool).tril().triu(1 - window).expand(q.shape[0], S, S).clone()
    if doc is not None:
        allowed &= (doc[:, :, None] == doc[:, None, :]) & (doc >= 0)[:, :, None]
    probs = torch.softmax(scores.masked_fill(~allowed[:, None], -1e300), dim=-1) * allowed[:, None]
    return torch.einsum("bhqs,bshd->bqhd", probs, v)


@pytest.mark.parametrize("window", [1, 50, 64, 90, 200, 400])
@pytest.mark.parametrize("docs", [False, True], ids=["unpacked", "packed"])
def test_windowed_local_attention_equals_the_float64_reference(window: int, docs: bool) -> None:
    gen = torch.Generator().manual_seed(window)
    q, k, v, dout = (torch.randn(2, 300, 4 if i in (0, 3) else 2, 8, generator=gen, dtype=torch.float64)
                     for i in range(4))
    doc = None
    if docs:
        doc = torch.zeros(2, 300, dtype=torch.long)
        doc[:, 120:] = 1
        doc[0, 250:] = 2
        doc[1, -4:] = -1
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = local_attention(*leaves, causal=True, window=window, doc_ids=doc, kernel="math")
    out.backward(dout)
    ref_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = _reference(*ref_leaves, window, doc)
    ref.backward(dout)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    for got, want in zip(leaves, ref_leaves):
        torch.testing.assert_close(got.grad, want.grad, rtol=0, atol=1e-12)


class _Spy(MathKernel):
    name = "spy"
    supports_mask = False

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[int, int, int, bool]] = []

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw: Any) -> Any:
        self.calls.append((q.shape[0], q.shape[1], k.shape[1], kw["causal"]))
        return super().forward(q, k, v, **kw)


def test_a_window_on_the_grid_runs_only_causal_squares_on_the_layers_kernel() -> None:
    """A 128-token window over 512 tokens: each row of tiles is its causal diagonal and the
    upper triangle before it, run reversed as a causal square: the layer's own maskless kernel
    runs everything, each kind of tile in one batched call, and no mask is made."""
    spy = _Spy()
    q = k = v = torch.randn(1, 512, 2, 8)
    local_attention(q, k, v, causal=True, window=128, kernel=spy)
    assert sorted(spy.calls) == [(3, 127, 127, True), (4, 128, 128, True)]


# Two rows of 64 tokens, each (document, length) in order, the rest padding: preference pairs as
# families of three (a prompt, then two completions continuing its positions) among plain
# documents (a family's first alone). Prompts of 4 to 9 tokens; row 1's second completion starts
# 14 tokens after its prompt ends, on a ring of four on a rank two chunks away.
FAMILY = 3
FAMILY_ROWS = (((0, 5), (3, 6), (4, 9), (5, 12), (6, 10), (9, 8), (10, 3), (11, 5)),
               ((0, 4), (1, 14), (2, 7), (3, 20), (6, 9), (7, 4), (8, 4)))


def _family_layout(seq: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """``FAMILY_ROWS``' document ids and position ids, each family's from its prompt's 0 on."""
    doc = torch.full((len(FAMILY_ROWS), seq), -1, dtype=torch.long)
    pos = torch.zeros((len(FAMILY_ROWS), seq), dtype=torch.long)
    for b, parts in enumerate(FAMILY_ROWS):
        at, prompt = 0, 0
        for d, n in parts:
            prompt = n if d % FAMILY == 0 else prompt
            doc[b, at : at + n] = d
            pos[b, at : at + n] = torch.arange(n) + (0 if d % FAMILY == 0 else prompt)
            at += n
    return doc, pos


def _family_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int, doc: torch.Tensor,
                      pos: torch.Tensor) -> torch.Tensor:
    """float64 attention where a query sees its own document's keys and its family's first's,
    those at position ids p - window < p' <= p (``pos``): a dense mask built apart from the code."""
    S = q.shape[1]
    groups = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(groups, dim=2), v.repeat_interleave(groups, dim=2)
    scores = torch.einsum("bqhd,bshd->bhqs", q, k) / math.sqrt(q.shape[-1])
    first = torch.where(doc % FAMILY != 0, doc - doc % FAMILY, -2)
    seen = (doc[:, :, None] == doc[:, None, :]) | (first[:, :, None] == doc[:, None, :])
    gap = pos[:, :, None] - pos[:, None, :]
    allowed = seen & (doc >= 0)[:, :, None] & torch.ones(S, S, dtype=torch.bool).tril() & (gap < window)
    probs = torch.softmax(scores.masked_fill(~allowed[:, None], -1e300), dim=-1) * allowed[:, None]
    return torch.einsum("bhqs,bshd->bqhd", probs, v)


@pytest.mark.parametrize("window", [3, 8, 17])
@pytest.mark.parametrize(("ring", "ulysses", "kv_exchange"),
                         [(1, 1, "ring"), (2, 1, "ring"), (2, 1, "allgather"), (4, 1, "ring"), (4, 1, "allgather"),
                          (1, 4, "ring"), (2, 2, "ring")],
                         ids=["cp1", "ring2", "ring2-allgather", "ring4", "ring4-allgather", "ulysses4", "hybrid2x2"])
def test_a_familys_children_see_its_first_document_within_the_window_by_position_id(
        window: int, ring: int, ulysses: int, kv_exchange: str) -> None:
    """Pairs under a window, on a kernel that takes no masks (as the GPU's fused ones): every
    piece unmasked or a tile's mask, a completion's queries seeing the prompt's keys within the
    window by position id (the other completion's tokens between them not counted), alone and
    under every layout; forward and gradients equal the float64 dense reference. A window
    shorter than every prompt, between their lengths, longer than every one."""
    from ringtrain_dev.emulated_cp import emulated_attention

    doc, pos = _family_layout()
    gen = torch.Generator().manual_seed(window)
    q, k, v, dout = (torch.randn(2, 64, 4 if i in (0, 3) else 2, 8, generator=gen, dtype=torch.float64)
                     for i in range(4))
    ref_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    want = _family_reference(*ref_leaves, window, doc, pos)
    want.backward(dout)
    spy = _Spy()
    if ring * ulysses == 1:
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = local_attention(*leaves, causal=True, window=window, doc_ids=Documents(doc, doc.numpy(), FAMILY),
                              kernel=spy)
        out.backward(dout)
        grads = tuple(t.grad for t in leaves)
    else:
        shards = [Documents(d, d.numpy(), FAMILY)
                  for d in (cp_shard(doc, dim=1, ring=ring, ulysses=ulysses, cp_rank=r) for r in range(ring * ulysses))]
        out, got = emulated_attention(q, k, v, dout, ring=ring, ulysses=ulysses, kernel=spy, kv_exchange=kv_exchange,
                                      documents=list(shards), window=window)
        assert got is not None
        grads = got
    assert spy.calls  # the pieces ran on the layer's own kernel
    torch.testing.assert_close(out, want, rtol=0, atol=1e-12)
    for got_grad, ref in zip(grads, ref_leaves):
        torch.testing.assert_close(got_grad, ref.grad, rtol=0, atol=1e-12)


def test_a_familys_lags_are_its_layouts_position_ids_less_the_sequences() -> None:
    """The lags the window measures by are what the trainer's pair layout gives: within a family,
    sequence position less lag less position id is one number (the family's start)."""
    from ringtrain.train.pairs import PAIR_FAMILY, pair_row

    rng = np.random.default_rng(0)

    def part(n: int) -> np.ndarray:
        return rng.integers(3, 50, n)

    parts = [(part(p), part(c), np.ones(c), part(r), np.ones(r)) for p, c, r in ((5, 3, 7), (2, 9, 1), (11, 4, 4))]
    row = pair_row(parts, seq_len=70, pad_id=0, shared=True)
    lags = position_lags(row.doc_ids[None], PAIR_FAMILY)[0]
    start = np.arange(row.doc_ids.size) - lags - row.positions
    for family in range(len(parts)):
        assert len(set(start[row.doc_ids // PAIR_FAMILY == family].tolist())) == 1
    assert lags.max() > 0  # each rejected completion lags its chosen one's length
    assert np.array_equal(lags[row.doc_ids < 0], np.zeros((row.doc_ids < 0).sum()))
    # Padding first, a plain document, then a pair: only the rejected completion lags (the chosen's 1).
    assert position_lags(np.array([[-1, -1, 0, 0, 3, 3, 4, 5, 5]]), FAMILY).tolist() == [[0, 0, 0, 0, 0, 0, 0, 1, 1]]


def test_a_ring_reads_its_neighbours_and_the_ranks_of_the_prompts_its_completions_see() -> None:
    """A 3-token window on a ring of four (chunks of 8): families that keep within the window's
    neighbours read only them; a completion two chunks from its prompt adds the prompt's rank."""
    doc, _ = _family_layout()
    neighbours = needs(4, 16, 3)
    near = doc[:1].numpy()  # row 0: every completion within a chunk of its prompt's end
    assert family_sources(4, 16, 3, near, FAMILY) == neighbours
    # Row 1: the prompt is chunk 0 (rank 0); the second completion starts at 18 (chunk 2, rank 2),
    # whose first query sees the prompt's last keys by position id.
    far = doc[1:].numpy()
    assert neighbours[2] == (1, 2, 3)
    assert family_sources(4, 16, 3, far, FAMILY) == (
        neighbours[0], neighbours[1], (0, 1, 2, 3), neighbours[3])

