"""Ulysses attention: all-to-all from sequence shards to head shards, attend, all-to-all back.

DeepSpeed-Ulysses (Jacobs et al. 2023): each of the U ranks holds a contiguous 1/U of the
sequence for all heads; one all-to-all gives every rank the whole sequence for 1/U of the heads,
attention runs there unchanged, and the inverse all-to-all returns the output to sequence
shards. q, k and v travel in a single packed all-to-all, so a forward issues two all-to-alls
(q/k/v in, output back) and a backward two more (output grad in, q/k/v grads back).

One autograd function does all of it: the all-to-alls on either side and, between them, the
loop's forward and backward halves (``loop``) on the gathered sequence; the attention between
them is local for pure Ulysses and a ring across ring groups for the hybrid (``hybrid``). Every
rank sends its heads rank by rank, each rank's part sequence-major (``[U, B, s, n, D]``), so
what arrives is the gathered sequence itself for one sequence (B = 1, as long contexts run: a
view, no copy), and the kernel's layout is a view of it. The loop's saved tensors go through this
function's context, so autograd's saved-tensor hooks see them as they see any layer's.

Heads (``head_routes``): query heads are split evenly; when the KV heads do not split evenly
(fewer than U, as in MQA, or not a multiple of U) each rank receives copies of the KV heads its
query heads read; when the query heads themselves do not split into U, they are padded with zero
heads, each paired with a KV head of zeros, and the padding is cut off the output. Which source
head goes where is one index list, so packing q, k and v for the all-to-all is one gather of
their rows, and bringing their gradients home one gather by the inverse list: every query row
once, then every key and value row's first copy, its second, and so on, where the ranks received
KV heads more than once; the copies are summed into the first, rounded once (a scatter-add would
round at every add on a GPU, and add in whatever order its atomics land). A zero head's rows are
left where they arrived.

Shape legend: B batch, s local sequence (S = U*s gathered), H query heads, K key/value heads,
D head dim, U ranks in the Ulysses group, h query and g key/value heads a rank attends to, N the
source heads (H + 2K, and one zero head where padding needs it).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

import torch

from ringtrain.train.attention.block_kernel import AttentionKernel, accumulation_dtype, default_scale
from ringtrain.train.attention.call import AttentionCall, check_qkv, check_window
from ringtrain.train.attention.documents import DocIds, Documents
from ringtrain.train.attention.kernels import KernelArg, resolve_kernel
from ringtrain.train.attention.loop import attend_backward, attend_forward
from ringtrain.train.attention.transport import GroupArg, Transport, as_transport

Tensor = torch.Tensor
# The attention over the gathered sequence, as a call of the loop: (gathered length, documents) -> call.
InnerCall = Callable[[int, Optional[Documents]], AttentionCall]
# Handed the K/V a rank attends as its layout leaves them (``[B, S, K, D]`` views): a shard of
# the sequence for every head, or, after Ulysses' all-to-all, the gathered sequence for this
# rank's heads. What a KV cache keeps (``kv_cache``).
KeepKV = Callable[[Tensor, Tensor], None]


@dataclass(frozen=True)
class HeadRoutes:
    """Where each source head goes: ``route`` lists, rank by rank, the source heads it receives
    (h query heads, then g key and g value heads); a rank's query head i reads its key/value head
    i // (h // g)."""

    route: tuple[int, ...]
    h: int
    g: int
    zero_head: bool  # whether the source has a zero head appended (index N - 1)


