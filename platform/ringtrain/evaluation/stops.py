"""Where a generated continuation ends: at an end-of-sequence token or at a stop string; pure.

A row stops at the first new token that is one of ``eos_ids`` (kept, as transformers'
``generate`` keeps it) or whose text completes one of ``strings``; its text is cut before the
first stop string (as lm-evaluation-harness' ``until`` cuts it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

# Token ids -> their text (a tokenizer's decode).
Decode = Callable[[list[int]], str]


@dataclass(frozen=True)
class StopRule:
    eos_ids: frozenset[int] = frozenset()
    strings: tuple[str, ...] = ()

    def stopped(self, new_ids: Sequence[int], decode: Decode | None) -> bool:
        """Whether a row that wrote ``new_ids`` so far is done."""
        if not new_ids:
            return False
        if new_ids[-1] in self.eos_ids:
            return True
        if not self.strings or decode is None:
            return False
        text = decode(list(new_ids))
        return any(s in text for s in self.strings)

    def cut(self, text: str) -> str:
        """``text`` up to the first stop string."""
        ends = [i for i in (text.find(s) for s in self.strings) if i >= 0]
        return text[: min(ends)] if ends else text
