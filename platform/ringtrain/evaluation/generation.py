"""What to generate: the prompts, how many new tokens, how each is drawn and where a row stops,
as one value that travels from the command line to every worker; pure.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ringtrain.evaluation.stops import StopRule


@dataclass(frozen=True)
class Sampling:
    """``temperature`` 0 is greedy (argmax; top_p unused); above it, tokens are drawn from the
    softmax of logits / temperature, cut to the smallest set of the likeliest tokens whose
    probability reaches ``top_p`` (Holtzman et al. 2020), by a generator seeded from ``seed``."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        # Written so NaN fails: every comparison with it is false.
        if not 0 <= self.temperature < math.inf:
            raise ValueError(f"temperature must be a finite number >= 0 (got {self.temperature})")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (got {self.top_p})")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


GREEDY = Sampling()


@dataclass(frozen=True)
class GenerationRequest:
    """Continue each of ``prompts`` (token ids) by at most ``max_new`` tokens."""

    prompts: tuple[tuple[int, ...], ...]
    max_new: int
    sampling: Sampling = GREEDY
    stop: StopRule = field(default_factory=StopRule)

    @classmethod
    def of(cls, prompts: "list[list[int]]", max_new: int, sampling: Sampling = GREEDY,
           stop: StopRule = StopRule()) -> GenerationRequest:
        return cls(tuple(tuple(p) for p in prompts), max_new, sampling, stop)


@dataclass(frozen=True)
class ScoreRequest:
    """Score the last ``scored[i]`` tokens of each of ``sequences`` given the tokens before them:
    their log-probabilities summed, and whether each was the greedy choice (lm-eval's
    ``loglikelihood``)."""

    sequences: tuple[tuple[int, ...], ...]
    scored: tuple[int, ...]

    @classmethod
    def of(cls, pairs: "list[tuple[list[int], list[int]]]") -> ScoreRequest:
        """From (context, continuation) token pairs."""
        return cls(tuple(tuple(c + t) for c, t in pairs), tuple(len(t) for _, t in pairs))
