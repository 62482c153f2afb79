"""EvalResult: what one evaluation found, as the JSON ``ringtrain eval --json`` prints and the
``"eval"`` entry of a metrics.jsonl record holds, and as a text table.

JSON keys: ``loss`` (mean next-token loss over every labelled prediction), ``perplexity``,
``tokens`` (labelled predictions), ``rows`` and ``seq_len`` (sequences scored and their length),
``bucket_tokens``, ``by_position`` (a list of ``{start, end, loss, tokens}``, positions
``[start, end)``; the bucket sums add up to the total), and with passkey retrieval
``passkey`` (``lengths``, ``depths``, ``trials``, ``accuracy[length][depth]``, ``by_length``,
``overall``).

With lm-evaluation-harness tasks, ``tasks``: lm-eval's results by task, ``{task: {metric:
value}}`` under lm-eval's metric names (``acc,none``); an evaluation of tasks alone has no loss
keys.

On a chat dataset also ``conversations`` (``total``, ``scored``, ``too_long``: longer than the
sequence length, left out, never cut; ``not_scored``: past the row limit), ``loss_norm`` (the
job's ``train.loss_norm``), ``token_loss`` and ``sequence_loss`` (the mean of the conversations'
means); ``loss`` is the one ``loss_norm`` names, as training averages.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

from ringtrain.evaluation.buckets import Bucket
from ringtrain.evaluation.passkey import PasskeyGrid
from ringtrain.evaluation.tally import LossTally, perplexity


@dataclass(frozen=True)
class ChatCoverage:
    """Which of a chat dataset's conversations an evaluation scores."""

    total: int
    too_long: int  # longer than the sequence length: left out, never cut
    not_scored: int  # past the row limit (--max-rows, eval.max_rows)

    @property
    def scored(self) -> int:
        return self.total - self.too_long - self.not_scored

    def to_dict(self) -> dict[str, int]:
        return {"total": self.total, "scored": self.scored, "too_long": self.too_long, "not_scored": self.not_scored}

    def line(self, seq_len: int) -> str:
        """What is scored and what is left out, in words."""
        out = f"{self.scored:,} of {self.total:,} conversations"
        if self.too_long:
            out += f" ({self.too_long:,} longer than {seq_len:,} tokens left out"
            out += f", {self.not_scored:,} past the row limit not scored)" if self.not_scored else ")"
        elif self.not_scored:
            out += f" ({self.not_scored:,} past the row limit not scored)"
        return out


# lm-eval's results by task: {task: {metric: value}}.
TaskMetrics = dict[str, dict[str, Any]]


@dataclass(frozen=True)
class EvalResult:
    tally: Optional[LossTally]  # None: no data scored (tasks alone)
    rows: int
    seq_len: int
    passkey: Optional[PasskeyGrid] = None
    coverage: Optional[ChatCoverage] = None  # a chat dataset's
    loss_norm: str = "token"  # config.LOSS_NORMS: which mean ``loss`` is (sequence: a chat dataset's only)
    tasks: Optional[TaskMetrics] = None

    @property
    def loss(self) -> float:
        assert self.tally is not None, "no data was scored"
        return self.tally.sequence_loss if self.loss_norm == "sequence" else self.tally.loss

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = self._scored() if self.tally is not None else {}
        if self.passkey is not None:
            out["passkey"] = self.passkey.to_dict()
        if self.tasks is not None:
            out["tasks"] = self.tasks
        return out

    def _scored(self) -> dict[str, Any]:
        assert self.tally is not None
        out: dict[str, Any] = {
            "loss": _finite_or_none(self.loss),
            "perplexity": _finite_or_none(perplexity(self.loss)),
            "tokens": self.tally.tokens,
            "rows": self.rows,
            "seq_len": self.seq_len,
            "bucket_tokens": self.tally.bucket_tokens,
            "by_position": self.tally.by_position(),
        }
        if self.coverage is not None:
            out.update(conversations=self.coverage.to_dict(), loss_norm=self.loss_norm,
                       token_loss=_finite_or_none(self.tally.loss), sequence_loss=_finite_or_none(self.tally.sequence_loss))
        return out

    def table(self) -> str:
        """The result as aligned text: totals, the loss by position, the passkey grid, the tasks."""
        lines = self._loss_lines() if self.tally is not None else []
        if self.passkey is not None:
            grid = self.passkey
            lines += ["", f"passkey accuracy ({grid.trials} key(s) per cell), depth across:"]
            lines.append(f"{'length':>8}  " + "  ".join(f"{d:>5g}" for d in grid.depths) + "    all")
            for n in grid.lengths:
                cells = "  ".join(f"{grid.accuracy(n, d):>5.2f}" for d in grid.depths)
                lines.append(f"{n:>8}  {cells}  {grid.length_accuracy(n):>5.2f}")
        if self.tasks:
            lines.append("")
        for task, metrics in sorted((self.tasks or {}).items()):
            shown = ", ".join(f"{name} {_num(v)}" for name, v in metrics.items() if isinstance(v, (int, float)))
            lines.append(f"{task}: {shown}")
        return "\n".join(lines).strip("\n")

    def _loss_lines(self) -> list[str]:
        t = self.tally
        assert t is not None
        scored = f"{self.rows} sequences of {self.seq_len}" if self.coverage is None else self.coverage.line(self.seq_len)
        lines = [f"loss {_num(self.loss)}  perplexity {_num(perplexity(self.loss))}  tokens {t.tokens}  ({scored})"]
        if self.coverage is not None:
            lines.append(f"loss as train.loss_norm: {self.loss_norm} averages; token mean {_num(t.loss)}, "
                         f"mean of the conversations' means {_num(t.sequence_loss)}")  # fmt: skip
        lines += [
            "",
            f"{'positions':>14}  {'loss':>8}  {'ppl':>10}  {'tokens':>10}",
        ]
        for entry in t.by_position():
            label = Bucket(entry["start"], entry["end"]).label
            loss = entry["loss"]
            ppl = math.exp(loss) if loss is not None and loss < 700 else None
            lines.append(f"{label:>14}  {_num(loss):>8}  {_num(ppl):>10}  {entry['tokens']:>10}")
        return lines


def _finite_or_none(value: float) -> Optional[float]:
    # JSON has no NaN; inf (a perplexity that overflowed) stays a number Python's json writes.
    return None if math.isnan(value) else value


def _num(value: Optional[float]) -> str:
    if value is None or math.isnan(value):
        return "-"
    return f"{value:.4f}" if abs(value) < 1e4 else f"{value:.4g}"
