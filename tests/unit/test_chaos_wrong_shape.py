"""The wrong_shape chaos fault issues its mismatched collective on the rank's own device.

NCCL refuses a CPU tensor before anything is sent: a CPU tensor would fail the faulty rank at
once instead of leaving its peers waiting in a mismatched collective, the stall the fault is
there to produce. The trainer's device stands in as ``meta`` here, so a tensor allocated
anywhere else shows on a CPU-only machine.
"""

from __future__ import annotations

import types
from typing import Any

import pytest
import torch

from ringtrain.train import trainer as trainer_module
from ringtrain.train.trainer import Trainer


def _reduced(monkeypatch: pytest.MonkeyPatch, faults: set[str]) -> tuple[float, list[torch.Tensor]]:
    reduced: list[torch.Tensor] = []

    def all_reduce(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        reduced.append(tensor)

    monkeypatch.setattr(trainer_module.dist, "all_reduce", all_reduce)
    stand_in = types.SimpleNamespace(device=torch.device("meta"))
    return Trainer._global_loss(stand_in, torch.tensor(2.5), faults), reduced  # type: ignore[arg-type]


def test_wrong_shape_reduces_an_empty_tensor_on_the_trainers_device(monkeypatch: pytest.MonkeyPatch) -> None:
    loss, reduced = _reduced(monkeypatch, {"wrong_shape"})
    assert loss == 2.5  # the rank reports its own loss: the reduction never completes for real
    assert len(reduced) == 1
    assert reduced[0].device == torch.device("meta") and reduced[0].numel() == 0


def test_skip_collective_reduces_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    loss, reduced = _reduced(monkeypatch, {"skip_collective"})
    assert loss == 2.5 and reduced == []
