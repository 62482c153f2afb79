"""Ulysses brings q, k and v's gradients home in one scatter-add, each input's its own contiguous
rows of it (``ulysses.Routing.home``): autograd hands them on as the inputs' gradients as they
are, with no copy of its own (it copies a gradient whose strides are not the input's)."""

from __future__ import annotations

import pytest
import torch

from ringtrain.train.attention.kernels import get_kernel
from ringtrain.train.attention.ulysses import ulysses_attention

B, S, D = 2, 8, 8


class _Loopback:
    """One rank of a Ulysses group in one thread: what it sends to every rank comes back from
    every rank (the sequence it attends to is its own, repeated)."""

    def __init__(self, size: int) -> None:
        self._size = size

    def rank(self) -> int:
        return self._size - 1

    def size(self) -> int:
        return self._size

    def send_recv(self, *args: object, **kwargs: object) -> None:
        raise AssertionError("Ulysses sends by all-to-all only")

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor) -> None:
        output.copy_(input)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "degree"),
    [(4, 4, 2), (4, 2, 4), (3, 1, 2)],
    ids=["heads split evenly", "KV heads copied to every rank", "query heads padded with a zero head"],
)
def test_the_inputs_gradients_are_the_scatter_adds_rows_not_copies(heads: int, kv_heads: int, degree: int) -> None:
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, S, n, D, generator=gen).requires_grad_() for n in (heads, kv_heads, kv_heads))
    kernel = get_kernel("cpu_flash", device_type="cpu", dtype=torch.float32)
    out = ulysses_attention(q, k, v, group=_Loopback(degree), kernel=kernel)
    out.backward(torch.randn(out.shape, generator=gen))
    grads = [x.grad for x in (q, k, v)]
    assert all(g is not None and g.is_contiguous() for g in grads)
    # One scatter-add's rows, q's then k's then v's, each handed on as it is.
    storages = {g.untyped_storage().data_ptr() for g in grads if g is not None}
    assert len(storages) == 1, "autograd copied a gradient: its strides were not its input's"
    offsets = [g.storage_offset() for g in grads if g is not None]
    assert offsets == [0, B * S * heads * D, B * S * (heads + kv_heads) * D]
