"""The kinds of incident: one list for the policies that raise them, the metric that counts them,
the dashboards and the report that show them."""

from __future__ import annotations

import enum


class Kind(enum.Enum):
    CRASH = "crash"  # worker processes died
    NODE_LOST = "node_lost"  # a whole node went with its workers
    HANG = "hang"  # workers stopped answering or never finished the step
    ERROR = "error"  # an exception in the step (user code, data, a collective without a dead peer)
    NAN = "nan"  # a non-finite loss
    SDC = "sdc"  # a rank failed a silent-data-corruption scan
    STRAGGLER = "straggler"  # a rank persistently slower than its peers (policies.stragglers)


# The kinds as written in incident files and metric labels, in declaration order.
INCIDENT_KINDS: tuple[str, ...] = tuple(kind.value for kind in Kind)
