"""The snapshots of a simulated world (``actors.simulated``), held as the workers and the node
holders hold them on Ray, so a recovery plan (``policies.recovery``) reads them as it reads a
WorkerGroup's.

Each snapshot is the data cursor after its step and the world size that took it. Every rank
keeps the snapshots of its own world in memory, as many as ``checkpoint.keep_in_memory`` and
the pinned one (``checkpoint.retention``); a rank's node holder and its buddy node's holder
(``policies.snapshots.buddy_node``) keep its shards of the snapshots that reached them
(``safe``). A shard that never left its rank (``unsent``: the rank died with it) is in that
rank's memory only; a node found gone takes its holder's copies with it; a survivor that can
write a dead rank's shard from its own replica of the state (ZeRO-0) offers it as a rebuild.
Ranks sit ``ranks_per_node`` to a node, in rank order.
"""

from __future__ import annotations

from typing import Optional

from ringtrain.checkpoint.retention import retained
from ringtrain.policies.snapshots import Holding, Source, buddy_node, node_at, peer_at
from ringtrain.topology import Topology


class SimulatedSnapshots:
    def __init__(self, *, cp: int, ranks_per_node: int, keep: Optional[int], buddy: bool = True) -> None:
        """``keep``: the snapshots each rank and holder keeps (None: all); ``buddy``: a second
        copy on another node (``checkpoint.buddy``)."""
        self.cp, self.ranks_per_node, self.keep, self.buddy = cp, ranks_per_node, keep, buddy
        self.cursors = {0: 0}  # step -> data cursor after it; step 0 is the initial state
        self.worlds: dict[int, int] = {}  # step -> the world size that took its snapshot
        self.pinned: Optional[int] = None
        self.safe = 0  # the newest step whose snapshots reached the holders
        self.unsent: set[tuple[int, int]] = set()  # (step, rank) shards that never left their rank
        self.rebuildable: Optional[tuple[int, int]] = None  # (step, world) the survivors can write any shard of
        self.gone: set[str] = set()  # nodes found gone, with their holders

    def node_of(self, rank: int) -> str:
        return f"node-{rank // self.ranks_per_node}"

    def take(self, step: int, cursor: int, world: int) -> None:
        self.cursors[step] = cursor
        self.worlds[step] = world
        self._trim()

    def pin(self, step: int) -> None:
        self.pinned = step
        self._trim()

    def _trim(self) -> None:
        if self.keep is not None:
            held = retained(self.cursors, keep=self.keep, pin=self.pinned)
            self.cursors = {s: c for s, c in self.cursors.items() if s in held}

    def restore(self, step: int, world: int) -> int:
        """A new world at ``step``'s state (0: the initial state): later snapshots describe a
        future rolled back, and the restored state is a snapshot of the new world, in its ranks'
        memories and its holders. Returns the data cursor."""
        cursor = self.cursors[step] if step else 0
        self.cursors = {s: c for s, c in self.cursors.items() if s <= step}
        if step:
            self.worlds[step] = world
        self.safe = step
        self.unsent.clear()
        self.rebuildable, self.gone = None, set()
        return cursor

    def holdings(self, readers: frozenset[int], world: int) -> list[Holding]:
        """What the memories of ``readers`` (ranks of the current ``world``) and the live node
        holders hold."""
        steps = sorted(s for s in self.cursors if s > 0)
        own = [s for s in steps if self.worlds[s] == world]
        rebuilds = (self.rebuildable,) if self.rebuildable is not None else ()
        peers = [
            Holding(Source.PEER, peer_at(r), frozenset((s, r) for s in own), tuple((s, world) for s in own), rebuilds)
            for r in sorted(readers)
        ]
        held: dict[str, set[tuple[int, int]]] = {}
        landed = [s for s in steps if s <= self.safe]
        for step in landed:
            for rank, node in self._copies(step):
                if node not in self.gone and (step, rank) not in self.unsent:
                    held.setdefault(node, set()).add((step, rank))
        worlds = tuple((s, self.worlds[s]) for s in landed)
        return peers + [Holding(Source.NODE, node_at(node), frozenset(shards), worlds) for node, shards in held.items()]

    def _copies(self, step: int) -> list[tuple[int, str]]:
        """(rank, node) of every holder copy of ``step``'s shards: the rank's own node's and its
        buddy node's."""
        world = self.worlds[step]
        topology = Topology(world // self.cp, self.cp)
        rank_nodes = [self.node_of(r) for r in range(world)]
        nodes = list(dict.fromkeys(rank_nodes))
        out = []
        for rank, node in enumerate(rank_nodes):
            out.append((rank, node))
            buddy = buddy_node(rank, topology, rank_nodes, nodes) if self.buddy else None
            if buddy is not None:
                out.append((rank, buddy))
        return out
