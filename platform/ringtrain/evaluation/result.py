"""EvalResult: what one evaluation found, as the JSON ``ringtrain eval --json`` prints and the
``"eval"`` entry of a metrics.jsonl record holds, and as a text table.

JSON keys: ``loss`` (mean next-token loss over every labelled prediction), ``perplexity``,
``tokens`` (labelled predictions), ``rows`` and ``seq_len`` (sequences scored and their length),
``bucket_tokens``, ``by_position`` (a list of ``{start, end, loss, tokens}``, positions
``[start, end)``; the bucket sums add up to the total), and with passkey retrieval
``passkey`` (``lengths``, ``depths``, ``trials``, ``accuracy[length][depth]``, ``by_length``,
``overall``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

from ringtrain.evaluation.buckets import Bucket
from ringtrain.evaluation.passkey import PasskeyGrid
from ringtrain.evaluation.tally import LossTally


@dataclass(frozen=True)
class EvalResult:
    tally: LossTally
    rows: int
    seq_len: int
    passkey: Optional[PasskeyGrid] = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "loss": _finite_or_none(self.tally.loss),
            "perplexity": _finite_or_none(self.tally.perplexity),
            "tokens": self.tally.tokens,
            "rows": self.rows,
            "seq_len": self.seq_len,
            "bucket_tokens": self.tally.bucket_tokens,
            "by_position": self.tally.by_position(),
        }
        if self.passkey is not None:
            out["passkey"] = self.passkey.to_dict()
        return out

    def table(self) -> str:
        """The result as aligned text: totals, the loss by position, the passkey grid."""
        t = self.tally
        lines = [
            f"loss {_num(t.loss)}  perplexity {_num(t.perplexity)}  tokens {t.tokens}  "
            f"({self.rows} sequences of {self.seq_len})",
            "",
            f"{'positions':>14}  {'loss':>8}  {'ppl':>10}  {'tokens':>10}",
        ]
        for entry in t.by_position():
            label = Bucket(entry["start"], entry["end"]).label
            loss = entry["loss"]
            ppl = math.exp(loss) if loss is not None and loss < 700 else None
            lines.append(f"{label:>14}  {_num(loss):>8}  {_num(ppl):>10}  {entry['tokens']:>10}")
        if self.passkey is not None:
            grid = self.passkey
            lines += ["", f"passkey accuracy ({grid.trials} key(s) per cell), depth across:"]
            lines.append(f"{'length':>8}  " + "  ".join(f"{d:>5g}" for d in grid.depths) + "    all")
            for n in grid.lengths:
                cells = "  ".join(f"{grid.accuracy(n, d):>5.2f}" for d in grid.depths)
                lines.append(f"{n:>8}  {cells}  {grid.length_accuracy(n):>5.2f}")
        return "\n".join(lines)


def _finite_or_none(value: float) -> Optional[float]:
    # JSON has no NaN; inf (a perplexity that overflowed) stays a number Python's json writes.
    return None if math.isnan(value) else value


def _num(value: Optional[float]) -> str:
    if value is None or math.isnan(value):
        return "-"
    return f"{value:.4f}" if abs(value) < 1e4 else f"{value:.4g}"
