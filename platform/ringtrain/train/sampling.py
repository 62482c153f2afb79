"""How the next token is drawn from the logits: greedy, or sampled with a temperature and a
nucleus (top-p), from a generator seeded by the caller so every rank of a CP group, and every
rerun, draws the same token.

Shape legend: B batch, V vocab.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

Tensor = torch.Tensor


@dataclass(frozen=True)
class Sampling:
    """``temperature`` 0 is greedy (argmax; top_p unused); above it, tokens are drawn from the
    softmax of logits / temperature, cut to the smallest set of the likeliest tokens whose
    probability reaches ``top_p`` (Holtzman et al. 2020)."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (got {self.temperature})")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (got {self.top_p})")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


GREEDY = Sampling()


def next_tokens(logits_BV: Tensor, sampling: Sampling, generator: Optional[torch.Generator]) -> Tensor:
    """The next token of each row ``[B]`` (int64)."""
    if sampling.greedy:
        return logits_BV.argmax(dim=-1)
    probs_BV = torch.softmax(logits_BV.float() / sampling.temperature, dim=-1)
    if sampling.top_p < 1:
        sorted_BV, order_BV = probs_BV.sort(dim=-1, descending=True)
        # Keep a token while the mass before it is short of top_p: the first always stays.
        before_BV = sorted_BV.cumsum(dim=-1) - sorted_BV
        sorted_BV = sorted_BV.masked_fill(before_BV >= sampling.top_p, 0.0)
        probs_BV = torch.zeros_like(probs_BV).scatter_(-1, order_BV, sorted_BV)
    drawn = torch.multinomial(probs_BV.cpu(), 1, generator=generator).squeeze(-1)
    return drawn.to(logits_BV.device)
