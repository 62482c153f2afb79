"""What the attention benches hold one rank's share of ring attention to.

The ratio is one monolithic causal kernel's time over the whole sequence, divided by the ranks
(zigzag balances the causal work exactly), over the worst rank's time: 1.0 is a ring that costs
nothing beyond its share of the work. bench/attention.py holds the better K/V exchange's worst
rank to these targets, and bench/attention_launches.py its time with the host taken out.
"""

from __future__ import annotations

from typing import Optional

# The K/V exchanges the benches time, each against the targets.
EXCHANGES = ("ring", "allgather")
# (tokens a rank at least, forward and backward ratio at least) of the better exchange.
RATIO_TARGETS = ((8192, 0.95), (4096, 0.85), (2048, 0.70))


def ratio_target(tokens_per_rank: int) -> Optional[float]:
    """The ratio a rank of ``tokens_per_rank`` is held to (None below the smallest size)."""
    return next((ratio for floor, ratio in RATIO_TARGETS if tokens_per_rank >= floor), None)
