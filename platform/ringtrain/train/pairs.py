"""Preference pairs in training rows: which pairs a row holds, and each pair's layout in it.

A preference dataset (``ringtrain prepare --format preference``) stores each pair as three
documents: its prompt, then its chosen and its rejected completion, each continuing the prompt.
Training never splits a pair across rows; pairs are packed into rows as conversations are
(``conversations.py``: shuffled once by the seed, next-fit or first-fit, a function of the seed
and the dataset only). A pair is laid out (``data.prefix_sharing``):

- shared (the default): its prompt once, then each completion as a document of its own that
  sees the prompt (a family of ``PAIR_FAMILY`` documents, ``attention.documents``). The prompt's
  last token leads each completion (it predicts the completion's first token, so both need it),
  the rest of the prompt is the family's first document; a completion's positions continue the
  prompt's. ``P + C + R + 1`` tokens for a prompt of P and completions of C and R;
- two documents: prompt + chosen, then prompt + rejected, each a document of its own.
  ``2 P + C + R`` tokens: the prompt's forward and backward run twice.

Both give the same losses and gradients. Each token that is a completion's trained target is
labelled with its completion's slot in the row (``2 k`` for pair k's chosen, ``2 k + 1`` for its
rejected), so a rank can sum its tokens' log-probs into the pairs they belong to.

A pair longer than ``seq_len`` is dropped, or its prompt cut from its start where the job asks
(``data.chat_overlong: truncate_start``); one whose completions alone do not fit is dropped
either way. Both are counted with the tokens they lost (``PairRows.counts``: the driver reports
them, as a chat dataset's, before the first step and in the run's summary). Pure numpy.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar, Optional

import numpy as np

from ringtrain.errors import DataError
from ringtrain.train.conversations import PACKERS, PACKING_COUNTS, _PACK_KEY, PackedRows

# Documents a pair is laid out as when its prompt is shared: the family's first (the prompt but
# its last token) and one per completion.
PAIR_FAMILY = 3
# The documents of pair j in a preference dataset: 3 j (prompt), 3 j + 1, 3 j + 2.
STORED_DOCUMENTS = 3
CHOSEN, REJECTED = 0, 1
# What ``PairRows.counts`` reports, in the run's summary under "chat": a chat dataset's counts
# with pairs in the conversations' place (a pair's tokens those it takes laid out in a row).
PAIR_COUNTS = ("pairs", *PACKING_COUNTS[1:])


def row_length(prompt: np.ndarray, chosen: np.ndarray, rejected: np.ndarray, shared: bool) -> np.ndarray:
    """Tokens a pair takes in a row, for arrays of its parts' lengths."""
    return prompt + chosen + rejected + 1 if shared else 2 * prompt + chosen + rejected


