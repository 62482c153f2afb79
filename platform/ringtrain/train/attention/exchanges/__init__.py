"""How K/V reach the ranks whose queries see them: one strategy a module, chosen by name.

An exchange says which K/V a rank visits and in what order (``visits``: each visit's source, its
blocks and its columns' positions and documents), moves them (``forward``: yields each visit's K
and V as they arrive, the next one in flight meanwhile) and brings each visit's dK/dV home
(``backward``). The loop (``loop``) does the rest, the same for every exchange. The registry
below is the one list of them; ``call.choose_exchange`` picks one by name and layout.

Adding an exchange is a module here with one ``Exchange`` subclass and a line in ``EXCHANGES``
(and its name in ``config.KV_EXCHANGES`` where a job may ask for it by name; ``choose_exchange``
changes only where ``auto`` should pick it).
"""

from __future__ import annotations

from collections.abc import Mapping

from ringtrain.train.attention.exchanges.allgather import AllGatherExchange
from ringtrain.train.attention.exchanges.base import Exchange, VisitSpec
from ringtrain.train.attention.exchanges.local import LocalExchange
from ringtrain.train.attention.exchanges.neighbours import NeighbourExchange
from ringtrain.train.attention.exchanges.ring import RingExchange

EXCHANGES: Mapping[str, type[Exchange]] = {
    "local": LocalExchange,
    "ring": RingExchange,
    "allgather": AllGatherExchange,
    "neighbours": NeighbourExchange,
}

__all__ = ["EXCHANGES", "Exchange", "VisitSpec"]
