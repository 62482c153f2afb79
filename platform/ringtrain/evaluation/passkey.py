"""Passkey retrieval: a random number hidden in filler text, the model asked to repeat it.

The prompt is the one of Mohtashami & Jaggi, "Landmark Attention" (2023), section 4.2, used
since by most long-context papers: an instruction, filler sentences repeated to the target
length with the key's sentence at a given depth, and the question. Depth 0 puts the key right
after the instruction, depth 1 right before the question. The model decodes greedily; it
passes when the first number in what it wrote is the key.

Prompts are built from token ids (each piece tokenized on its own and joined), so a prompt is
exactly its nominal length whatever the tokenizer, and the filler is cut at a token.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Any, Sequence

from ringtrain.errors import ConfigError
from ringtrain.evaluation.text import Tokenizer

INSTRUCTION = (
    "There is an important info hidden inside a lot of irrelevant text. "
    "Find it and memorize it. I will quiz you about the important information there.\n"
)
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.\n"
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key.\n"
QUESTION = "What is the pass key? The pass key is"
KEY_DIGITS = 5
_NUMBER = re.compile(r"\d+")


@dataclass(frozen=True)
class PasskeyPrompt:
    length: int  # nominal and actual length in tokens
    depth: float
    trial: int
    key: str
    ids: tuple[int, ...]


def draw_key(seed: int, length: int, depth_index: int, trial: int) -> str:
    """A ``KEY_DIGITS``-digit key, the same for the same arguments on every machine."""
    rng = random.Random(f"passkey-{seed}-{length}-{depth_index}-{trial}")
    return str(rng.randrange(10 ** (KEY_DIGITS - 1), 10**KEY_DIGITS))


def min_length(tokenizer: Tokenizer) -> int:
    """The shortest prompt: instruction, key sentence and question with no filler at all."""
    pieces = _fixed_pieces(tokenizer, "0" * KEY_DIGITS)
    return sum(len(p) for p in pieces)


def _fixed_pieces(tokenizer: Tokenizer, key: str) -> tuple[list[int], list[int], list[int]]:
    return (
        tokenizer.encode(INSTRUCTION, first=True),
        tokenizer.encode(NEEDLE.format(key=key)),
        tokenizer.encode(QUESTION),
    )


def build_prompt(tokenizer: Tokenizer, *, length: int, depth: float, key: str, trial: int = 0) -> PasskeyPrompt:
    """A prompt of exactly ``length`` tokens hiding ``key`` at ``depth`` of the filler."""
    instruction, needle, question = _fixed_pieces(tokenizer, key)
    budget = length - len(instruction) - len(needle) - len(question)
    if budget < 0:
        shortest = length - budget
        raise ConfigError("eval.passkey", f"{length} tokens cannot hold the passkey prompt (it needs at least {shortest})")
    filler = tokenizer.encode(FILLER)
    tiled = (filler * (budget // len(filler) + 1))[:budget]
    before = round(depth * budget)
    ids = instruction + tiled[:before] + needle + tiled[before:] + question
    return PasskeyPrompt(length=length, depth=depth, trial=trial, key=key, ids=tuple(ids))


def build_prompts(
    tokenizer: Tokenizer, lengths: Sequence[int], depths: Sequence[float], *, trials: int = 1, seed: int = 0
) -> list[PasskeyPrompt]:
    """Every (length, depth, trial), lengths outermost; each with its own key."""
    return [
        build_prompt(tokenizer, length=length, depth=depth, key=draw_key(seed, length, d, t), trial=t)
        for length in lengths
        for d, depth in enumerate(depths)
        for t in range(trials)
    ]


def answer_tokens(tokenizer: Tokenizer, prompts: Sequence[PasskeyPrompt]) -> int:
    """Tokens to generate: enough for the longest key as the answer, plus one for what follows.
    The same for every prompt, so every replica runs the same number of forwards."""
    return max((len(tokenizer.encode(f" {p.key}")) for p in prompts), default=0) + 1


def answered(key: str, generated: str) -> bool:
    """Whether the first number in ``generated`` is ``key``."""
    found = _NUMBER.search(generated)
    return found is not None and found.group() == key


@dataclass(frozen=True)
class PasskeyGrid:
    """Accuracy per (length, depth) over the trials."""

    lengths: tuple[int, ...]
    depths: tuple[float, ...]
    trials: int
    correct: tuple[tuple[int, ...], ...]  # [length][depth] -> trials answered

    def accuracy(self, length: int, depth: float) -> float:
        return self.correct[self.lengths.index(length)][self.depths.index(depth)] / self.trials

    def length_accuracy(self, length: int) -> float:
        return sum(self.correct[self.lengths.index(length)]) / (self.trials * len(self.depths))

    @property
    def overall(self) -> float:
        return sum(map(sum, self.correct)) / (self.trials * len(self.depths) * len(self.lengths))

    def to_dict(self) -> dict[str, Any]:
        return {
            "lengths": list(self.lengths),
            "depths": list(self.depths),
            "trials": self.trials,
            "accuracy": [[c / self.trials for c in row] for row in self.correct],
            "by_length": {str(n): self.length_accuracy(n) for n in self.lengths},
            "overall": self.overall,
        }


def score(tokenizer: Tokenizer, prompts: Sequence[PasskeyPrompt], generated: Sequence[Sequence[int]]) -> PasskeyGrid:
    """The grid of ``prompts`` (as ``build_prompts`` made them) given what the model wrote."""
    if len(prompts) != len(generated):
        raise ValueError(f"{len(prompts)} prompts but {len(generated)} answers")
    lengths = tuple(dict.fromkeys(p.length for p in prompts))
    depths = tuple(dict.fromkeys(p.depth for p in prompts))
    trials = max((p.trial for p in prompts), default=0) + 1
    correct = [[0] * len(depths) for _ in lengths]
    for prompt, ids in zip(prompts, generated):
        if answered(prompt.key, tokenizer.decode(list(ids))):
            correct[lengths.index(prompt.length)][depths.index(prompt.depth)] += 1
    return PasskeyGrid(lengths, depths, trials, tuple(tuple(row) for row in correct))

