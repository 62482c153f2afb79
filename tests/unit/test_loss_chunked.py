"""Chunked cross-entropy (train/loss.py): exact against the whole-logits loss, and its memory no
longer grows with tokens x vocab."""

from __future__ import annotations

import pytest
import torch

from ringtrain.train.loss import chunked_cross_entropy_sum, full_cross_entropy_sum
from ringtrain.train.model import MemorySavers
from ringtrain_dev.live_bytes import loss_peak
from tests.unit.savers_tools import grads, quiet_cpu, tiny_model  # noqa: F401

TOL = 1e-6


def _inputs(tokens: int, dim: int, vocab: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, dim, generator=g, requires_grad=True)
    weight = (0.3 * torch.randn(vocab, dim, generator=g)).requires_grad_()
    labels = torch.randint(0, vocab, (tokens,), generator=g)
    labels[::7] = -100  # ignored tokens contribute neither loss nor gradient
    return hidden, weight, labels


@pytest.mark.parametrize("chunk", [1, 8, 37, 1000])
def test_loss_and_gradients_equal_the_unchunked(chunk: int) -> None:
    hidden, weight, labels = _inputs(37, 16, 50)
    # Scaled as the trainer scales the sum (by the labels a rank holds), so 1e-6 is ~1e-6 relative.
    scale = 1.0 / int((labels != -100).sum())
    ref = full_cross_entropy_sum(hidden, weight, labels)
    ref_h, ref_w = torch.autograd.grad(scale * ref, (hidden, weight))
    got = chunked_cross_entropy_sum(hidden, weight, labels, chunk)
    got_h, got_w = torch.autograd.grad(scale * got, (hidden, weight))
    assert got.dtype == torch.float32
    assert abs(got.item() - ref.item()) <= TOL * max(1.0, abs(ref.item()))
    assert (got_h - ref_h).abs().max().item() <= TOL
    assert (got_w - ref_w).abs().max().item() <= TOL


def test_all_labels_ignored_gives_zero_loss_and_gradient() -> None:
    hidden, weight, labels = _inputs(10, 8, 20)
    labels[:] = -100
    loss = chunked_cross_entropy_sum(hidden, weight, labels, 3)
    loss.backward()
    assert loss.item() == 0.0 and hidden.grad is not None and weight.grad is not None
    assert hidden.grad.abs().max().item() == 0.0 and weight.grad.abs().max().item() == 0.0


@pytest.mark.parametrize("tied", [False, True])
def test_model_gradients_with_chunked_loss_equal_the_unchunked(tied: bool) -> None:
    from dataclasses import replace

    from tests.unit.savers_tools import TINY

    args = replace(TINY, tie_embeddings=tied)
    ref = grads(tiny_model(args=args))
    got = grads(tiny_model(MemorySavers(loss_chunk_tokens=24), args=args))
    assert ref.keys() == got.keys()
    worst = max((got[k] - ref[k]).abs().max().item() for k in ref)
    assert worst <= TOL, worst


def _loss_peak(tokens: int, vocab: int, chunk: int) -> int:
    return loss_peak(*_inputs(tokens, 32, vocab), chunk)


def test_peak_memory_no_longer_grows_with_tokens_times_vocab() -> None:
    # The full-size check (2K -> 4K tokens at vocab 128,256) is bench/loss_memory.py; this is the
    # same ratio at a size the unit tier affords.
    vocab = 128_256
    full = _loss_peak(128, vocab, 0) - _loss_peak(64, vocab, 0)
    chunked = _loss_peak(128, vocab, 16) - _loss_peak(64, vocab, 16)
    assert full > 64 * vocab * 4  # at least one fp32 [tokens x vocab] more
    assert chunked / full <= 0.1, (chunked, full)


def test_per_token_losses_and_their_gradients_equal_the_unchunked_ones() -> None:
    """Each token's loss apart, and the gradient of any function of them (here a per-sequence
    sum squared, as a preference objective takes it): what ``F.cross_entropy`` over the whole
    logits gives, chunk by chunk."""
    from ringtrain.train.loss import chunked_cross_entropy_tokens

    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(37, 16, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(50, 16, generator=g, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 50, (37,), generator=g)
    labels[[0, 5, 36]] = -100
    sequence = torch.arange(37) // 10

    def objective(losses: torch.Tensor) -> torch.Tensor:
        return (torch.zeros(4, dtype=losses.dtype).index_add(0, sequence, losses) ** 2).sum()

    want_losses = torch.nn.functional.cross_entropy(hidden @ weight.T, labels, ignore_index=-100, reduction="none")
    want = torch.autograd.grad(objective(want_losses), (hidden, weight))
    got_losses = chunked_cross_entropy_tokens(hidden, weight, labels, 8)
    got = torch.autograd.grad(objective(got_losses), (hidden, weight))
    torch.testing.assert_close(got_losses, want_losses.float(), rtol=1e-6, atol=1e-6)
    for a, b in zip(got, want):  # the chunks' logits are fp32, as the summed path's are
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * float(b.abs().max()))
