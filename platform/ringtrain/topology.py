"""The dp x cp grid as pure math: rank <-> coordinates, process-group membership, sequence layout.

Rank order: ``rank = replica * cp + ring_pos``, so one replica's context-parallel ring is a
block of consecutive ranks (one placement group, one node when it fits). Inside a ring,
``ring_pos = ring_idx * ulysses + ulysses_idx``: Ulysses groups are consecutive ranks, so the
all-to-all stays on the fastest links while the ring P2P may cross them.

Sequence layout within one CP group (what the data loader produces and the attention plugin
expects): the sequence is cut into ``2 * ring`` chunks; ring index r holds chunks r and
``2*ring-1-r`` (zigzag, so causal work is balanced); that ring shard is split contiguously into
``ulysses`` parts and Ulysses index u holds part u. So every sequence length a CP group of ``cp``
ranks takes is a multiple of ``2 * cp`` (``CPLayout.sequence_multiple``, ``.sequence_multiple_of``),
and a sequence is padded up to one (``CPLayout.padded_length``, ``round_up``).

Which context parallelism runs is one value, ``CPLayout``, built from a job by ``cp_layout``
alone: attention, the trainer, the planner, evaluation and the config checks read it, and none
of them decides it again from ``attention.impl`` or from the size of a group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ringtrain.errors import ConfigError

# What a CP layout runs (``CPLayout.runs``), declared once: attention.impl names the first three
# (config's ATTENTION_IMPLS), and a CP group of one rank runs the last. train/attention keys its
# implementations by them.
RING, ULYSSES, HYBRID, LOCAL = "ring", "ulysses", "hybrid", "local"
ATTENTION_IMPLS = (RING, ULYSSES, HYBRID)
LOCAL_ATTENTION_IMPL = LOCAL


@dataclass(frozen=True)
class CPLayout:
    """Which context parallelism runs: a CP group of ``ring x ulysses`` ranks whose Ulysses groups
    (``ulysses`` consecutive ranks) exchange heads all-to-all, and whose rings (``ring`` ranks)
    pass K/V as ``kv_exchange`` asks (``attention.kv_exchange``; train/attention/call.py's
    ``choose_exchange`` picks from it per call, by the block's length and window).

    A group of one rank runs nothing of its own (``runs``): the ring alone where the Ulysses
    groups are one rank, Ulysses alone where the rings are, plain local attention where both are.
    A job's layout comes from ``cp_layout`` (``JobConfig.cp_layout``); the planner makes one of
    the degrees it proposes.
    """

    ring: int
    ulysses: int
    kv_exchange: str = "auto"

    def __post_init__(self) -> None:
        if self.ring < 1 or self.ulysses < 1:
            raise ValueError(f"invalid CP layout ring={self.ring} ulysses={self.ulysses}")

    @property
    def cp(self) -> int:
        return self.ring * self.ulysses

    @staticmethod
    def sequence_multiple_of(cp: int) -> int:
        """What every sequence length a CP group of ``cp`` ranks takes is a multiple of, whatever
        its ring and Ulysses degrees: each rank holds two of the sequence's chunks (zigzag, the
        causal load balance), its ring shard split over its Ulysses group. For a bare degree (the
        planner's search, a job not yet checked); ``sequence_multiple`` where a layout is at hand."""
        return 2 * cp

    @property
    def sequence_multiple(self) -> int:
        """What every sequence length this layout shards is a multiple of."""
        return self.sequence_multiple_of(self.cp)

    def padded_length(self, length: int) -> int:
        """The slots a sequence of ``length`` tokens takes under this layout: ``length`` rounded
        up to ``sequence_multiple``."""
        return round_up(length, self.sequence_multiple)

    @property
    def runs(self) -> str:
        """What each rank runs: ``RING``, ``ULYSSES``, ``HYBRID`` or, in a CP group of one rank,
        ``LOCAL``."""
        if self.ring == 1:
            return LOCAL if self.ulysses == 1 else ULYSSES
        return RING if self.ulysses == 1 else HYBRID

    @property
    def has_ring(self) -> bool:
        """Whether K/V pass between ranks along rings (the ring alone, or the hybrid's)."""
        return self.ring > 1

    @property
    def splits_heads(self) -> bool:
        """Whether ranks exchange heads all-to-all (Ulysses alone, or the hybrid's)."""
        return self.ulysses > 1

    @property
    def impl(self) -> str:
        """The ``attention.impl`` that asks for this layout (for a CP group of one rank, the
        default's: ring)."""
        runs = self.runs
        return RING if runs == LOCAL else runs


def round_up(length: int, multiple: int) -> int:
    """``length`` rounded up to a multiple of ``multiple`` (a sequence, or a count of rows, padded)."""
    return -(-length // multiple) * multiple


def cp_layout(impl: str, cp: int, ulysses: Optional[int], kv_exchange: str = "auto") -> CPLayout:
    """The CP layout a job asks for with ``attention.impl``, ``mesh.cp``, ``mesh.ulysses`` and
    ``attention.kv_exchange``; pure. The one place that reads the implementation's name.

    ``mesh.ulysses`` unset is 1 for ring and ``mesh.cp`` for ulysses; hybrid needs it set, between
    1 and ``mesh.cp``. Raises ConfigError naming the key to change where the values disagree.
    """
    if impl not in ATTENTION_IMPLS:
        raise ConfigError("attention.impl", f"{impl!r} is not one of {', '.join(ATTENTION_IMPLS)}")
    if not cp >= 1:
        raise ConfigError("mesh.cp", f"must be >= 1 (got {cp})")
    if ulysses is not None:
        if not ulysses >= 1:
            raise ConfigError("mesh.ulysses", f"must be >= 1 (got {ulysses})")
        if cp % ulysses:
            raise ConfigError("mesh.ulysses", f"{ulysses} does not divide mesh.cp={cp} (ring degree = cp / ulysses)")
        if impl == RING and ulysses != 1:
            raise ConfigError("mesh.ulysses", f"attention.impl=ring needs mesh.ulysses=1 (got {ulysses}); use hybrid")
        if impl == ULYSSES and ulysses != cp:
            raise ConfigError("mesh.ulysses", f"attention.impl=ulysses needs mesh.ulysses=mesh.cp={cp} (got {ulysses})")
    if impl == HYBRID:
        if ulysses is None:
            raise ConfigError("mesh.ulysses", "attention.impl=hybrid needs the ulysses degree inside the ring set")
        if not 1 < ulysses < cp:
            raise ConfigError("mesh.ulysses",
                              f"attention.impl=hybrid needs 1 < mesh.ulysses < mesh.cp={cp} (got {ulysses})")
    if ulysses is None:
        ulysses = cp if impl == ULYSSES else 1
    return CPLayout(cp // ulysses, ulysses, kv_exchange)


@dataclass(frozen=True)
class RankCoord:
    rank: int
    replica: int  # data-parallel index
    ring_pos: int  # position inside the replica's CP group, 0..cp-1
    ring_idx: int  # index along the ring (P2P) dimension
    ulysses_idx: int  # index along the Ulysses (all-to-all) dimension


@dataclass(frozen=True)
class Topology:
    dp: int
    cp: int
    ulysses: int = 1

    def __post_init__(self) -> None:
        if self.dp < 1 or self.cp < 1 or self.ulysses < 1 or self.cp % self.ulysses:
            raise ValueError(f"invalid topology dp={self.dp} cp={self.cp} ulysses={self.ulysses}")

    @property
    def ring(self) -> int:
        return self.cp // self.ulysses

    @property
    def world_size(self) -> int:
        return self.dp * self.cp

    def coord(self, rank: int) -> RankCoord:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world of {self.world_size}")
        replica, ring_pos = divmod(rank, self.cp)
        ring_idx, ulysses_idx = divmod(ring_pos, self.ulysses)
        return RankCoord(rank, replica, ring_pos, ring_idx, ulysses_idx)

    def rank_of(self, replica: int, ring_pos: int) -> int:
        return replica * self.cp + ring_pos

    def replica_ranks(self, replica: int) -> list[int]:
        """The CP group of one replica."""
        return [self.rank_of(replica, p) for p in range(self.cp)]

    def cp_groups(self) -> list[list[int]]:
        return [self.replica_ranks(d) for d in range(self.dp)]

    def dp_groups(self) -> list[list[int]]:
        """Ranks holding the same sequence shard in every replica (ZeRO's data-parallel peers)."""
        return [[self.rank_of(d, p) for d in range(self.dp)] for p in range(self.cp)]

    def ring_groups(self) -> list[list[int]]:
        """Per replica and Ulysses index: the ranks that pass K/V around the ring."""
        return [
            [self.rank_of(d, r * self.ulysses + u) for r in range(self.ring)]
            for d in range(self.dp)
            for u in range(self.ulysses)
        ]

    def ulysses_groups(self) -> list[list[int]]:
        """Per replica and ring index: the ranks of one all-to-all."""
        return [
            [self.rank_of(d, r * self.ulysses + u) for u in range(self.ulysses)]
            for d in range(self.dp)
            for r in range(self.ring)
        ]

    def ring_neighbours(self, rank: int) -> tuple[int, int]:
        """(previous, next) rank along this rank's ring."""
        c = self.coord(rank)
        prev_idx, next_idx = (c.ring_idx - 1) % self.ring, (c.ring_idx + 1) % self.ring
        return (
            self.rank_of(c.replica, prev_idx * self.ulysses + c.ulysses_idx),
            self.rank_of(c.replica, next_idx * self.ulysses + c.ulysses_idx),
        )


def zigzag_chunks(ring: int, ring_idx: int) -> tuple[int, int]:
    """The two of the ``2 * ring`` sequence chunks that ring index ``ring_idx`` holds."""
    return ring_idx, 2 * ring - 1 - ring_idx


def sequence_spans(seq_len: int, ring: int, ulysses: int, ring_idx: int, ulysses_idx: int) -> list[tuple[int, int]]:
    """Half-open ``[start, stop)`` token spans, in order, that one CP rank holds of a sequence."""
    if seq_len % (2 * ring) or (seq_len // ring) % ulysses:
        raise ValueError(f"seq_len {seq_len} does not split into 2x{ring} ring chunks and {ulysses} ulysses parts")
    chunk = seq_len // (2 * ring)
    ring_shard = [(c * chunk, (c + 1) * chunk) for c in zigzag_chunks(ring, ring_idx)]
    part = seq_len // ring // ulysses
    lo, hi = ulysses_idx * part, (ulysses_idx + 1) * part
    spans: list[tuple[int, int]] = []
    offset = 0  # position of each chunk inside the concatenated ring shard
    for start, stop in ring_shard:
        a, b = max(lo, offset), min(hi, offset + (stop - start))
        if a < b:
            spans.append((start + a - offset, start + b - offset))
        offset += stop - start
    return spans


def sequence_positions(seq_len: int, ring: int, ulysses: int, ring_idx: int, ulysses_idx: int) -> list[int]:
    """The token positions one CP rank holds, in its local order."""
    return [p for a, b in sequence_spans(seq_len, ring, ulysses, ring_idx, ulysses_idx) for p in range(a, b)]
