"""Snapshot policy: when to persist, and which copy of the state to restore from.

Sources are tried newest step first; at equal steps the cheapest wins: a peer's memory (no
disk, often no network hop), then this node's holder, then the durable store. A step counts
only when every rank's shard of it is present in that source. Each snapshot is also kept on a
buddy node (``buddy_node``), so a lost node's ranks can be restored.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

from ringtrain.topology import Topology


class Source(enum.IntEnum):
    """Where a snapshot lives; lower is cheaper to restore from."""

    PEER = 0
    NODE = 1
    DURABLE = 2


@dataclass(frozen=True)
class Candidate:
    source: Source
    step: int
    ranks: frozenset[int]  # ranks whose shard of ``step`` this source holds
    world_size: int  # how many ranks wrote the snapshot
    location: str  # holder name or checkpoint uri, for logs

    @property
    def complete(self) -> bool:
        return self.ranks == frozenset(range(self.world_size))


def choose_restore_point(candidates: Iterable[Candidate]) -> Optional[Candidate]:
    """The newest complete snapshot, from the cheapest source that has it."""
    complete = [c for c in candidates if c.complete]
    if not complete:
        return None
    return min(complete, key=lambda c: (-c.step, c.source))


def persist_due(step: int, *, persist_every: int, final_step: int) -> bool:
    """Persist every ``persist_every`` steps, and always the last step of the run."""
    return step == final_step or (persist_every > 0 and step % persist_every == 0)


# The kinds of place a restore plan reads a shard from (``Location``).
PEER, NODE, REBUILD = "peer", "node", "rebuild"


@dataclass(frozen=True)
class Location:
    """Where a restore plan reads a shard, as a holding's ``location`` and a plan's ``fetch`` name
    it in text (``<kind>:<name>``; ``peer_at``, ``node_at``, ``rebuilt_by`` write it): a
    survivor's memory (``peer:<rank>``), a node's holder (``node:<node id>``), or a survivor that
    writes the shard from its live state (``rebuild:peer:<rank>``)."""

    kind: str  # PEER, NODE or REBUILD
    name: str  # the rank, the node id, or the location of the survivor that rebuilds

    @classmethod
    def parse(cls, text: str) -> Location:
        kind, _, name = text.partition(":")
        return cls(kind, name)

    def __str__(self) -> str:
        return f"{self.kind}:{self.name}"

    @property
    def rank(self) -> int:
        """The rank of the survivor that serves the shard: a peer, or the one that rebuilds it."""
        return int(self.name.rpartition(":")[2])


def peer_at(rank: int) -> str:
    return str(Location(PEER, str(rank)))


def node_at(node: str) -> str:
    return str(Location(NODE, node))


def rebuilt_by(survivor: str) -> str:
    """The location of a shard the survivor at ``survivor`` (a peer's location) rebuilds."""
    return str(Location(REBUILD, survivor))


@dataclass(frozen=True)
class Holding:
    """One place that can hand over snapshot shards: a live worker (PEER) or a node's holder."""

    source: Source
    location: str  # where it is (``Location``'s text), for logs and for fetching
    shards: frozenset[tuple[int, int]]  # (step, rank) pairs it holds
    world_sizes: tuple[tuple[int, int], ...] = ()  # (step, world size of that step's snapshot)
    # (step, world size): a live survivor whose own state is still that step's and holds every
    # rank's share of it (ZeRO-0 replicates the whole state across ranks), so it can write any
    # rank's shard of that step; used for shards no holding has (one lost in transit).
    rebuilds: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True)
class RestorePlan:
    step: int
    world_size: int
    fetch: tuple[tuple[int, str], ...]  # per old rank, in rank order: (rank, location)


def plan_restore(holdings: Iterable[Holding], *, newest: Optional[int] = None) -> Optional[RestorePlan]:
    """The newest step (at most ``newest``) of which every rank's shard can be fetched from
    some holding, each shard from the cheapest place that has it; None when no step is whole.

    Shards of one step may come from different places: a survivor's own memory for its rank,
    a holder for the rank that died, or (ZeRO-0) a survivor that writes the dead rank's shard
    from its own replica of the state (``Holding.rebuilds``): then a rank that died before its
    newest snapshot reached a holder costs no step.
    """
    holdings = sorted(holdings, key=lambda h: h.source)
    worlds: dict[int, int] = {}
    cheapest: dict[tuple[int, int], str] = {}  # (step, rank) -> the cheapest place holding it
    for h in holdings:
        worlds.update(h.world_sizes)
        for shard in h.shards:
            cheapest.setdefault(shard, h.location)
    for step in sorted(worlds, reverse=True):
        if newest is not None and step > newest:
            continue
        # A copy beats a rebuild (no work on the survivor), and a rebuild beats an older step.
        rebuilder = next((h.location for h in holdings if (step, worlds[step]) in h.rebuilds), None)
        fetch = []
        for rank in range(worlds[step]):
            where = cheapest.get((step, rank))
            if where is None and rebuilder is not None:
                where = rebuilt_by(rebuilder)
            if where is None:
                break
            fetch.append((rank, where))
        else:
            return RestorePlan(step, worlds[step], tuple(fetch))
    return None


def buddy_node(rank: int, topology: Topology, rank_nodes: Sequence[str], nodes: Sequence[str]) -> Optional[str]:
    """Another node to keep a copy of ``rank``'s snapshots: the node of the same ring position in
    the next replica when that is elsewhere (spreads the copies evenly), else any other node."""
    own = rank_nodes[rank]
    c = topology.coord(rank)
    peer = rank_nodes[topology.rank_of((c.replica + 1) % topology.dp, c.ring_pos)]
    if peer != own:
        return peer
    others = [n for n in nodes if n != own]
    return others[rank % len(others)] if others else None
