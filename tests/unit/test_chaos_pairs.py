"""Chaos faults strike a preference objective's step where they strike the lm step's.

- ``nan``: the step's reported loss (the world's and the rank's own) is NaN, as its gradients
  are, so the controller, which reads the reported loss, sees the blow-up.
- ``skip_collective`` leaves out the step's closing all-reduce (the objective's sums), and
  ``wrong_shape`` enters it with an empty tensor instead; the rank reports its own pairs' loss.

The Trainer's own pairs step runs on a stand-in of one rank (its engine a one-weight model whose
every token's loss is that weight, its all-reduces recorded) over the warm-up's made-up pair.
"""

from __future__ import annotations

import math
import types
from typing import Any

import pytest
import torch

from ringtrain.chaos import FaultSpec
from ringtrain.train import trainer as trainer_module
from ringtrain.train.data import BatchPlan, MicroBatch, ShardedData
from ringtrain.train.pairset import rehearsal_pairs
from ringtrain.train.preference import Objective
from ringtrain.train.trainer import Trainer
from ringtrain.status import PREFERENCE_METRICS

SEQ, VOCAB = 32, 64
CLOSING = 1 + len(PREFERENCE_METRICS)  # the closing all-reduce's elements: the loss and each metric


class _Engine:
    """Every token's loss is one weight; backward keeps its gradient."""

    def __init__(self) -> None:
        self.weight = torch.nn.Parameter(torch.tensor(0.75))

    def __call__(self, input_ids: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.weight * torch.ones(input_ids.numel())

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self) -> None:
        pass

    def is_gradient_accumulation_boundary(self) -> bool:
        return True


def _step(monkeypatch: pytest.MonkeyPatch, poison: bool, kinds: tuple[str, ...]) -> tuple[float, float, list[int], _Engine]:
    """(the step's loss, the rank's own, the sizes of the all-reduces it issued, its engine)."""
    reduced: list[int] = []

    def all_reduce(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        reduced.append(tensor.numel())  # a world of one: the sum is the tensor itself

    monkeypatch.setattr(trainer_module.dist, "all_reduce", all_reduce)
    pairs = rehearsal_pairs(SEQ, VOCAB, prefix_sharing=True)
    data = ShardedData(pairs, seq_len=SEQ, seed=0, plan=BatchPlan(1, 1, 1), ring=1, ulysses=1, ring_idx=0,
                       ulysses_idx=0, vocab_size=VOCAB)  # fmt: skip
    batches: list[MicroBatch] = data.step_batches(0, 0)
    topology = types.SimpleNamespace(cp=1, world_size=1)
    rank = types.SimpleNamespace(objective=Objective("simpo", 2.0, gamma=0.3), reference=None, snapshotter=None,
                                 device=torch.device("cpu"), engine=_Engine(),
                                 mesh=types.SimpleNamespace(topology=topology, cp_group=None))  # fmt: skip
    for name in ("_pairs_micro_step", "token_losses", "_backward_and_step", "_tensor", "_docs"):
        setattr(rank, name, types.MethodType(getattr(Trainer, name), rank))
    rank._strike = Trainer._strike
    strike = [FaultSpec(kind=kind) for kind in kinds]
    loss, local, _ = Trainer._pairs_step(rank, batches, poison, strike)  # type: ignore[arg-type]
    return loss, local, reduced, rank.engine


def test_a_clean_step_reports_its_loss_from_the_closing_all_reduce(monkeypatch: pytest.MonkeyPatch) -> None:
    loss, local, reduced, engine = _step(monkeypatch, False, ())
    assert math.isfinite(loss) and loss == pytest.approx(local)
    assert reduced[-1] == CLOSING
    assert engine.weight.grad is not None and torch.isfinite(engine.weight.grad)


def test_nan_makes_the_reported_loss_nan(monkeypatch: pytest.MonkeyPatch) -> None:
    loss, local, reduced, engine = _step(monkeypatch, True, ())
    assert math.isnan(loss) and math.isnan(local)
    assert engine.weight.grad is not None and torch.isnan(engine.weight.grad)
    assert reduced[-1] == CLOSING


def test_skip_collective_leaves_out_the_closing_all_reduce(monkeypatch: pytest.MonkeyPatch) -> None:
    clean_loss, _, clean, _ = _step(monkeypatch, False, ())
    loss, local, reduced, _ = _step(monkeypatch, False, ("skip_collective",))
    assert reduced == clean[:-1]  # the pairs counted and the completions summed, then nothing
    assert loss == local == pytest.approx(clean_loss)  # the rank's own pairs: here, all of them


def test_wrong_shape_enters_the_closing_all_reduce_with_an_empty_tensor(monkeypatch: pytest.MonkeyPatch) -> None:
    _, _, clean, _ = _step(monkeypatch, False, ())
    loss, local, reduced, _ = _step(monkeypatch, False, ("wrong_shape",))
    assert reduced == [*clean[:-1], 0]
    assert loss == local
