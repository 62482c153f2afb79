"""One rank's share of a preference objective: its tokens' log-probs summed into the pairs they
belong to, combined once per pair over the CP group, and the step's pairs averaged over the world.

A pair's completion log-prob is the sum of its trained tokens' log-probs over every rank those
tokens landed on (``completion_sums``): each rank sums its own tokens into the pair's slot, one
all-reduce over the CP group gives every rank the totals, and the objective (train/preference.py)
is taken of the totals, never of a rank's share (no per-rank mean, no division by a rank's own
count: a rank holding none of a pair's tokens contributes 0 to its sums, never NaN). The
gradient still flows through each rank's own share: the totals are the rank's sums plus the
others' (detached), so each token's log-prob gets d loss / d sum of its pair.

Scaling: the step's loss is the mean over its global batch's N pairs. ZeRO averages gradients
over the dp x cp ranks and divides by the accumulation steps, and every CP rank of a replica
takes the same pairs' losses (each backpropagating through its own tokens), so a rank
backpropagates ``dp * cp * accumulation / N`` times its micro-batch's summed pair losses: the
gradient is then that of the mean over the N pairs (``pairs_scale``).
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from ringtrain.train.data import MicroBatch
from ringtrain.status import PREFERENCE_METRICS as METRICS
from ringtrain.train.preference import Objective, PairLosses, PairScores, pair_losses

Tensor = torch.Tensor


def completion_sums(token_logps_T: Tensor, mb: MicroBatch, group: Optional[dist.ProcessGroup],
                    device: torch.device) -> tuple[Tensor, Tensor]:  # fmt: skip
    """Per completion slot of ``mb`` (chosen, rejected, pair after pair): the summed log-probs
    of its trained tokens over the CP group (fp64, differentiable in this rank's tokens) and
    their count."""
    assert mb.completions is not None
    slots = torch.as_tensor(mb.completions, device=device).flatten()
    mine = slots >= 0
    num = 2 * len(mb.pairs)
    local = torch.zeros(num, dtype=torch.float64, device=device).index_add(0, slots[mine], token_logps_T[mine].double())
    counts = torch.zeros(num, dtype=torch.float64, device=device).index_add(
        0, slots[mine], torch.ones(int(mine.sum()), dtype=torch.float64, device=device))
    totals = torch.cat([local.detach(), counts])
    dist.all_reduce(totals, group=group)
    # Every rank's share, this rank's differentiable: d loss / d token = d loss / d its pair's sum.
    return local + (totals[:num] - local.detach()), totals[num:]


def pair_scores(sums: Tensor, counts: Tensor, pairs: tuple[int, ...], reference: Optional[np.ndarray]) -> PairScores:
    """The micro-batch's pairs as the objective takes them; ``reference``: each dataset pair's
    (chosen, rejected) sums under the starting weights, where the objective needs them."""
    ref = None
    if reference is not None:
        ref = torch.as_tensor(reference[list(pairs)], dtype=torch.float64, device=sums.device)
    return PairScores(sums[0::2], sums[1::2], counts[0::2], counts[1::2],
                      None if ref is None else ref[:, 0], None if ref is None else ref[:, 1])  # fmt: skip


def pairs_scale(num_pairs: int, world: int, accumulation: int) -> float:
    """What a rank multiplies its micro-batch's summed pair losses by (see the module doc)."""
    return world * accumulation / max(num_pairs, 1)


def count_pairs(batches: list[MicroBatch], cp: int, device: torch.device) -> int:
    """The step's pairs over the world: each CP rank of a replica holds the same ones."""
    total = torch.tensor([float(sum(len(mb.pairs) for mb in batches))], dtype=torch.float64, device=device)
    dist.all_reduce(total)
    return int(round(float(total.item()) / cp))


def micro_loss(objective: Objective, scores: PairScores, scale: float) -> tuple[Tensor, PairLosses]:
    """The loss this rank backpropagates for a micro-batch, and its pairs' losses and rewards."""
    losses = pair_losses(objective, scores)
    return losses.loss.sum() * scale, losses


def step_metrics(losses: list[PairLosses], num_pairs: int, cp: int, device: torch.device, *,
                 reduce: bool = True) -> tuple[float, dict[str, float]]:  # fmt: skip
    """The step's loss (the mean over its pairs) and METRICS, means over its pairs: one
    all-reduce of this rank's sums (each replica's pairs counted once: divided by cp). Without
    ``reduce`` (a chaos fault left the all-reduce out), the means over this rank's own pairs."""
    local = torch.zeros(1 + len(METRICS), dtype=torch.float64, device=device)
    for part in losses:
        local += part.sums()
    if reduce:
        dist.all_reduce(local)
        mean = (local / cp / max(num_pairs, 1)).tolist()
    else:
        mean = (local / max(sum(len(part.loss) for part in losses), 1)).tolist()
    return mean[0], dict(zip(METRICS, mean[1:], strict=True))
