"""A preference pair as the planner sizes it: the row it takes, the longest prompt a row holds,
and what a preference objective changes in a rank's memory.

A preference objective (``train.objective``: dpo, ipo, simpo, orpo) trains on rows of whole pairs
(train/pairs.py): a pair of a P-token prompt and completions of C and R tokens takes
``P + C + R + 1`` tokens of a row with its prompt shared (``data.prefix_sharing: true``: the
prompt once, its last token leading each completion) and ``2 P + C + R`` laid out as two
documents. ``data.seq_len`` is the row: a pair fits when its tokens do. So the planner's
longest sequence under a preference objective is the longest row, and the longest pair is
that row's prompt for given completion lengths (``longest_prompt``).

What differs from next-token training on the same row, per rank of t tokens:

- The loss keeps each token's loss apart ([t] fp32) for the pair sums (train/pair_loss.py), and
  its backward receives a gradient of that shape: ``TOKEN_LOSS_BYTES`` per token, counted with
  the loss. The sums' own transients (the trained tokens' slots and fp64 log-probs, tens of
  bytes a token) live at the end of the forward, when no chunk of logits is live, and stay below
  the loss's peak. Liger's fused loss, which keeps no token's loss apart, never runs: where it
  would, the loss runs chunked at ``FUSED_FALLBACK_CHUNK`` tokens (train/model.py).
- DPO and IPO (``config.REFERENCE_OBJECTIVES``) take every pair's log-probs under the starting
  weights in one pass over the dataset before step 1, on the same model and mesh, forward only
  under ``torch.no_grad``: it keeps nothing for a backward, so its peak is one layer's (or the
  loss's) forward working set over the model states. planner/memory.py counts it
  (``reference_activations``) and takes the larger of it and the training step's peak; it is
  below the step's in every layout, recomputation or none (tests/unit/test_planner_preference.py).
- The step's FLOPs are the row's, as for any row of the same length (the completions attend to
  the prompt and themselves only, so the causal count is an upper bound); the reference pass
  adds one forward per row of the dataset, once.
"""

from __future__ import annotations

from dataclasses import dataclass

from ringtrain.config import PREFERENCE_OBJECTIVES, REFERENCE_OBJECTIVES

# The two ways a pair is laid out in a row (data.prefix_sharing true, false).
SHARED, TWO_DOCUMENTS = "shared", "two_documents"
PAIR_LAYOUTS = (SHARED, TWO_DOCUMENTS)
# Each completion's tokens when ``--completion-tokens`` is not given: a long answer's length.
DEFAULT_COMPLETION_TOKENS = 1024
# The per-token loss [t] fp32 and its incoming gradient [t] fp32, beside the loss's own bytes.
TOKEN_LOSS_BYTES = 8
# train/model.py's WEIGHTED_CHUNK_TOKENS: the chunk a per-token loss runs at where the fused
# kernel would otherwise run.
FUSED_FALLBACK_CHUNK = 4096


def keeps_token_losses(objective: str) -> bool:
    """Whether ``objective``'s loss keeps each token's loss apart (every preference objective)."""
    return objective in PREFERENCE_OBJECTIVES


def needs_reference(objective: str) -> bool:
    """Whether ``objective`` takes a reference pass before step 1."""
    return objective in REFERENCE_OBJECTIVES


def row_tokens(prompt: int, completion: int, layout: str) -> int:
    """The row tokens of a pair of a ``prompt``-token prompt and two ``completion``-token
    completions, laid out as ``layout`` (train/pairs.py's ``row_length``)."""
    if layout == SHARED:
        return prompt + 2 * completion + 1
    if layout == TWO_DOCUMENTS:
        return 2 * prompt + 2 * completion
    raise ValueError(f"pair layout must be one of {', '.join(PAIR_LAYOUTS)}, got {layout!r}")


def longest_prompt(row: int, completion: int, layout: str) -> int:
    """The longest prompt a ``row``-token row holds beside two ``completion``-token completions
    laid out as ``layout``; 0 when not even a one-token prompt fits."""
    base = row_tokens(0, completion, layout)
    per_prompt_token = row_tokens(1, completion, layout) - base
    return max(0, (row - base) // per_prompt_token)


@dataclass(frozen=True)
class PairFit:
    """The longest pair a row of ``row`` tokens holds, with completions of ``completion`` tokens:
    its prompt per pair layout (0: none fits)."""

    row: int
    completion: int
    shared_prompt: int
    two_documents_prompt: int

    @classmethod
    def of(cls, row: int, completion: int) -> "PairFit":
        return cls(row, completion, longest_prompt(row, completion, SHARED), longest_prompt(row, completion, TWO_DOCUMENTS))

    def record(self) -> dict[str, int]:
        """As ``--json`` gives it."""
        return {"row_tokens": self.row, "completion_tokens": self.completion,
                "prompt_tokens_shared": self.shared_prompt, "prompt_tokens_two_documents": self.two_documents_prompt}  # fmt: skip
