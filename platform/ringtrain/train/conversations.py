"""Whole conversations packed into training rows: which conversations each row of a chat dataset holds.

A chat dataset (``ringtrain prepare --format chat``) stores conversations as documents with a
per-token loss mask. Training never splits a conversation across rows: its conversations are
shuffled once by the seed, then laid into rows of ``seq_len`` tokens (``data.chat_packing``):

- ``next_fit``: in the shuffled order, a new row starting whenever the next conversation does not
  fit;
- ``first_fit``: first-fit decreasing within each window of ``FIRST_FIT_WINDOW`` conversations of
  the shuffled order: the window's conversations, longest first, each into the first of the
  window's rows it fits in. Rows fill fuller (docs/performance.md) and the shuffle still mixes
  the dataset, a window at a time.

The packing is a function of the seed and the dataset only, so the rows, like a token file's
windows, are the same on every rank, at every dp, and after a resume; rows are then drawn in a
per-epoch shuffled order as windows are.

A conversation longer than ``seq_len`` is dropped (``data.chat_overlong: drop``), cut to its first
``seq_len`` tokens (``truncate``) or to its last (``truncate_start``: long-document QA, whose
answer comes last), and counted with the tokens it lost. A row is its conversations end to end,
padded to ``seq_len + 1`` tokens of padding (document id -1: it attends to nothing and nothing
attends to it, so it costs no attention, and it carries no loss); each conversation is its own
document (``data.packing: doc`` semantics: attention kept within it, positions restarting at its
first token kept).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from ringtrain.errors import DataError

# Stream key of the packing shuffle, so it never shares a random stream with the row order.
_PACK_KEY = 0x636861
# Conversations first-fit packs together: enough that a window's short ones fill its long ones'
# rows, few enough that every epoch's rows still mix the whole dataset.
FIRST_FIT_WINDOW = 1024
# What ``ConversationRows.counts`` reports, in the run's summary under "chat" (a preference
# dataset's counts have pairs in the conversations' place: ``pairs.PAIR_COUNTS``).
PACKING_COUNTS = ("conversations", "packed", "dropped", "truncated", "rows", "tokens", "dropped_tokens",
                  "truncated_tokens", "row_tokens", "packed_tokens")  # fmt: skip


@dataclass(frozen=True)
class PackedRows:
    """Rows of whole items (conversations, or preference pairs) packed into ``seq_len`` tokens:
    row r holds items ``starts[r]:starts[r + 1]``; what packing kept and what ``seq_len`` cost."""

    COUNT_NAMES: ClassVar[tuple[str, ...]] = PACKING_COUNTS

    starts: np.ndarray  # int64 offsets of each row's first item, then the end
    seq_len: int
    total: int  # items in the dataset
    dropped: int  # longer than seq_len, left out
    truncated: int  # longer than seq_len, cut to fit
    num_tokens: int  # the dataset's items' tokens, all of them (a pair's as it is laid out whole)
    dropped_tokens: int  # the dropped items' tokens
    truncated_tokens: int  # what cutting took from the truncated ones

    @property
    def num_rows(self) -> int:
        return len(self.starts) - 1

    def counts(self) -> dict[str, int]:
        """What the run's summary reports about the packing (``COUNT_NAMES``): items and tokens,
        what was lost to ``seq_len``, and the rows' capacity against the tokens they hold."""
        values = (self.total, self.total - self.dropped, self.dropped, self.truncated, self.num_rows, self.num_tokens,
                  self.dropped_tokens, self.truncated_tokens, self.num_rows * self.seq_len,
                  self.num_tokens - self.dropped_tokens - self.truncated_tokens)  # fmt: skip
        return dict(zip(self.COUNT_NAMES, values, strict=True))