@functools.lru_cache(maxsize=64)
def head_routes(heads: int, kv_heads: int, degree: int) -> HeadRoutes:
    """The routes of ``heads`` query and ``kv_heads`` key/value heads over ``degree`` ranks; pure."""
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads are not a multiple of {kv_heads} key/value heads")
    k0, v0 = heads, heads + kv_heads  # where the key and value heads start among the sources
    if heads % degree == 0:
        # The fewest copies f of each KV head with K*f divisible by the degree; H is divisible by
        # lcm(K, degree) = K*f, so query head i still reads (a copy of) KV head i // (H // K).
        copies = degree // math.gcd(kv_heads, degree)
        h, g = heads // degree, kv_heads * copies // degree
        route = [head for u in range(degree) for head in (
            *range(u * h, (u + 1) * h),
            *(k0 + j // copies for j in range(u * g, (u + 1) * g)),
            *(v0 + j // copies for j in range(u * g, (u + 1) * g)),
        )]
        return HeadRoutes(tuple(route), h, g, False)
    # One KV head per query head, and zero heads up to a multiple of the degree.
    zero, group = heads + 2 * kv_heads, heads // kv_heads
    padded = heads + (-heads % degree)
    h = padded // degree
    route = [head for u in range(degree) for head in (
        *(i if i < heads else zero for i in range(u * h, (u + 1) * h)),
        *(k0 + i // group if i < heads else zero for i in range(u * h, (u + 1) * h)),
        *(v0 + i // group if i < heads else zero for i in range(u * h, (u + 1) * h)),
    )]
    return HeadRoutes(tuple(route), h, h, True)


@dataclass(frozen=True)
class Routing:
    """How a call's tensors move, for one shape: the flat gather that packs every rank's heads
    rank-major (``[U, B, s, n, D]``, as the all-to-all sends them) from the sources' rows in one
    op, and the one gather that brings their gradients home: ``home`` lists the arrived rows of
    q's ``B s H`` rows, then of k's and v's ``2 B s K`` once for each copy of them, copy by copy,
    each in the order the sources lay their rows out."""

    routes: HeadRoutes
    gather: Tensor  # [U B s n]: row (b s + t) N + route[u n + j] of the sources ``[B s N, D]`` (heads side by side)
    home: Tensor  # [B s (H + 2 K c)]
    home_parts: tuple[int, ...]  # the rows of q, then of k and v's each copy: B s H, 2 B s K (c times)


@functools.lru_cache(maxsize=16)
def routing_of(B: int, s: int, heads: int, kv_heads: int, degree: int, device: torch.device) -> Routing:
    """The routing of ``B`` sequences of ``s`` tokens over ``degree`` ranks (kept: every layer shares it)."""
    routes = head_routes(heads, kv_heads, degree)
    source_heads = torch.tensor((heads, kv_heads, kv_heads, *((1,) if routes.zero_head else ())))
    route_Un = torch.tensor(routes.route).view(degree, 1, 1, -1)
    # Which source each routed head is of, and its head index within that source.
    source_Un = torch.bucketize(route_Un, source_heads.cumsum(0), right=True)
    within_Un = route_Un - (source_heads.cumsum(0) - source_heads)[source_Un]
    tokens_Bs1 = torch.arange(B * s).view(B, s, 1)
    gather = tokens_Bs1 * int(source_heads.sum()) + route_Un
    # At home the gradients of a source take B s rows per head of it, source after source, so
    # each is one contiguous tensor of its own: autograd takes it as the input's gradient as it is.
    rows = B * s * source_heads
    place = ((rows.cumsum(0) - rows)[source_Un] + tokens_Bs1 * source_heads[source_Un] + within_Un).flatten()
    q_rows, kv_rows = int(rows[0]), int(rows[1] + rows[2])
    sent = torch.bincount(place, minlength=int(rows.sum()))
    copies = int(sent[q_rows])
    if not (bool((sent[:q_rows] == 1).all()) and bool((sent[q_rows:q_rows + kv_rows] == copies).all())):
        # What the backward's sum relies on (every KV row copied alike), as head_routes makes them.
        raise AssertionError(f"{heads} query, {kv_heads} KV heads over {degree} ranks: uneven routes {routes.route}")
    # Which copy of its row each arrived row is (in rank order), then the arrived rows by copy and
    # by place: q's, every KV row's first copy, every second, ...; the zero head's last, cut off.
    by_place = torch.argsort(place, stable=True)
    placed = place[by_place]
    copy = torch.empty_like(place)
    copy[by_place] = torch.arange(place.numel()) - torch.searchsorted(placed, placed)
    real_rows = q_rows + kv_rows
    order = torch.where(place < real_rows, copy * real_rows + place, copies * real_rows)
    home = torch.argsort(order, stable=True)[: q_rows + kv_rows * copies]
    return Routing(routes, gather.flatten().to(device), home.to(device), (q_rows, *(kv_rows,) * copies))


class _Nested:
    """The context of the loop's halves inside this function: their tensors are saved through
    this function's own context (saved-tensor hooks included), the rest kept here."""

    def __init__(self, outer: Any) -> None:
        self._outer = outer

    def save_for_backward(self, *tensors: Tensor) -> None:
        self._outer.save_for_backward(*tensors)

    @property
    def saved_tensors(self) -> tuple[Tensor, ...]:
        saved: tuple[Tensor, ...] = self._outer.saved_tensors
        return saved


class _Ulysses(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, q_BsHD: Tensor, k_BsKD: Tensor, v_BsKD: Tensor, group: Transport, kernel: AttentionKernel,
        inner: InnerCall, docs: Optional[Documents], keep: Optional[KeepKV] = None,
    ) -> Tensor:
        B, s, H, D = q_BsHD.shape
        U = group.size()
        routing = routing_of(B, s, H, k_BsKD.shape[2], U, q_BsHD.device)
        routes = routing.routes
        sources = [q_BsHD, k_BsKD, v_BsKD]
        if routes.zero_head:
            sources.append(q_BsHD.new_zeros((B, s, 1, D)))
        # Every rank's heads, rank by rank, in one gather from the sources' rows.
        sent = torch.cat(sources, dim=2).view(-1, D).index_select(0, routing.gather)
        received = torch.empty_like(sent)
        group.all_to_all(received, sent)
        # The gathered sequence in the kernel's layout (one view), split into q, k and v there.
        (qkv,) = kernel.to_layout(_gathered(received, U, B, s, D))
        q, k, v = qkv.split_with_sizes((routes.h, routes.g, routes.g), dim=3 - kernel.seq_dim)
        if keep is not None:
            keep(*kernel.from_layout(k, v))
        nested = _Nested(ctx)
        out = attend_forward(nested, inner(U * s, docs), q, k, v, in_layout=True)
        ctx.nested, ctx.group, ctx.kernel, ctx.routing = nested, group, kernel, routing
        out_BsHD = _back_to_sequence(kernel.from_layout(out)[0], group)
        return out_BsHD if out_BsHD.shape[2] == H else out_BsHD[:, :, :H]

    @staticmethod
    def backward(ctx: Any, dout_BsHD: Tensor) -> tuple[Optional[Tensor], ...]:  # type: ignore[override]
        group, kernel, routing = ctx.group, ctx.kernel, ctx.routing
        U, h = group.size(), routing.routes.h
        B, s, H, D = dout_BsHD.shape
        if h * U != H:
            dout_BsHD = torch.nn.functional.pad(dout_BsHD, (0, 0, 0, h * U - H))
        # The output's gradient to the ranks that made each head's output, as the output came back.
        sent = dout_BsHD.reshape(B, s, U, h, D).permute(2, 0, 1, 3, 4).contiguous()
        received = torch.empty_like(sent)
        group.all_to_all(received, sent)
        dq, dk, dv = attend_backward(ctx.nested, kernel.to_layout(_gathered(received, U, B, s, D))[0])
        # The gradients home by the routes they came: one all-to-all, then one gather of the
        # sources' rows, each source's its own contiguous tensor: what autograd hands on as the
        # input's gradient without a copy. Joined sequence-major, so the join is the one copy
        # (joined head-major, a second would lay it out).
        grads = torch.cat(kernel.from_layout(dq, dk, dv), dim=2)
        back = _by_rank(grads, U)
        arrived = torch.empty_like(back)
        group.all_to_all(arrived, back)
        home = arrived.view(-1, D).index_select(0, routing.home)
        dq, dkv, *other_copies = home.split_with_sizes(routing.home_parts)
        # A copied KV head's gradient is its copies' gradients summed into the first copy's rows,
        # rounded once: one add, for two copies; a sum in fp32 for more. The gathered copies and
        # the fp32 sum, (2 c p + 8) k d bytes a token, are within the attention backward's working
        # set that planner/memory.py counts, (16 + 6 p) k d c.
        if len(other_copies) == 1:
            dkv.add_(other_copies[0])
        elif other_copies:
            c = 1 + len(other_copies)
            all_copies = home.narrow(0, dq.shape[0], c * dkv.shape[0]).view(c, *dkv.shape)
            dkv.copy_(all_copies.sum(dim=0, dtype=accumulation_dtype(dkv.dtype)))
        dk, dv = dkv.view(2, B, s, -1, D).unbind(0)
        return dq.view(B, s, H, D), dk, dv, None, None, None, None, None


def _gathered(by_rank: Tensor, U: int, B: int, s: int, D: int) -> Tensor:
    """Rank u's s tokens of each sequence's n heads, rank by rank (``[U, B, s, n, D]``, in any shape
    that holds it contiguous) -> the gathered sequence ``[B, U s, n, D]``: a view for one
    sequence (B = 1, as long contexts run), one copy otherwise."""
    if B == 1:
        return by_rank.view(1, U * s, -1, D)
    return by_rank.view(U, B, s, -1, D).transpose(0, 1).reshape(B, U * s, -1, D)


def _by_rank(gathered: Tensor, U: int) -> Tensor:
    """The inverse of ``_gathered``: ``[U, B, s, n, D]``, contiguous (a view of a contiguous B = 1)."""
    B, S, n, D = gathered.shape
    if B == 1:  # rank u's part is the sequence's u-th s rows: the order they are in
        return gathered.view(U, 1, S // U, n, D).contiguous()
    return gathered.reshape(B, U, S // U, n, D).transpose(0, 1).contiguous()


def _back_to_sequence(out_BShD: Tensor, group: Transport) -> Tensor:
    """This rank's heads of the gathered output -> every head of this rank's tokens, ``[B, s, U h, D]``."""
    U = group.size()
    sent = _by_rank(out_BShD, U)
    received = torch.empty_like(sent)
    group.all_to_all(received, sent)
    _, B, s, h, D = received.shape  # rank u's heads, at u h
    return received.permute(1, 2, 0, 3, 4).reshape(B, s, U * h, D)


def all_to_all_attention(inner: InnerCall, q_BsHD: Tensor, k_BsKD: Tensor, v_BsKD: Tensor, *, group: Transport,
                         kernel: AttentionKernel, doc_ids: DocIds, keep: Optional[KeepKV] = None) -> Tensor:
    """``inner``'s attention over the sequence gathered over ``group``, for a share of the heads;
    ``keep`` is handed this rank's gathered K/V."""
    docs = Documents.of(doc_ids)
    gathered = None if docs is None else docs.concatenated(group)
    out: Tensor = _Ulysses.apply(q_BsHD, k_BsKD, v_BsKD, group, kernel, inner, gathered, keep)
    return out


def ulysses_attention(q: Tensor, k: Tensor, v: Tensor, *, group: GroupArg, causal: bool = True, doc_ids: DocIds = None,
                      kernel: KernelArg = "auto", scale: Optional[float] = None,
                      window: Optional[int] = None, keep: Optional[KeepKV] = None) -> Tensor:
    """Attention over the group's whole sequence from this rank's contiguous part.

    ``q`` [B, s, H, D], ``k``/``v`` [B, s, K, D] and ``doc_ids`` [B, s] hold part u (of U equal
    contiguous parts) of the sequence on group rank u; returns this rank's output part
    [B, s, H, D]. ``group``: a process group or a ``Transport`` (a layout without Ulysses groups
    runs ``attend.local_attention``: ``topology.CPLayout.runs``). ``window``: a causal sliding
    window of that many tokens, over the gathered sequence. ``keep``: handed the gathered K/V of
    this rank's heads (``KeepKV``).
    """
    check_qkv(q, k, v, doc_ids)
    check_window(window, causal)
    transport = as_transport(group)
    assert transport is not None
    chosen = resolve_kernel(kernel, q)
    scale = default_scale(q.shape[-1]) if scale is None else scale

    def inner(seq: int, docs: Optional[Documents]) -> AttentionCall:
        return AttentionCall.of(None, seq, causal=causal, docs=docs, window=window, scale=scale, kernel=chosen,
                                kv_exchange="auto")

    return all_to_all_attention(inner, q, k, v, group=transport, kernel=chosen, doc_ids=doc_ids, keep=keep)
