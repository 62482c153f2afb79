"""Packed documents: each token's document, on the device and the host, and how an attention
block is cut at document boundaries into blocks without masks.

A packed sequence holds documents end to end, and a query sees only keys of its own document
(a negative id marks padding, which sees nothing and is seen by none). So a block of queries
against keys is, document by document, the rectangle of that document's queries against its
keys, and nothing else: each rectangle is an unmasked block that the fastest kernel runs as it
is (causal where the block is), and no [Q, S] mask or bias is ever made. A document's tokens are
contiguous in the sequence and every shard keeps the sequence's order, so a document is one run
of a block's rows and one run of its columns (should a document come in several runs, each pair
of runs is a rectangle and their partial results merge).

Documents may come in families that share a prefix (``family`` k > 0: ids k j, k j + 1, ...,
k j + k - 1 form family j): the family's first document is the parent of the others, whose
queries see its keys as well as their own, and not each other's. A preference pair is a family of
three (its prompt, then its chosen and its rejected completion, each continuing the prompt):
the prompt's forward and backward run once for both. The parent comes first in the sequence, so
a child's rectangle against its parent is wholly visible, never causal. A child's position ids
continue its parent's (its first token one past the parent's last), not the sequence's: its
elder siblings lie between them in the sequence but not in positions. A sliding window measures
by position ids, so a child's tokens sit ``position_lags`` tokens earlier than their place in
the sequence says.

The cut is computed on the host: ``Documents`` holds the ids on the device and, copied once, on
the host; it slices like a tensor, and gathers across a group once per forward (the model makes
one per forward; every layer, and its recomputation, shares it).

Shape legend: B batch, S sequence, Q / K a block's rows / columns, U ranks in a group.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple, Optional, Union

import numpy as np
import torch

from ringtrain.train.attention.transport import Transport
from ringtrain.train.attention.zigzag import zigzag_unshard

Tensor = torch.Tensor


@dataclass(frozen=True)
class Segment:
    """The rectangle of one document in a block: batch row ``b``, ``rows`` of the queries
    against ``cols`` of the keys (of the rows' parent's keys, with ``parent``)."""

    b: int
    rows: slice
    cols: slice
    parent: bool = False


def parents(ids: Any, family: int) -> Any:
    """Each document's parent (numpy or torch, elementwise): the first of its family for the
    others, -1 for a family's first, for padding and where there are no families."""
    if not family:
        return ids * 0 - 1
    first = ids - ids % family
    return ((ids % family != 0) & (ids >= 0)) * (first + 1) - 1


def doc_visibility(q_doc_BQ: Tensor, k_doc_BS: Tensor, family: int = 0) -> Tensor:
    """``[B, Q, S]``: True where query and key belong to the same (non-padding) document, or the
    key to the query's parent. The mask a block cut by documents never makes; kernels that take
    masks are checked against it."""
    same_BQS = q_doc_BQ[:, :, None] == k_doc_BS[:, None, :]
    if family:
        same_BQS = same_BQS | (parents(q_doc_BQ, family)[:, :, None] == k_doc_BS[:, None, :])
    return same_BQS & (q_doc_BQ >= 0)[:, :, None]


class ChildRun(NamedTuple):
    """A run of a child document's tokens in a row of the whole sequence, where its parent is in
    the row too: the run's span, its parent's, and how many places its tokens' position ids fall
    behind their places in the row (the tokens between its parent's end and its own start, its
    elder siblings; 0 where the parent does not end before it starts)."""

    start: int
    stop: int
    parent_start: int
    parent_stop: int
    lag: int


def child_runs(ids_N: np.ndarray, family: int) -> Iterator[ChildRun]:
    """Each run of a child document in ``ids_N``, one row of the whole sequence in order, whose
    parent is in the row (``ChildRun``)."""
    found = runs(ids_N)
    extent = extents(found)
    for doc, start, stop in found:
        parent = int(parents(doc, family))
        if parent >= 0 and parent in extent:
            (parent_start, parent_stop), doc_start = extent[parent], extent[doc][0]
            lag = doc_start - parent_stop if parent_stop <= doc_start else 0
            yield ChildRun(start, stop, parent_start, parent_stop, lag)


def position_lags(ids_BN: np.ndarray, family: int) -> np.ndarray:
    """``[B, N]``: how many places each token's position id falls behind its place in the sequence
    ``ids_BN`` (the whole sequence, in order): for a child document, the tokens between its
    parent's end and its own start (its elder siblings); 0 elsewhere, and where the parent is
    not in the row."""
    lags_BN = np.zeros(ids_BN.shape, dtype=np.int64)
    for b in range(ids_BN.shape[0]):
        for run in child_runs(ids_BN[b], family):
            lags_BN[b, run.start : run.stop] = run.lag
    return lags_BN


def extents(found: list[tuple[int, int, int]]) -> dict[int, tuple[int, int]]:
    """Each document's first position and its last plus one, from its ``runs``."""
    extent: dict[int, tuple[int, int]] = {}
    for doc, start, stop in found:
        extent[doc] = (extent.get(doc, (start, stop))[0], stop)
    return extent