@dataclass(frozen=True)
class PairRows(PackedRows):
    """Rows of whole pairs, each with ``prompt_cut`` tokens cut from its prompt's start (the
    counts' items are pairs, their tokens as each pair is laid out whole)."""

    COUNT_NAMES: ClassVar[tuple[str, ...]] = PAIR_COUNTS

    pairs: np.ndarray  # int64 pair indices, row after row
    prompt_cut: np.ndarray  # int64, aligned with ``pairs``

    def row(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        """(pair indices, tokens cut from each one's prompt) of row ``index``."""
        lo, hi = int(self.starts[index]), int(self.starts[index + 1])
        return self.pairs[lo:hi], self.prompt_cut[lo:hi]

    def head(self, num_rows: int) -> "PairRows":
        """The first ``num_rows`` rows; the dataset's counts (and so its pairs' indices) as they were."""
        end = int(self.starts[num_rows])
        return dataclasses.replace(self, pairs=self.pairs[:end], prompt_cut=self.prompt_cut[:end],
                                   starts=self.starts[: num_rows + 1])  # fmt: skip


def pack_pairs(document_lengths: np.ndarray, seq_len: int, seed: int, *, shared: bool, overlong: str,
               packing: str = "next_fit", length_key: str = "data.seq_len") -> PairRows:  # fmt: skip
    """Rows of at most ``seq_len`` tokens of whole pairs, from the dataset's document lengths;
    a DataError naming ``length_key`` (the config key or option ``seq_len`` came from) where none fits."""
    if overlong not in ("drop", "truncate_start"):
        raise ValueError(f"overlong must be drop or truncate_start for preference pairs, got {overlong!r}")
    parts = np.asarray(document_lengths, dtype=np.int64).reshape(-1, STORED_DOCUMENTS)
    prompt, chosen, rejected = parts[:, 0], parts[:, 1], parts[:, 2]
    order = np.random.Generator(np.random.PCG64([seed, _PACK_KEY])).permutation(len(parts))
    need = row_length(prompt, chosen, rejected, shared)[order]
    over = need - seq_len
    # A cut prompt keeps its last token at least (it predicts each completion's first).
    cut = np.zeros(len(order), dtype=np.int64)
    if overlong == "truncate_start":
        cut = np.where(over > 0, -(-over // (1 if shared else 2)), 0)
    keep = (over <= 0) | ((overlong == "truncate_start") & (cut < prompt[order]))
    order, cut = order[keep], cut[keep]
    if len(order) == 0:
        remedy = "" if overlong == "truncate_start" else " or set data.chat_overlong: truncate_start"
        raise DataError(f"no preference pair fits {_set_to(length_key, seq_len)} (all {len(parts)} are longer; "
                        f"raise {length_key}{remedy})")  # fmt: skip
    taken = row_length(prompt[order] - cut, chosen[order], rejected[order], shared)
    placed, starts = PACKERS[packing](taken, seq_len)
    long = int((over > 0).sum())
    return PairRows(pairs=order[placed].astype(np.int64), prompt_cut=cut[placed], starts=starts, seq_len=seq_len,
                    total=len(parts), dropped=len(parts) - len(order), truncated=long - (len(parts) - len(order)),
                    num_tokens=int(need.sum()), dropped_tokens=int(need[~keep].sum()),
                    truncated_tokens=int((need[keep] - taken).sum()))  # fmt: skip


def _set_to(key: str, value: int) -> str:
    """``key`` with ``value`` as the user writes it: ``data.seq_len=8`` for a config key, ``--seq-len 8`` for an option."""
    return f"{key} {value}" if key.startswith("--") else f"{key}={value}"


@dataclass(frozen=True)
class PairRow:
    """One row of pairs, ``seq_len + 1`` tokens: each token's document (families of
    ``PAIR_FAMILY``, or two documents a pair), position, whether it is a trained target, and the
    completion slot it is a target of (-1: none)."""

    tokens: np.ndarray
    doc_ids: np.ndarray
    positions: np.ndarray
    targets: np.ndarray
    completions: np.ndarray


def pair_row(parts: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]], seq_len: int,
             pad_id: int, shared: bool) -> PairRow:  # fmt: skip
    """A row of pairs, each ``(prompt, chosen, chosen mask, rejected, rejected mask)`` (the
    prompt already cut), laid out as ``shared`` says and padded (document -1) to ``seq_len + 1``."""
    tokens: list[np.ndarray] = []
    docs: list[np.ndarray] = []
    positions: list[np.ndarray] = []
    targets: list[np.ndarray] = []
    slots: list[np.ndarray] = []

    def add(ids: np.ndarray, doc: int, start: int, mask: Optional[np.ndarray], slot: int) -> None:
        tokens.append(ids)
        docs.append(np.full(len(ids), doc, dtype=np.int64))
        positions.append(np.arange(start, start + len(ids), dtype=np.int64))
        trained = np.zeros(len(ids), dtype=np.uint8) if mask is None else mask.astype(np.uint8)
        targets.append(trained)
        slots.append(np.where(trained == 1, slot, -1).astype(np.int64))

    for k, (prompt, chosen, chosen_mask, rejected, rejected_mask) in enumerate(parts):
        if shared:
            head, last = prompt[:-1], prompt[-1:]
            add(head, PAIR_FAMILY * k, 0, None, -1)
            for side, (ids, mask) in enumerate(((chosen, chosen_mask), (rejected, rejected_mask))):
                add(np.concatenate([last, ids]), PAIR_FAMILY * k + 1 + side, len(head),
                    np.concatenate([[0], mask]), 2 * k + side)  # fmt: skip
        else:
            for side, (ids, mask) in enumerate(((chosen, chosen_mask), (rejected, rejected_mask))):
                add(np.concatenate([prompt, ids]), 2 * k + side, 0, np.concatenate([np.zeros(len(prompt)), mask]),
                    2 * k + side)  # fmt: skip
    used = sum(len(t) for t in tokens)
    if used > seq_len:
        raise ValueError(f"a row of {used} tokens exceeds seq_len={seq_len}")
    pad = seq_len + 1 - used
    add(np.full(pad, pad_id, dtype=np.int64), -1, 0, None, -1)
    return PairRow(*(np.concatenate(x) for x in (tokens, docs, positions, targets, slots)))
