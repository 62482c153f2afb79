"""Whole conversations packed into training rows: which conversations each row of a chat dataset holds.

A chat dataset (``ringtrain prepare --format chat``) stores conversations as documents with a
per-token loss mask. Training never splits a conversation across rows: its conversations are
shuffled once by the seed, then laid into rows of ``seq_len`` tokens in that order, a new row
starting whenever the next conversation does not fit (next-fit). The packing is a function of the
seed and the dataset only, so the rows, like a token file's windows, are the same on every rank,
at every dp, and after a resume; rows are then drawn in a per-epoch shuffled order as windows are.

A conversation longer than ``seq_len`` is dropped (``data.chat_overlong: drop``, counted) or cut
to its first ``seq_len`` tokens (``truncate``, counted). A row is its conversations end to end,
padded to ``seq_len + 1`` tokens of padding (document id -1: it attends to nothing and
nothing attends to it, so it costs no attention, and it carries no loss); each
conversation is its own document (``data.packing: doc`` semantics: attention kept within it,
positions restarting at its first token).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ringtrain.errors import DataError

# Stream key of the packing shuffle, so it never shares a random stream with the row order.
_PACK_KEY = 0x636861


@dataclass(frozen=True)
class ConversationRows:
    """Rows of whole conversations: row r holds ``conversations[starts[r]:starts[r + 1]]``,
    each taking ``lengths`` of its tokens (its whole length unless truncated)."""

    conversations: np.ndarray  # int64 conversation (document) indices, row after row
    lengths: np.ndarray  # int64 tokens each takes, aligned with ``conversations``
    starts: np.ndarray  # int64 offsets into ``conversations`` of each row, then the end
    total: int  # conversations in the dataset
    dropped: int  # longer than seq_len, left out
    truncated: int  # longer than seq_len, cut to it

    @property
    def num_rows(self) -> int:
        return len(self.starts) - 1

    def row(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        """(conversation indices, tokens taken of each) of row ``index``."""
        lo, hi = int(self.starts[index]), int(self.starts[index + 1])
        return self.conversations[lo:hi], self.lengths[lo:hi]

    def counts(self) -> dict[str, int]:
        """What the run's summary reports about the packing."""
        return {"conversations": self.total, "packed": self.total - self.dropped, "dropped": self.dropped,
                "truncated": self.truncated, "rows": self.num_rows}


def pack_conversations(lengths: np.ndarray, seq_len: int, seed: int, overlong: str) -> ConversationRows:
    """Rows of at most ``seq_len`` tokens of whole conversations of ``lengths`` tokens each."""
    if overlong not in ("drop", "truncate"):
        raise ValueError(f"overlong must be drop or truncate, got {overlong!r}")
    lengths = np.asarray(lengths, dtype=np.int64)
    order = np.random.Generator(np.random.PCG64([seed, _PACK_KEY])).permutation(len(lengths))
    taken = np.minimum(lengths[order], seq_len)
    long = lengths[order] > seq_len
    keep = ~long if overlong == "drop" else np.ones(len(order), dtype=bool)
    order, taken = order[keep], taken[keep]
    # Next-fit: a row closes when the next conversation would overflow it. A Python loop over
    # conversations, once per process (a million take about a second).
    starts, fill = [0], 0
    for i, n in enumerate(taken.tolist()):
        if fill + n > seq_len:
            starts.append(i)
            fill = 0
        fill += n
    starts.append(len(order))
    if len(order) == 0:
        raise DataError(f"no conversation fits data.seq_len={seq_len} (all {len(lengths)} are longer; "
                        "set data.chat_overlong: truncate or raise data.seq_len)")
    num_long = int(long.sum())
    return ConversationRows(
        conversations=order.astype(np.int64), lengths=taken, starts=np.asarray(starts, dtype=np.int64),
        total=len(lengths), dropped=num_long if overlong == "drop" else 0,
        truncated=num_long if overlong == "truncate" else 0,
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