def runs(ids_S: np.ndarray) -> list[tuple[int, int, int]]:
    """``(id, start, stop)`` of each run of equal ids, in order."""
    if ids_S.size == 0:
        return []
    cuts = np.flatnonzero(ids_S[1:] != ids_S[:-1]) + 1
    starts, stops = np.concatenate(([0], cuts)), np.concatenate((cuts, [ids_S.size]))
    return [(int(ids_S[a]), int(a), int(b)) for a, b in zip(starts, stops)]


def segments(q_ids_BQ: np.ndarray, k_ids_BS: np.ndarray, family: int = 0) -> list[Segment]:
    """Every (query run, key run) pair of one non-padding document, and of a document's queries
    against its parent's keys, batch row by batch row."""
    found = []
    for b in range(q_ids_BQ.shape[0]):
        key_runs: dict[int, list[tuple[int, int]]] = {}
        for doc, start, stop in runs(k_ids_BS[b]):
            key_runs.setdefault(doc, []).append((start, stop))
        for doc, start, stop in runs(q_ids_BQ[b]):
            if doc < 0:
                continue
            for k_start, k_stop in key_runs.get(doc, ()):
                found.append(Segment(b, slice(start, stop), slice(k_start, k_stop)))
            parent = int(parents(doc, family))
            for k_start, k_stop in key_runs.get(parent, ()) if parent >= 0 else ():
                found.append(Segment(b, slice(start, stop), slice(k_start, k_stop), parent=True))
    return found


@dataclass
class Documents:
    """Each token's document id ``[B, S]``: on the device (what collectives move) and on the host
    (what blocks are cut by). Indexing slices both, as a tensor would be sliced."""

    ids_BS: Tensor
    host_BS: np.ndarray
    family: int = 0  # documents in families of this many sharing the first as a prefix; 0: none
    _gathered: dict[tuple[int, str], Any] = field(default_factory=dict, repr=False)

    @classmethod
    def of(cls, ids: Union[Tensor, Documents, None]) -> Optional[Documents]:
        """Documents of device ids (one device-to-host copy); Documents and None as they are."""
        if ids is None or isinstance(ids, Documents):
            return ids
        return cls(ids, ids.detach().cpu().numpy())

    @property
    def shape(self) -> torch.Size:
        return self.ids_BS.shape

    def __getitem__(self, index: Any) -> Documents:
        return Documents(self.ids_BS[index], self.host_BS[index], self.family)

    def shards(self, group: Transport) -> list[Documents]:
        """Every rank's ids of ``group``, by rank: one all-gather per forward and group (cached,
        as are the joins below and whatever ``cached`` keeps; every layer asks for the same)."""
        key = (_group_key(group), "shards")
        if key not in self._gathered:
            ids_UBS = group.all_gather(self.ids_BS)
            host_UBS = ids_UBS.cpu().numpy()
            self._gathered[key] = [Documents(ids_UBS[u], host_UBS[u], self.family) for u in range(ids_UBS.shape[0])]
        shards: list[Documents] = self._gathered[key]
        return shards

    def cached(self, key: Any, make: Callable[[], Any]) -> Any:
        """``make()`` the first time ``key`` is asked for in this forward (a plan of the blocks
        these documents cut, shared by every layer)."""
        if key not in self._gathered:
            self._gathered[key] = make()
        return self._gathered[key]

    def position_lags(self, group: Optional[Transport]) -> np.ndarray:
        """``position_lags`` of the ring's whole sequence, ``[B, N]`` (``group``'s; None: these ids
        are the whole sequence), once per forward."""
        key = (None if group is None else _group_key(group), "lags")
        if key not in self._gathered:
            whole = self.host_BS if group is None else self.whole_sequence(group).host_BS
            self._gathered[key] = position_lags(whole, self.family)
        lags_BN: np.ndarray = self._gathered[key]
        return lags_BN

    def whole_sequence(self, group: Transport) -> Documents:
        """The ring's whole sequence in order, from every rank's zigzag shard."""
        return self._joined(group, "zigzag")

    def concatenated(self, group: Transport) -> Documents:
        """The group's contiguous parts end to end, by rank (a Ulysses group's)."""
        return self._joined(group, "concatenated")

    def _joined(self, group: Transport, how: str) -> Documents:
        key = (_group_key(group), how)
        if key not in self._gathered:
            shards = self.shards(group)

            def join(parts: list[Tensor]) -> Tensor:
                return zigzag_unshard(parts, dim=1) if how == "zigzag" else torch.cat(parts, dim=1)

            # The host ids joined on the host, from the shards' copies: no second device sync.
            host = join([torch.from_numpy(shard.host_BS) for shard in shards]).numpy()
            self._gathered[key] = Documents(join([shard.ids_BS for shard in shards]), host, self.family)
        joined: Documents = self._gathered[key]
        return joined


def _group_key(group: Transport) -> int:
    """What identifies a group across the transports made for it in one forward."""
    return id(getattr(group, "group", group))


# Packed documents as the attention functions take them: device ids [B, S], or ``Documents``.
DocIds = Optional[Union[Tensor, Documents]]
