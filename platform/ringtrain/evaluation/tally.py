"""LossTally: summed next-token losses and label counts per position bucket, and per row.

Each rank tallies the predictions it holds; tallies add up (``merge``) to the world's. The
loss is the sum over every labelled prediction divided by their number: the mean that
transformers computes with ``labels=input_ids`` over all rows at once (not a mean of row means).
Each row's own sum and count are kept too (a row's predictions may lie on several CP ranks):
``sequence_loss`` is the mean of the rows' means, what ``train.loss_norm: sequence`` trains on
when each row is one conversation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

from ringtrain.evaluation.buckets import bucket, bucket_index


@dataclass
class LossTally:
    bucket_tokens: int  # the first bucket's size (see ``buckets``)
    sums: list[float] = field(default_factory=list)  # summed loss per bucket
    counts: list[int] = field(default_factory=list)  # labelled predictions per bucket
    rows: dict[int, tuple[float, int]] = field(default_factory=dict)  # row index -> (summed loss, predictions)

    def __post_init__(self) -> None:
        if len(self.sums) != len(self.counts):
            raise ValueError(f"{len(self.sums)} bucket sums but {len(self.counts)} counts")

    def _grow(self, buckets: int) -> None:
        while len(self.sums) < buckets:
            self.sums.append(0.0)
            self.counts.append(0)

    def add(self, position: int, loss: float) -> None:
        """One prediction made at ``position``."""
        self.add_bucket(bucket_index(position, self.bucket_tokens), loss, 1)

    def add_bucket(self, index: int, loss_sum: float, count: int) -> None:
        self._grow(index + 1)
        self.sums[index] += float(loss_sum)
        self.counts[index] += int(count)

    def add_all(self, sums: Sequence[float], counts: Sequence[int]) -> None:
        """Per-bucket sums and counts (bucket 0 first), as a rank's array reduction gives them."""
        for index, (s, c) in enumerate(zip(sums, counts, strict=True)):
            if c:
                self.add_bucket(index, s, c)

    def add_row(self, row: int, loss_sum: float, count: int) -> None:
        """Predictions of row ``row`` (this rank's share of it)."""
        if count:
            before = self.rows.get(row, (0.0, 0))
            self.rows[row] = (before[0] + float(loss_sum), before[1] + int(count))

    def merge(self, other: "LossTally") -> "LossTally":
        if other.bucket_tokens != self.bucket_tokens:
            raise ValueError(f"bucket sizes differ: {self.bucket_tokens} and {other.bucket_tokens}")
        out = LossTally(self.bucket_tokens, list(self.sums), list(self.counts), dict(self.rows))
        out.add_all(other.sums, other.counts)
        for row, (loss_sum, count) in other.rows.items():
            out.add_row(row, loss_sum, count)
        return out

    @property
    def tokens(self) -> int:
        return sum(self.counts)

    @property
    def loss(self) -> float:
        return math.fsum(self.sums) / self.tokens if self.tokens else math.nan

    @property
    def perplexity(self) -> float:
        return perplexity(self.loss)

    @property
    def sequence_loss(self) -> float:
        """The mean over rows with a prediction of each row's mean loss."""
        means = [loss_sum / count for loss_sum, count in self.rows.values() if count]
        return math.fsum(means) / len(means) if means else math.nan

    def by_position(self) -> list[dict[str, Any]]:
        """One entry per bucket up to the last that holds predictions: {start, end, loss, tokens}."""
        last = max((i for i, c in enumerate(self.counts) if c), default=-1)
        out = []
        for i in range(last + 1):
            b = bucket(i, self.bucket_tokens)
            count = self.counts[i]
            out.append({"start": b.start, "end": b.end, "loss": self.sums[i] / count if count else None, "tokens": count})
        return out


def perplexity(loss: float) -> float:
    """exp(loss); inf where that overflows (a diverged model), nan for an empty tally."""
    if math.isnan(loss):
        return math.nan
    try:
        return math.exp(loss)
    except OverflowError:
        return math.inf


def merge_all(tallies: Sequence[LossTally]) -> LossTally:
    if not tallies:
        raise ValueError("no tallies to merge")
    out = LossTally(tallies[0].bucket_tokens)
    for t in tallies:
        out = out.merge(t)
    return out
