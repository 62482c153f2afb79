"""Shared by the memory-saver tests: a tiny decoder on one CPU rank, a live-storage byte counter,
and the ``quiet_cpu`` fixture the saver test modules use."""

from __future__ import annotations

import gc
import threading
import weakref
from typing import Any, Iterator, Optional

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


class LiveBytes:
    """Bytes of live CPU tensor storage created while active, and their peak (a dispatch mode
    sees every op's outputs, the backward's included; a finalizer takes a storage off when it dies)."""

    def __init__(self) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        tracker = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Optional[dict[str, Any]] = None) -> Any:
                out = func(*args, **(kwargs or {}))
                tracker.observe(out)
                return out

        self.mode = _Mode()
        self.live: dict[int, int] = {}
        self.current = 0
        self.peak = 0
        self._lock = threading.Lock()

    def observe(self, out: Any) -> None:
        from torch.utils._pytree import tree_leaves

        for leaf in tree_leaves(out):
            if not isinstance(leaf, torch.Tensor):
                continue
            storage = leaf.untyped_storage()
            key = id(storage)
            with self._lock:
                known = key in self.live
                self.current += storage.nbytes() - self.live.get(key, 0)
                self.live[key] = storage.nbytes()
            if not known:
                weakref.finalize(storage, self._forget, key)
        self.peak = max(self.peak, self.current)

    def _forget(self, key: int) -> None:
        with self._lock:
            self.current -= self.live.pop(key, 0)

    def __enter__(self) -> "LiveBytes":
        self.mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.mode.__exit__(*exc)
