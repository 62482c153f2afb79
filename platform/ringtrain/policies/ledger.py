"""Sample ledger: which global samples the kept steps trained on. Pure.

The proof that failures and resizes lose and repeat nothing: every step's samples are written
down when the step completes, struck out when a rollback discards the step, and at the end
each sample of the batches the run consumed must appear exactly once (or be listed as skipped,
when ``controllers.on_nan=skip`` dropped a poisoned batch). With prepared datasets it also
keeps where each sample came from: its source and the document its window starts in.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class SampleLedger:
    steps: dict[int, tuple[int, ...]] = field(default_factory=dict)  # kept step -> its samples
    skipped: list[int] = field(default_factory=list)
    origins: dict[int, tuple[int, int]] = field(default_factory=dict)  # sample -> (source, document)

    def record(self, step: int, samples: tuple[int, ...], origins: tuple[tuple[int, int], ...] = ()) -> None:
        self.steps[step] = samples
        self.origins.update(zip(samples, origins))

    def samples_by_source(self) -> dict[int, int]:
        """Kept samples per source (prepared datasets only)."""
        return dict(Counter(self.origins[s][0] for samples in self.steps.values() for s in samples if s in self.origins))

    def rollback(self, to_step: int) -> list[int]:
        """Strike out steps after ``to_step``; returns the steps struck."""
        gone = sorted(s for s in self.steps if s > to_step)
        for s in gone:
            del self.steps[s]
        return gone

    def skip(self, samples: range) -> None:
        self.skipped.extend(samples)

    def totals(self) -> dict[str, int]:
        counts = Counter(s for samples in self.steps.values() for s in samples)
        accounted = set(counts) | set(self.skipped)
        span = (max(accounted) - min(accounted) + 1) if accounted else 0
        # A skipped sample a kept step trained all the same was consumed twice: its skip failed.
        consumed = counts + Counter(set(self.skipped))
        return {
            "steps": len(self.steps),
            "samples": len(counts),
            "duplicates": sum(n - 1 for n in consumed.values() if n > 1),
            "skipped": len(set(self.skipped)),
            "missing": span - len(accounted),
        }
