"""Packed documents without dense masks: how a block is cut (train/attention/documents.py), and
that attention over packed documents never makes a [Q, S] mask or hands a kernel one.

The exactness of packed attention against the float64 reference, in every implementation, is
tests/dist/test_attention.py's (its "packed" and "padded" cases).
"""

from __future__ import annotations

import math
from typing import Any, Optional

import numpy as np
import pytest
import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from ringtrain.train.attention import cp_shard, local_attention
from ringtrain.train.attention.documents import Documents, Segment, runs, segments
from ringtrain.train.attention.kernels import CpuFlashKernel, MathKernel
from ringtrain.train.attention.zigzag import zigzag_shard


def test_runs_are_the_stretches_of_equal_ids() -> None:
    assert runs(np.array([-1, 0, 0, 1, 1, 1, 2])) == [(-1, 0, 1), (0, 1, 3), (1, 3, 6), (2, 6, 7)]
    assert runs(np.array([], dtype=np.int64)) == []


def test_a_block_is_cut_into_one_rectangle_per_document_padding_left_out() -> None:
    q = np.array([[0, 0, 1, 1, 1, -1]])  # rows: two documents and a padding token
    k = np.array([[1, 1, 2, 2]])  # columns: document 1's tail and document 2
    assert segments(q, k) == [Segment(0, slice(2, 5), slice(0, 2))]  # document 0 sees nothing here


def test_a_document_in_several_runs_pairs_every_run() -> None:
    assert segments(np.array([[3, 3]]), np.array([[3, 4, 3]])) == [
        Segment(0, slice(0, 2), slice(0, 1)), Segment(0, slice(0, 2), slice(2, 3))
    ]


def test_a_zigzag_shard_keeps_a_document_spanning_both_chunks_one_run() -> None:
    """Rank 1 of a ring of 2 holds chunks 1 and 2 of 4: a document over the middle of the
    sequence is the end of its first chunk and the start of its second, adjacent locally."""
    ids = torch.tensor([[0] * 6 + [1] * 4 + [2] * 6])  # 16 tokens, chunks of 4
    shard = zigzag_shard(ids, dim=1, world=2, rank=1).numpy()
    assert [doc for doc, _, _ in runs(shard[0])] == [0, 1, 2]


class _NoMasks(MathKernel):
    """The math kernel refusing masks (as the fused kernels do), counting its calls."""

    name = "no-masks"
    supports_mask = False

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[int, int]] = []

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw: Any) -> Any:
        self.calls.append((q.shape[1], k.shape[1]))
        return super().forward(q, k, v, **kw)


def _packed(seq: int, bounds: list[int], dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seq)
    q, k, v, dout = (torch.randn(1, seq, 2, 8, generator=gen, dtype=dtype) for _ in range(4))
    doc = torch.zeros(1, seq, dtype=torch.long)
    for i, start in enumerate(bounds):
        doc[0, start:] = i + 1
    return q, k, v, dout, doc


def test_packed_local_attention_runs_one_unmasked_call_per_document() -> None:
    q, k, v, dout, doc = _packed(64, [10, 40])
    kernel = _NoMasks()
    leaves = [t.requires_grad_() for t in (q, k, v)]
    out = local_attention(*leaves, causal=True, doc_ids=doc, kernel=kernel)
    out.backward(dout)
    assert kernel.calls == [(10, 10), (30, 30), (24, 24)]
    # ... and it is attention within each document: each document alone gives the same rows.
    for start, stop in ((0, 10), (10, 40), (40, 64)):
        alone = local_attention(q[:, start:stop], k[:, start:stop], v[:, start:stop], causal=True, kernel="math")
        torch.testing.assert_close(out[:, start:stop], alone, rtol=1e-12, atol=1e-12)


class _LargestTensor(TorchDispatchMode):
    """The most elements any op's result had."""

    def __init__(self) -> None:
        super().__init__()
        self.most = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.most = max(self.most, t.numel())
        return out


@pytest.mark.parametrize(("bounds", "window", "family"),
                         [([100], None, 0), ([300, 700, 900], None, 0), ([300, 500, 700, 760, 900], 100, 3)],
                         ids=["2-docs", "4-docs", "pairs-under-a-window"])
