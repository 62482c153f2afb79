"""Tiled MLP and selective recomputation (train/recompute.py): the same loss and gradients as the
plain layer, with less kept for the backward."""

from __future__ import annotations

import pytest
import torch

from ringtrain.train.model import MemorySavers
from ringtrain.train.recompute import tiled
from ringtrain.train.offload import _is_parameter
from tests.unit.savers_tools import grads, quiet_cpu, tiny_model  # noqa: F401

TOL = 1e-6


def _worst(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.mark.parametrize(
    "savers",
    [
        MemorySavers(mlp_tiles=4),
        MemorySavers(checkpointing="selective"),
        MemorySavers(checkpointing="selective", mlp_tiles=2),
        MemorySavers(checkpointing="full", mlp_tiles=4),
    ],
    ids=["tiles4", "selective", "selective-tiles2", "full-tiles4"],
)
def test_gradients_equal_the_plain_model(savers: MemorySavers) -> None:
    assert _worst(grads(tiny_model(savers)), grads(tiny_model())) <= TOL


def test_tiles_must_divide_the_sequence() -> None:
    with pytest.raises(ValueError, match="do not divide"):
        tiled(torch.nn.Identity(), torch.zeros(1, 10, 4, requires_grad=True), 3)


def _saved_bytes(savers: MemorySavers) -> int:
    """Bytes of distinct storages autograd keeps for the backward after one forward."""
    from tests.unit.savers_tools import batch

    model = tiny_model(savers)
    ids, pos, labels = batch(64)
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if not _is_parameter(t):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.hidden(ids, pos)
    return sum(storages.values())


def test_selective_keeps_less_than_none_and_more_than_full() -> None:
    none, selective, full = (_saved_bytes(MemorySavers(checkpointing=m)) for m in ("none", "selective", "full"))
    assert full < selective < 0.6 * none, (full, selective, none)
