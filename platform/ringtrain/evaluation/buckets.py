"""Position buckets: which range of positions each next-token loss is counted in.

A prediction made at position ``p`` (from tokens ``0..p``, of token ``p + 1``) lands in bucket 0
when ``p < first`` and in bucket ``k`` when ``first * 2**(k-1) <= p < first * 2**k``: with
``first = 1024`` the buckets are 0-1K, 1-2K, 2-4K, 4-8K, ... A long-context model's loss should
fall (or at least not rise) from one bucket to the next.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Bucket:
    """Positions ``[start, end)``."""

    start: int
    end: int

    @property
    def label(self) -> str:
        return f"{short_count(self.start)}-{short_count(self.end)}"


def bucket_index(position: int, first: int) -> int:
    """The bucket of a prediction made at ``position``."""
    if position < 0 or first < 1:
        raise ValueError(f"position {position} and first bucket size {first} must be >= 0 and >= 1")
    # (p // first) is 0 in the first bucket and in [2**(k-1), 2**k) in bucket k.
    return (position // first).bit_length()


def num_buckets(seq_len: int, first: int) -> int:
    """How many buckets the positions ``0..seq_len-1`` span."""
    return bucket_index(max(seq_len - 1, 0), first) + 1


def bucket(index: int, first: int) -> Bucket:
    if index == 0:
        return Bucket(0, first)
    return Bucket(first << (index - 1), first << index)


def short_count(n: int) -> str:
    """1024 -> 1K, 131072 -> 128K, 1536 -> 1.5K; other numbers as they are."""
    for size, suffix in ((1 << 20, "M"), (1 << 10, "K")):
        if n >= size and (n * 10) % size == 0:
            value = n / size
            return f"{value:g}{suffix}"
    return str(n)