def test_no_tensor_of_a_dense_mask_is_made(bounds: list[int], window: Optional[int], family: int) -> None:
    """On the fused CPU kernel (its score tiles live inside the op), packed attention forward
    and backward makes nothing near a [Q, S] mask's size: the largest result is an
    activation's, B S H D, far below S^2. Pairs too (families of three, a prompt and two
    completions), under a window."""
    S = 1024
    q, k, v, dout, doc = _packed(S, bounds, dtype=torch.float32)
    leaves = [t.requires_grad_() for t in (q, k, v)]
    largest = _LargestTensor()
    with largest:
        out = local_attention(*leaves, causal=True, doc_ids=Documents(doc, doc.numpy(), family), window=window,
                              kernel=CpuFlashKernel())
        out.backward(dout)
    assert largest.most <= q.numel() < S * S // 8


def test_documents_are_gathered_once_per_forward_and_group() -> None:
    calls: list[Optional[str]] = []

    class Group:
        """The part of a ``Transport`` documents use: rank, size and an all-gather (rank 1's ids are
        rank 0's plus 2)."""

        def size(self) -> int:
            return 2

        def rank(self) -> int:
            return 0

        def all_gather(self, x: torch.Tensor) -> torch.Tensor:
            calls.append("gather")
            return torch.stack([x, x + 2])

    docs = Documents.of(torch.tensor([[0, 0, 1, 1]]))
    assert docs is not None
    group = Group()
    whole = docs.whole_sequence(group)  # type: ignore[arg-type]
    again = docs.whole_sequence(group)  # type: ignore[arg-type]
    shards = docs.shards(group)  # type: ignore[arg-type]
    assert calls == ["gather"] and whole is again
    # A ring of 2: rank 0 holds chunks 0 and 3 (ids 0 0 | 1 1), rank 1 chunks 1 and 2 (2 2 | 3 3).
    assert whole.host_BS.tolist() == [[0, 0, 2, 2, 3, 3, 1, 1]]
    assert [s.host_BS.tolist() for s in shards] == [[[0, 0, 1, 1]], [[2, 2, 3, 3]]]


def _family_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc: torch.Tensor) -> torch.Tensor:
    """float64 causal attention where a query sees its own document's keys and, for the later
    documents of a family of three, the first one's: a dense mask built apart from the code."""
    S = q.shape[1]
    same = doc[0][:, None] == doc[0][None, :]
    first = torch.where(doc[0] % 3 != 0, doc[0] - doc[0] % 3, -2)
    allowed = (same | (first[:, None] == doc[0][None, :])) & torch.ones(S, S, dtype=torch.bool).tril()
    allowed &= (doc[0] >= 0)[:, None]  # padding sees nothing: its rows are 0
    scores = torch.einsum("bqhd,bshd->bhqs", q, k) / math.sqrt(q.shape[-1])
    probs = torch.softmax(scores.masked_fill(~allowed, -1e300), dim=-1) * allowed
    return torch.einsum("bhqs,bshd->bqhd", probs, v)


def test_a_familys_children_see_its_first_document_by_unmasked_pieces() -> None:
    """Preference pairs as families of three (a prompt, then two completions continuing it): on a
    kernel that takes no masks, each child's rows against the prompt run as one unmasked,
    non-causal call, and each document's own square as a causal one; the result is the dense
    reference's, alone (cp1) and on an emulated ring of two."""
    from ringtrain_dev.emulated_cp import emulated_attention

    q, k, v, dout, _ = _packed(64, [], dtype=torch.float64)
    doc = torch.tensor([[0] * 14 + [1] * 10 + [2] * 12 + [3] * 9 + [4] * 7 + [5] * 8 + [-1] * 4])
    kernel = _NoMasks()
    docs = Documents(doc, doc.numpy(), family=3)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = local_attention(*leaves, causal=True, doc_ids=docs, kernel=kernel)
    out.backward(dout)
    assert (10, 14) in kernel.calls and (12, 14) in kernel.calls  # each completion against its prompt
    want_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    want = _family_reference(*want_leaves, doc)
    want.backward(dout)
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)
    for got, ref in zip(leaves, want_leaves):
        torch.testing.assert_close(got.grad, ref.grad, rtol=1e-10, atol=1e-10)
    shards = [Documents(d, d.numpy(), family=3) for d in
              (cp_shard(doc, dim=1, ring=2, ulysses=1, cp_rank=r) for r in range(2))]
    ring_out, ring_grads = emulated_attention(q, k, v, dout, ring=2, ulysses=1, kernel=_NoMasks(), documents=shards)
    torch.testing.assert_close(ring_out, want, rtol=1e-10, atol=1e-10)
    assert ring_grads is not None
    for got, ref in zip(ring_grads, want_leaves):
        torch.testing.assert_close(got, ref.grad, rtol=1e-10, atol=1e-10)
