"""What the exchanges hand the loop's backward and send (train/attention/accumulator.py,
exchanges/base.py): the per-visit dK/dV accumulator in each of the ways it starts, and the tags
of the transfer streams."""

from __future__ import annotations

import torch

from ringtrain.train.attention.accumulator import VisitAccumulator
from ringtrain.train.attention.exchanges.base import TAGS_PER_STREAM, Tag

SEQ_DIM = 2  # K's sequence dim in the kernel's BHSD layout


def _kv(seed: int, cols: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(1, 2, cols, 4, generator=gen), torch.randn(1, 2, cols, 4, generator=gen)


class _InFlight:
    """A transfer that fills ``target`` with ``value`` when waited for, and counts the waits."""

    def __init__(self, target: torch.Tensor, value: torch.Tensor) -> None:
        self.target, self.value, self.waits = target, value, 0

    def wait(self) -> None:
        self.waits += 1
        self.target.copy_(self.value)


def test_a_lone_block_of_every_column_keeps_its_own_gradients() -> None:
    k, _ = _kv(0)
    dk, dv = _kv(1)
    dkv = VisitAccumulator.fresh(k)
    dkv.add(dk, dv, (0, 8), True, SEQ_DIM)
    own = dkv.grads()
    assert isinstance(own, tuple) and own[0] is dk and own[1] is dv  # no stack, no copy
    assert torch.equal(dkv.stacked(), torch.stack((dk, dv)))


def test_blocks_of_some_columns_add_into_one_stacked_accumulator() -> None:
    k, _ = _kv(0)
    first, second = _kv(1), _kv(2, cols=3)
    dkv = VisitAccumulator.fresh(k)
    dkv.add(*first, (0, 8), True, SEQ_DIM)
    dkv.add(*second, (5, 8), False, SEQ_DIM)
    want = torch.stack(first).clone()
    want[:, :, :, 5:8] += torch.stack(second)
    assert torch.equal(dkv.stacked(), want)


def test_a_visit_no_block_saw_has_zero_gradients() -> None:
    k, _ = _kv(0)
    assert torch.equal(VisitAccumulator.fresh(k).stacked(), torch.zeros(2, *k.shape))


def test_an_arriving_accumulator_is_waited_for_once_the_first_block_is_computed() -> None:
    """The ring's accumulator travels while the visit's first block computes: nothing waits for it
    before that block's gradients are added, and nothing twice."""
    arrived = torch.empty(2, 1, 2, 8, 4)
    upstream = torch.stack(_kv(3))
    transfer = _InFlight(arrived, upstream)
    dkv = VisitAccumulator.arriving(arrived, transfer)
    assert transfer.waits == 0
    block = _kv(4, cols=4)
    dkv.add(*block, (0, 4), False, SEQ_DIM)
    assert transfer.waits == 1
    dkv.add(*block, (4, 8), False, SEQ_DIM)
    assert transfer.waits == 1 and dkv.stacked() is arrived
    want = upstream.clone()
    want[:, :, :, :4] += torch.stack(block)
    want[:, :, :, 4:] += torch.stack(block)
    assert torch.equal(arrived, want)


def test_an_arriving_accumulator_no_block_added_to_still_arrives() -> None:
    arrived = torch.empty(2, 1, 2, 8, 4)
    upstream = torch.stack(_kv(5))
    transfer = _InFlight(arrived, upstream)
    assert torch.equal(VisitAccumulator.arriving(arrived, transfer).stacked(), upstream) and transfer.waits == 1


def test_a_given_accumulator_takes_every_block_added() -> None:
    whole = torch.zeros(2, 1, 2, 8, 4)
    block = _kv(6)
    dkv = VisitAccumulator.into(whole)
    dkv.add(*block, (0, 8), True, SEQ_DIM)
    assert dkv.grads() is whole and torch.equal(whole, torch.stack(block))


def test_each_stream_has_tags_of_its_own() -> None:
    """A stream of n tensors to a peer takes tags tag .. tag + n - 1: no two streams share one."""
    tags = sorted(Tag)
    assert len(set(tags)) == len(tags)
    assert all(b - a >= TAGS_PER_STREAM for a, b in zip(tags, tags[1:]))