@dataclass(frozen=True)
class ConversationRows(PackedRows):
    """Rows of whole conversations, each taking ``lengths`` of its tokens from ``skips`` on (its
    whole length from 0 unless cut)."""

    conversations: np.ndarray  # int64 conversation (document) indices, row after row
    lengths: np.ndarray  # int64 tokens each takes, aligned with ``conversations``
    skips: np.ndarray  # int64 tokens left out at each one's start (truncate_start), aligned

    def row(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        """(conversation indices, tokens taken of each) of row ``index``."""
        lo, hi = int(self.starts[index]), int(self.starts[index + 1])
        return self.conversations[lo:hi], self.lengths[lo:hi]

    def row_skips(self, index: int) -> np.ndarray:
        """Tokens left out at the start of each conversation of row ``index``."""
        return self.skips[int(self.starts[index]) : int(self.starts[index + 1])]


def _next_fit(taken: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """(the conversations' order, row starts) of next-fit over ``taken`` as they come."""
    # A Python loop over conversations, once per process (a million take about a second).
    starts, fill = [0], 0
    for i, n in enumerate(taken.tolist()):
        if fill + n > seq_len:
            starts.append(i)
            fill = 0
        fill += n
    starts.append(len(taken))
    return np.arange(len(taken), dtype=np.int64), np.asarray(starts, dtype=np.int64)


def _first_fit(taken: np.ndarray, seq_len: int, window: int = FIRST_FIT_WINDOW) -> tuple[np.ndarray, np.ndarray]:
    """(the conversations' order, row starts) of first-fit decreasing within each ``window`` of
    ``taken``: longest first (ties in the given order), each into the window's first row with room."""
    order: list[np.ndarray] = []
    sizes: list[int] = []
    for lo in range(0, len(taken), window):
        chunk = taken[lo : lo + window]
        room = np.empty(len(chunk), dtype=np.int64)  # a window's rows never outnumber its conversations
        rows: list[list[int]] = []
        for i in np.argsort(-chunk, kind="stable").tolist():
            fits = np.flatnonzero(room[: len(rows)] >= chunk[i])
            if fits.size:
                room[fits[0]] -= chunk[i]
                rows[fits[0]].append(lo + i)
            else:
                room[len(rows)] = seq_len - chunk[i]
                rows.append([lo + i])
        order += [np.asarray(r, dtype=np.int64) for r in rows]
        sizes += [len(r) for r in rows]
    flat = np.concatenate(order) if order else np.empty(0, dtype=np.int64)
    return flat, np.concatenate(([0], np.cumsum(sizes))).astype(np.int64)


PACKERS = {"next_fit": _next_fit, "first_fit": _first_fit}


def pack_conversations(lengths: np.ndarray, seq_len: int, seed: int, overlong: str, packing: str = "next_fit") -> ConversationRows:
    """Rows of at most ``seq_len`` tokens of whole conversations of ``lengths`` tokens each."""
    if overlong not in ("drop", "truncate", "truncate_start"):
        raise ValueError(f"overlong must be drop, truncate or truncate_start, got {overlong!r}")
    lengths = np.asarray(lengths, dtype=np.int64)
    order = np.random.Generator(np.random.PCG64([seed, _PACK_KEY])).permutation(len(lengths))
    taken = np.minimum(lengths[order], seq_len)
    long = lengths[order] > seq_len
    keep = ~long if overlong == "drop" else np.ones(len(order), dtype=bool)
    order, taken = order[keep], taken[keep]
    if len(order) == 0:
        raise DataError(f"no conversation fits data.seq_len={seq_len} (all {len(lengths)} are longer; "
                        "set data.chat_overlong: truncate or raise data.seq_len)")
    placed, starts = PACKERS[packing](taken, seq_len)
    order, taken = order[placed], taken[placed]
    skips = lengths[order] - taken if overlong == "truncate_start" else np.zeros(len(order), dtype=np.int64)
    num_long = int(long.sum())
    lost = int((lengths[lengths > seq_len] - seq_len).sum())
    return ConversationRows(
        conversations=order.astype(np.int64), lengths=taken, skips=skips.astype(np.int64), starts=starts,
        seq_len=seq_len, total=len(lengths), dropped=num_long if overlong == "drop" else 0,
        truncated=0 if overlong == "drop" else num_long, num_tokens=int(lengths.sum()),
        dropped_tokens=int(lengths[lengths > seq_len].sum()) if overlong == "drop" else 0,
        truncated_tokens=0 if overlong == "drop" else lost,
    )


def row_sample(tokens: list[np.ndarray], masks: list[np.ndarray], seq_len: int, pad_id: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(tokens, document ids, trained-target mask) of one row, ``seq_len + 1`` long: the
    conversations end to end, then padding (document id -1, mask 0) to the end."""
    used = sum(len(t) for t in tokens)
    if used > seq_len:
        raise ValueError(f"a row of {used} tokens exceeds seq_len={seq_len}")
    pad = seq_len + 1 - used
    out = np.concatenate([*tokens, np.full(pad, pad_id, dtype=np.int64)])
    mask = np.concatenate([*(m.astype(np.uint8) for m in masks), np.zeros(pad, dtype=np.uint8)])
    doc_ids = np.repeat(np.arange(-1, len(tokens), dtype=np.int64), [pad, *(len(t) for t in tokens)])
    doc_ids = np.roll(doc_ids, -pad)  # the conversations 0, 1, ..., then the padding
    return out, doc_ids, mask


def conversation_weights(labels: np.ndarray, doc_ids: np.ndarray, ignore_index: int) -> np.ndarray:
    """Per-label weights ``1 / N_i`` (``N_i``: conversation i's trained labels in the row), 0 on
    ignored labels: a weighted sum is then the sum of each conversation's token mean, and the
    weights of a conversation with any trained label add up to 1."""
    trained = (labels != ignore_index) & (doc_ids >= 0)  # padding (id -1) trains nothing
    counts = np.bincount(np.maximum(doc_ids, 0), weights=trained, minlength=1)
    weights = np.zeros(len(labels), dtype=np.float32)
    weights[trained] = (1.0 / counts[doc_ids[trained]]).astype(np.float32)
    return weights


# The share of a chat dataset's tokens that dropping or cutting may lose before a run warns.
LOSS_WARNING_SHARE = 0.05


def packing_note(counts: dict[str, int], seq_len: int, overlong: str) -> tuple[str, bool]:
    """One line saying how a chat dataset (or a preference dataset) packs into rows and what
    ``seq_len`` cost it (the conversations or pairs dropped or cut, and their share of the
    tokens), and whether that share is past ``LOSS_WARNING_SHARE``; ``counts`` as
    ``ConversationRows.counts`` (summed over sources) or ``pairs.PairRows.counts``."""
    pairs = "pairs" in counts
    unit = "pairs" if pairs else "conversations"
    tokens = max(1, counts["tokens"])
    fill = counts["packed_tokens"] / max(1, counts["row_tokens"])
    line = (f"{'preference' if pairs else 'chat'} data: {counts['packed']:,} of {counts[unit]:,} {unit} in "
            f"{counts['rows']:,} rows ({fill:.1%} of their tokens used)")  # fmt: skip
    lost = counts["dropped_tokens"] + counts["truncated_tokens"]
    if counts["dropped"]:
        line += (f"; {counts['dropped']:,} longer than data.seq_len={seq_len} dropped, "
                 f"{counts['dropped_tokens'] / tokens:.1%} of the tokens")  # fmt: skip
    if counts["truncated"]:
        kept = "last" if overlong == "truncate_start" else "first"
        done = f"their prompts cut from the start to fit {seq_len} tokens" if pairs else f"cut to their {kept} {seq_len} tokens"
        line += f"; {counts['truncated']:,} {done}, {counts['truncated_tokens'] / tokens:.1%} of the tokens cut"
    warn = lost / tokens > LOSS_WARNING_SHARE
    if warn:
        # A pair's completions are never cut: truncate_start is the one rule that cuts a pair.
        rule = "truncate_start" if pairs else "truncate (or truncate_start)"
        remedy = "raise data.seq_len" + ("" if overlong != "drop" else f" or set data.chat_overlong: {rule}")
        line += f" (more than {LOSS_WARNING_SHARE:.0%} of the tokens lost: {remedy})"
    return line, warn
