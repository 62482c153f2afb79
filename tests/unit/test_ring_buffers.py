"""The ring's visitor buffers (``exchanges.ring.VisitorBuffers``): kept from call to call in a
rank's thread, so a layer allocates no receive buffer and cuts no block's columns again, and what
a call reads in them is always its own K/V, never a previous call's."""

from __future__ import annotations

import threading

import torch

from ringtrain.train.attention.attend import ring_attention
from ringtrain.train.attention.exchanges.ring import visitor_buffers
from ringtrain.train.attention.kernels import get_kernel
from ringtrain_dev.loopback import LoopbackTransport

B, S, HEADS, KV_HEADS, D, WORLD = 1, 16, 4, 2, 8, 4


def _layer(seed: int) -> list[torch.Tensor]:
    """A ring layer's output and input gradients for inputs drawn from ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, S, n, D, generator=gen).requires_grad_() for n in (HEADS, KV_HEADS, KV_HEADS))
    kernel = get_kernel("cpu_flash", device_type="cpu", dtype=torch.float32)
    # The last rank of a ring on a loopback: its own K/V visits it, and every visitor's block
    # takes half its columns (kept cuts).
    out = ring_attention(q, k, v, group=LoopbackTransport(WORLD - 1, WORLD), kernel=kernel)
    out.backward(torch.ones_like(out))
    return [out.detach(), q.grad, k.grad, v.grad]


def _kept() -> object:
    """The buffers this thread keeps for the layer's visitors (K/V head-major, contiguous)."""
    return visitor_buffers(torch.empty(B, KV_HEADS, S, D), torch.empty(B, KV_HEADS, S, D))


def test_a_ring_keeps_its_visitors_buffers_and_reads_only_its_own_call_in_them() -> None:
    _layer(seed=1)
    kept = _kept()
    again = _layer(seed=2)
    assert _kept() is kept, "a second call of the same shape made new receive buffers"
    fresh: list[list[torch.Tensor]] = []
    worker = threading.Thread(target=lambda: fresh.append(_layer(seed=2)))  # a thread of its own: new buffers
    worker.start()
    worker.join(timeout=60)
    assert fresh, "the fresh thread's layer did not finish"
    for name, got, want in zip(("out", "dq", "dk", "dv"), again, fresh[0]):
        assert torch.equal(got, want), name
