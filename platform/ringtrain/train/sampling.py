"""How the next token is drawn from the logits (``evaluation.generation.Sampling``): greedy, or
sampled with a temperature and a nucleus (top-p), from a generator seeded by the caller so every
rank of a CP group, and every rerun, draws the same token.

Shape legend: B batch, V vocab.
"""

from __future__ import annotations

from typing import Optional

import torch

from ringtrain.evaluation.generation import Sampling

Tensor = torch.Tensor


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
