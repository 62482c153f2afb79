"""Preference objectives: DPO, IPO, SimPO and ORPO as functions of per-pair log-prob sums.

A pair's completions are scored by their summed token log-probs under the policy (``chosen``,
``rejected``) and, for the objectives that need one, under the reference model; a completion's
``tokens`` are its trained tokens. Every objective is a loss per pair; the caller averages over
the pairs of the global batch. Definitions, with Δ for the chosen-minus-rejected difference,
σ the logistic function, β ``train.preference.beta``, ε ``label_smoothing``, γ ``gamma``:

- ``dpo`` (Rafailov et al. 2023; TRL ``loss_type="sigmoid"``): Δ of the log-ratios against the
  reference, ``-(1 - ε) log σ(βΔ) - ε log σ(-βΔ)`` (ε > 0: conservative DPO, Mitchell 2023);
- ``ipo`` (Azar et al. 2023, eq. 17, as TRL 1.x takes it): Δ of the per-token log-ratios,
  ``(Δ - 1 / (2β))²``;
- ``simpo`` (Meng et al. 2024; TRL's CPO ``loss_type="simpo"``): Δ of the per-token policy
  log-probs, ``-(1 - ε) log σ(βΔ - γ) - ε log σ(-(βΔ - γ))``;
- ``orpo`` (Hong et al. 2024; TRL's ORPO): the chosen completion's mean token NLL minus
  β log σ(log odds), the log odds of the per-token log-probs p: ``(p_c - p_r) - (log(1 - e^p_c)
  - log(1 - e^p_r))``.

``sft_weight`` adds that many times the chosen completion's mean token NLL (RPO, Pang et al.
2024; TRL's ``rpo_alpha`` / ``cpo_alpha``), per pair. The rewards TRL logs are β times the
log-ratio sums (DPO, IPO) or β times the per-token policy log-probs (SimPO, ORPO).

Pure torch on [N] tensors: differentiable in the policy's sums.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from ringtrain.config import PREFERENCE_OBJECTIVES, REFERENCE_OBJECTIVES, PreferenceConfig
from ringtrain.status import PREFERENCE_METRICS as METRICS

Tensor = torch.Tensor


@dataclass(frozen=True)
class PairScores:
    """Per-pair sums [N] (float, fp32 or wider) and trained-token counts of both completions."""

    chosen: Tensor
    rejected: Tensor
    chosen_tokens: Tensor
    rejected_tokens: Tensor
    ref_chosen: Optional[Tensor] = None
    ref_rejected: Optional[Tensor] = None


@dataclass(frozen=True)
class Objective:
    name: str  # config.PREFERENCE_OBJECTIVES
    beta: float
    gamma: float = 0.0  # SimPO's target margin
    label_smoothing: float = 0.0
    sft_weight: float = 0.0

    @classmethod
    def of(cls, name: str, settings: PreferenceConfig) -> "Objective":
        return cls(name, settings.beta, settings.gamma, settings.label_smoothing, settings.sft_weight)


@dataclass(frozen=True)
class PairLosses:
    """Each pair's loss and TRL's quantities, [N] each (the rewards and log-probs detached)."""

    loss: Tensor
    chosen_rewards: Tensor
    rejected_rewards: Tensor
    chosen_logps: Tensor
    rejected_logps: Tensor

    def sums(self) -> Tensor:
        """[1 + len(METRICS)] fp64: the pairs' summed loss, then each of METRICS summed over
        them (a mean once divided by the number of pairs, after a reduction across ranks)."""
        margins = self.chosen_rewards - self.rejected_rewards
        parts = (self.loss.detach(), self.chosen_rewards, self.rejected_rewards, (margins > 0).to(margins.dtype), margins,
                 self.chosen_logps, self.rejected_logps)  # fmt: skip
        return torch.stack([p.double().sum() for p in parts])

    def metrics(self) -> dict[str, float]:
        """METRICS, means over the pairs."""
        means = (self.sums() / max(len(self.loss), 1)).tolist()
        return dict(zip(METRICS, means[1:], strict=True))


LN2 = 0.6931471805599453


def log1mexp(x: Tensor) -> Tensor:
    """log(1 - e^x) for x < 0, by the branch that keeps its precision (Mächler 2012), finite
    with a finite gradient up to x = 0.

    A completion's mean token log-prob is exactly 0 where fp32's log-softmax saturates (a logit
    margin of about 28), and log(1 - e^0) is -inf: x is held at most the dtype's smallest normal
    number below 0 (its gradient 0 past it). Each branch takes its input clamped into its own
    domain, because ``torch.where`` multiplies the unused branch's gradient by 0, and 0 times an
    infinite gradient is NaN."""
    x = x.clamp(max=-torch.finfo(x.dtype).tiny)
    far = x < -LN2
    return torch.where(far, torch.log1p(-torch.exp(x.clamp(max=-LN2))), torch.log(-torch.expm1(x.clamp(min=-LN2))))


def _smoothed(logits: Tensor, epsilon: float) -> Tensor:
    return -(1 - epsilon) * F.logsigmoid(logits) - epsilon * F.logsigmoid(-logits)


def pair_losses(objective: Objective, scores: PairScores) -> PairLosses:
    """Each pair's loss under ``objective``, and its rewards."""
    beta, s = objective.beta, scores
    per_token_chosen = s.chosen / s.chosen_tokens.clamp(min=1)
    per_token_rejected = s.rejected / s.rejected_tokens.clamp(min=1)
    if objective.name in REFERENCE_OBJECTIVES:
        if s.ref_chosen is None or s.ref_rejected is None:
            raise ValueError(f"{objective.name} scores against the reference's log-probs, and none were given")
        ratio_chosen, ratio_rejected = s.chosen - s.ref_chosen, s.rejected - s.ref_rejected
        if objective.name == "dpo":
            loss = _smoothed(beta * (ratio_chosen - ratio_rejected), objective.label_smoothing)
        else:
            per_token = ratio_chosen / s.chosen_tokens.clamp(min=1) - ratio_rejected / s.rejected_tokens.clamp(min=1)
            loss = (per_token - 1 / (2 * beta)) ** 2
        rewards = (beta * ratio_chosen, beta * ratio_rejected)
    elif objective.name == "simpo":
        loss = _smoothed(beta * (per_token_chosen - per_token_rejected) - objective.gamma, objective.label_smoothing)
        rewards = (beta * per_token_chosen, beta * per_token_rejected)
    elif objective.name == "orpo":
        log_odds = (per_token_chosen - per_token_rejected) - (log1mexp(per_token_chosen) - log1mexp(per_token_rejected))
        loss = -per_token_chosen - beta * F.logsigmoid(log_odds)
        rewards = (beta * per_token_chosen, beta * per_token_rejected)
    else:
        raise ValueError(f"objective {objective.name!r} is not one of {', '.join(PREFERENCE_OBJECTIVES)}")
    if objective.sft_weight:
        loss = loss - objective.sft_weight * per_token_chosen
    return PairLosses(loss, rewards[0].detach(), rewards[1].detach(), s.chosen.detach(), s.rejected.detach())


def report(objective: Objective, scores: PairScores) -> dict[str, float]:
    """An evaluation's numbers for the pairs of ``scores``: the objective's mean loss, the mean
    summed log-prob of each completion, the share of pairs whose chosen reward is the higher
    (``reward_accuracy``), the mean reward margin, and each completion's mean reward."""
    losses = pair_losses(objective, scores)
    means = losses.metrics()
    return {"loss": float(losses.loss.double().mean()), "chosen_logps": means["logps/chosen"],
            "rejected_logps": means["logps/rejected"], "reward_accuracy": means["rewards/accuracies"],
            "reward_margin": means["rewards/margins"], "chosen_reward": means["rewards/chosen"],
            "rejected_reward": means["rewards/rejected"]}  # fmt: skip
