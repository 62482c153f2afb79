"""Shared by the memory-saver tests: a tiny decoder on one CPU rank, and the ``quiet_cpu``
fixture the saver test modules use (their byte counter is ``ringtrain_dev.live_bytes``)."""

from __future__ import annotations

import gc
from typing import Iterator

import pytest
import torch

from ringtrain.topology import CPLayout
from ringtrain.train.attention import build_attention
from ringtrain.train.model import MemorySavers, ModelArgs, Transformer

@pytest.fixture(autouse=True, scope="module")
def quiet_cpu() -> Iterator[None]:
    """One intra-op thread, and the heap so far frozen out of the collector. The tiny ops here are
    all fixed cost: on a shared, loaded machine a second OpenMP thread spins waiting for a core
    (measured: 1.4 s of CPU for a 0.02 s gradient check), and every ``gc.collect`` the byte
    counts need would otherwise walk torch's whole heap (0.2 s each). Restored afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    gc.freeze()  # no collection first: whatever garbage exists is collected after ``unfreeze``
    try:
        yield
    finally:
        gc.unfreeze()
        torch.set_num_threads(threads)


TINY = ModelArgs(
    vocab_size=96, dim=64, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=160, norm_eps=1e-5, rope_theta=10000.0
)


def tiny_model(savers: MemorySavers = MemorySavers(), *, args: ModelArgs = TINY, seed: int = 0) -> Transformer:
    """The same fp32 weights for every ``savers``: only the forward's memory tactics differ."""
    torch.manual_seed(seed)
    attention = build_attention(CPLayout(1, 1), "cpu_flash", ring_group=None, ulysses_group=None)
    return Transformer(args, attention_fn=attention, init_std=0.2, savers=savers).train()


def batch(seq: int = 64, *, vocab: int = TINY.vocab_size, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input ids, position ids, labels) of two rows; a few labels are IGNORE_INDEX."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (2, seq), generator=g)
    labels = torch.randint(0, vocab, (2, seq), generator=g)
    labels[:, -1] = -100
    labels[0, :5] = -100
    return ids, torch.arange(seq).expand(2, seq), labels


def grads(model: Transformer, *, seq: int = 64) -> dict[str, torch.Tensor]:
    """Every parameter's gradient of the mean loss over labelled tokens (the model's own loss path)."""
    ids, pos, labels = batch(seq)
    model.zero_grad(set_to_none=True)
    (model(ids, pos, labels) / int((labels != -100).sum())).backward()
    return {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
