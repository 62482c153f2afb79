"""The preference objectives against their papers' formulas written out with Python floats, pair by
pair: DPO (and conservative DPO), IPO on per-token log-ratios, SimPO, ORPO, the SFT term, the
rewards TRL logs."""

from __future__ import annotations

import math

import pytest
import torch

from ringtrain.train.preference import Objective, PairScores, log1mexp, pair_losses

# (policy chosen, policy rejected, chosen tokens, rejected tokens, reference chosen, reference rejected)
PAIRS = [(-12.0, -15.5, 6, 9, -13.0, -14.0), (-40.2, -31.0, 20, 11, -39.0, -33.5), (-3.0, -3.0, 1, 1, -2.5, -3.5)]


def log_sigmoid(x: float) -> float:
    return -math.log1p(math.exp(-x)) if x >= 0 else x - math.log1p(math.exp(x))


def reference(objective: Objective, c: float, r: float, nc: int, nr: int, rc: float, rr: float) -> tuple[float, float, float]:
    """(loss, chosen reward, rejected reward) of one pair, as the papers write them."""
    b, eps = objective.beta, objective.label_smoothing
    if objective.name == "dpo":
        d = (c - rc) - (r - rr)
        loss, rewards = -(1 - eps) * log_sigmoid(b * d) - eps * log_sigmoid(-b * d), (b * (c - rc), b * (r - rr))
    elif objective.name == "ipo":
        d = (c - rc) / nc - (r - rr) / nr
        loss, rewards = (d - 1 / (2 * b)) ** 2, (b * (c - rc), b * (r - rr))
    elif objective.name == "simpo":
        z = b * (c / nc - r / nr) - objective.gamma
        loss, rewards = -(1 - eps) * log_sigmoid(z) - eps * log_sigmoid(-z), (b * c / nc, b * r / nr)
    else:  # orpo: odds = p / (1 - p) of the per-token probabilities
        pc, pr = math.exp(c / nc), math.exp(r / nr)
        log_odds = math.log(pc / (1 - pc)) - math.log(pr / (1 - pr))
        loss, rewards = -c / nc - b * log_sigmoid(log_odds), (b * c / nc, b * r / nr)
    return loss - objective.sft_weight * c / nc, rewards[0], rewards[1]


@pytest.mark.parametrize(
    "objective",
    [Objective("dpo", 0.1), Objective("dpo", 0.5, label_smoothing=0.2), Objective("ipo", 0.1), Objective("simpo", 2.0, gamma=0.5),
     Objective("simpo", 2.0, gamma=0.5, label_smoothing=0.1), Objective("orpo", 0.1), Objective("dpo", 0.1, sft_weight=1.0)],
    ids=lambda o: f"{o.name}-b{o.beta}-g{o.gamma}-e{o.label_smoothing}-sft{o.sft_weight}",
)  # fmt: skip
def test_each_pairs_loss_and_rewards_are_the_papers(objective: Objective) -> None:
    columns = [torch.tensor(col, dtype=torch.float64) for col in zip(*PAIRS)]
    scores = PairScores(columns[0], columns[1], columns[2], columns[3], columns[4], columns[5])
    got = pair_losses(objective, scores)
    for i, pair in enumerate(PAIRS):
        loss, chosen_reward, rejected_reward = reference(objective, *pair)
        assert float(got.loss[i]) == pytest.approx(loss, rel=1e-12, abs=1e-12)
        assert (float(got.chosen_rewards[i]), float(got.rejected_rewards[i])) == pytest.approx((chosen_reward, rejected_reward))
    metrics = got.metrics()
    assert metrics["logps/chosen"] == pytest.approx(sum(p[0] for p in PAIRS) / len(PAIRS))
    assert metrics["rewards/accuracies"] == pytest.approx(float((got.chosen_rewards > got.rejected_rewards).double().mean()))


def test_dpo_and_ipo_refuse_to_score_without_the_reference() -> None:
    scores = PairScores(*(torch.tensor([-1.0]) for _ in range(4)))
    with pytest.raises(ValueError, match="dpo scores against the reference's log-probs"):
        pair_losses(Objective("dpo", 0.1), scores)
    assert pair_losses(Objective("simpo", 0.1), scores).loss.isfinite().all()


def test_orpo_stays_finite_where_a_completion_is_almost_certain() -> None:
    """log(1 - e^p) near p = 0 (a completion of probability ~1): the stable branch, no inf."""
    scores = PairScores(torch.tensor([-1e-7]), torch.tensor([-5.0]), torch.tensor([1.0]), torch.tensor([1.0]))
    assert torch.isfinite(pair_losses(Objective("orpo", 0.1), scores).loss).all()


@pytest.mark.parametrize("x", [-60.0, -3.0, -0.7, -0.6931471805599453, -0.69, -0.3, -1e-3, -1e-9])
def test_log1mexp_and_its_gradient_are_the_closed_forms(x: float) -> None:
    """log(1 - e^x) and its derivative -e^x / (1 - e^x), on both sides of the branch point -ln 2."""
    at = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    value = log1mexp(at)
    value.backward()
    assert float(value.detach()) == pytest.approx(math.log(-math.expm1(x)), rel=1e-14)
    assert float(at.grad) == pytest.approx(-math.exp(x) / -math.expm1(x), rel=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("chosen", [0.0, -1e-320, -1e-44])
def test_orpo_has_a_finite_gradient_where_the_chosen_completion_is_certain(dtype: torch.dtype, chosen: float) -> None:
    """A mean token log-prob of exactly 0 (fp32's log-softmax saturates at a logit margin of
    about 28), or one closer to 0 than the dtype's smallest normal number: log(1 - e^p) is held
    finite, and so is every gradient (no unused branch's infinity times 0)."""
    c = torch.tensor([chosen], dtype=dtype, requires_grad=True)
    r = torch.tensor([-5.0], dtype=dtype, requires_grad=True)
    ones = torch.ones(1, dtype=dtype)
    losses = pair_losses(Objective("orpo", 0.1), PairScores(c, r, ones, ones))
    losses.loss.sum().backward()
    assert torch.isfinite(losses.loss).all()
    assert torch.isfinite(c.grad).all() and torch.isfinite(r.grad).all()
    # The NLL's -1 a token, plus at most the odds term's limit at 0, -beta * odds(rejected): the
    # odds term gives its share where p is a normal number, none where p was held.
    odds = math.exp(-5.0) / -math.expm1(-5.0)
    assert -1.0 - 0.1 * odds - 1e-6 <= float(c.grad) <= -1.0 + 1e-6
    x = torch.zeros(1, dtype=dtype, requires_grad=True)
    log1mexp(x).sum().backward()
    assert torch.isfinite(x.grad).all()
