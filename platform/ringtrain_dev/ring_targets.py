"""What the attention benches hold one rank's share of ring attention to, and what they hold
``attention.kv_exchange=auto``'s choice to.

The ratio is one monolithic causal kernel's time over the whole sequence, divided by the ranks
(zigzag balances the causal work exactly), over the worst rank's time: 1.0 is a ring that costs
nothing beyond its share of the work. bench/attention.py holds the better K/V exchange's worst
rank to these targets, and bench/attention_launches.py its time with the host taken out.

Where a bench times every exchange at a size, ``auto_checks`` asks the product's own choice
(``choose_exchange``) which one ``auto`` runs there and holds that one's time to the best one's:
a pick more than ``AUTO_SLOWER_MAX`` slower is a MISS, so each GPU run says where the rule's
thresholds (``call.ALLGATHER_FROM_RANKS``, ``call.ALLGATHER_BELOW_TOKENS``) need re-fitting.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Optional

from ringtrain.train.attention.call import choose_exchange
from ringtrain_dev.targets import SMOKE

# The K/V exchanges the benches time, each against the targets.
EXCHANGES = ("ring", "allgather")
# (tokens a rank at least, forward and backward ratio at least) of the better exchange.
RATIO_TARGETS = ((8192, 0.95), (4096, 0.85), (2048, 0.70))
# auto's pick against the best exchange measured at a size: its time over the best one's, at most.
AUTO_SLOWER_MAX = 1.05


def ratio_target(tokens_per_rank: int) -> Optional[float]:
    """The ratio a rank of ``tokens_per_rank`` is held to (None below the smallest size)."""
    return next((ratio for floor, ratio in RATIO_TARGETS if tokens_per_rank >= floor), None)


@dataclass(frozen=True)
class AutoCheck:
    """At one size (a ring of ``ring`` ranks, ``tokens_per_rank`` tokens each): the exchange
    ``auto`` picks, the fastest one measured, and their times (ms)."""

    seq: int
    ring: int
    tokens_per_rank: int
    pick: str
    best: str
    pick_ms: float
    best_ms: float

    @property
    def slower(self) -> float:
        """auto's pick's time over the best one's (1.0: it picked the best)."""
        return self.pick_ms / self.best_ms

    @property
    def met(self) -> bool:
        return self.slower <= AUTO_SLOWER_MAX

    def what(self) -> str:
        return (f"auto at {self.tokens_per_rank} tokens a rank (ring {self.ring}) picks {self.pick} "
                f"({self.pick_ms:.2f} ms), the best measured is {self.best} ({self.best_ms:.2f} ms): "
                f"{self.slower:.2f}x (<= {AUTO_SLOWER_MAX})")

    def line(self, smoke: bool) -> str:
        return f"{SMOKE if smoke else 'PASS' if self.met else 'MISS'}: {self.what()}"

    def record(self) -> dict[str, Any]:
        return {**asdict(self), "slower": self.slower, "met": self.met}


def auto_checks(rows: Sequence[Mapping[str, Any]], time_ms: Callable[[Mapping[str, Any]], float]) -> list[AutoCheck]:
    """Per size of ``rows`` (each a bench row with ``seq``, ``ring``, ``tokens_per_rank`` and
    ``exchange``), auto's pick against the fastest exchange by ``time_ms``; a size where auto's
    pick was not timed is left out."""
    by_size: dict[tuple[int, int], dict[str, Mapping[str, Any]]] = {}
    for row in rows:
        by_size.setdefault((row["seq"], row["ring"]), {})[row["exchange"]] = row
    checks = []
    for (seq, ring), timed in sorted(by_size.items(), key=lambda item: (item[0][0] // item[0][1], item[0][1])):
        tokens = seq // ring
        pick = choose_exchange("auto", ring, tokens, None)
        if pick not in timed:
            continue
        best = min(timed, key=lambda exchange: time_ms(timed[exchange]))
        checks.append(AutoCheck(seq, ring, tokens, pick, best, time_ms(timed[pick]), time_ms(timed[best])))
    return checks
