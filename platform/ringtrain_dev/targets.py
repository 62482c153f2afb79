"""A bench's targets: each a measured value against its bound, and its verdict (none on a CPU
smoke run, which measures nothing)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

# Printed where a verdict would be: a CPU run checks the code path, it measures nothing.
SMOKE = "cpu smoke, not a measurement"


@dataclass(frozen=True)
class Target:
    """One target of one shape: its measured value against its bound."""

    shape: str
    what: str
    value: Optional[float]  # None: not measured (``missing`` says why)
    bound: float
    unit: str = ""  # "" a ratio, "x" a ratio of sizes, "%" (value and bound are fractions), "tokens", "count"
    at_most: bool = False
    missing: str = ""

    @property
    def met(self) -> bool:
        if self.value is None:
            return False
        return self.value <= self.bound if self.at_most else self.value >= self.bound

    def _show(self, value: float) -> str:
        if self.unit == "%":
            return f"{value:.1%}"
        if self.unit == "tokens":
            return f"{value:,.0f} tokens"
        if self.unit == "count":
            return f"{value:.0f}"
        if self.unit == "x":
            return f"{value:.2f}x"
        return f"{value:.3f}"

    def line(self, smoke: bool) -> str:
        value = f"not measured ({self.missing})" if self.value is None else self._show(self.value)
        verdict = SMOKE if smoke else "PASS" if self.met else "MISS"
        return f"{self.shape}: {self.what} {value} (target {'<=' if self.at_most else '>='} {self._show(self.bound)}): {verdict}"
