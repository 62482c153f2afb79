"""The gradients context-parallel attention hands autograd are each input's own contiguous
tensor, as an input's gradient must be laid out (autograd copies one that is not, and so does a
projection's backward): Ulysses brings q, k and v's home in one gather whose rows are laid
out input by input (``ulysses.Routing.home``); the ring's, accumulated in fp32 in the kernel's
layout, are laid out BSHD by the cast to the inputs' dtype that copies them anyway. A call with
one uncut block casts nothing: its output and gradients are the kernel's own. Where Ulysses
copies a KV head to several ranks, its gradient is the sum of the copies' gradients, each the
gradient its rank's own call gives."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ringtrain.train.attention.attend import local_attention, ring_attention
from ringtrain.train.attention.kernels import get_kernel
from ringtrain.train.attention.ulysses import ulysses_attention
from ringtrain_dev.emulated_cp import emulated_attention
from ringtrain_dev.loopback import LoopbackTransport

B, S, D = 2, 8, 8


@pytest.mark.parametrize(
    ("heads", "kv_heads", "degree"),
    [(4, 4, 2), (4, 2, 4), (3, 1, 2)],
    ids=["heads split evenly", "KV heads copied to every rank", "query heads padded with a zero head"],
)
def test_the_inputs_gradients_are_the_home_gathers_rows_not_copies(heads: int, kv_heads: int, degree: int) -> None:
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, S, n, D, generator=gen).requires_grad_() for n in (heads, kv_heads, kv_heads))
    kernel = get_kernel("cpu_flash", device_type="cpu", dtype=torch.float32)
    out = ulysses_attention(q, k, v, group=LoopbackTransport(degree - 1, degree), kernel=kernel)
    out.backward(torch.randn(out.shape, generator=gen))
    grads = [x.grad for x in (q, k, v)]
    assert all(g is not None and g.is_contiguous() for g in grads)
    # One gather's rows, q's then k's then v's, each handed on as it is.
    storages = {g.untyped_storage().data_ptr() for g in grads if g is not None}
    assert len(storages) == 1, "autograd copied a gradient: its strides were not its input's"
    offsets = [g.storage_offset() for g in grads if g is not None]
    assert offsets == [0, B * S * heads * D, B * S * (heads + kv_heads) * D]


def test_the_rings_gradients_leave_bshd_contiguous_from_the_cast_that_copies_them() -> None:
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 16, n, D, generator=gen).bfloat16().requires_grad_() for n in (4, 2, 2))
    handed: list[torch.Tensor] = []
    for x in (q, k, v):
        x.register_hook(handed.append)  # the gradient as the attention returns it, before autograd's copy
    kernel = get_kernel("cpu_flash", device_type="cpu", dtype=torch.bfloat16)
    out = ring_attention(q, k, v, group=LoopbackTransport(3, 4), kernel=kernel)
    out.backward(torch.ones_like(out))
    assert [g.dtype for g in handed] == [torch.bfloat16] * 3
    assert all(g.is_contiguous() for g in handed), [g.stride() for g in handed]


class _Ops(TorchDispatchMode):
    """The aten ops dispatched under it, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.counted: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.counted[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def test_a_local_call_is_the_kernels_one_call_with_no_round_trip_through_fp32() -> None:
    # One rank, no documents, no window (as Ulysses' gathered sequence is too): nothing to merge,
    # so the output and the gradients leave as the kernel made them, in bf16, rather than through
    # the loop's fp32 accumulators and back (two copy kernels each way on a GPU).
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 16, n, D, generator=gen).bfloat16().requires_grad_() for n in (4, 2, 2))
    dout = torch.randn(1, 16, 4, D, generator=gen).bfloat16()
    kernel = get_kernel("cpu_flash", device_type="cpu", dtype=torch.bfloat16)
    with _Ops() as ops:
        local_attention(q, k, v, kernel=kernel).backward(dout)
    assert ops.counted["aten._scaled_dot_product_flash_attention_for_cpu"] == 1
    assert ops.counted["aten._scaled_dot_product_flash_attention_for_cpu_backward"] == 1
    assert ops.counted["aten._to_copy"] == 0, ops.counted


def _index_add_rounding_at_every_add(self: torch.Tensor, dim: int, index: torch.Tensor, source: torch.Tensor, *,
                                     alpha: float = 1) -> torch.Tensor:
    """``Tensor.index_add_`` as a GPU's atomics run it: a row at a time in the tensor's dtype, so a
    bf16 sum rounds at every add (the CPU's sums in fp32 and rounds once)."""
    for i, row in zip(index.tolist(), source.unbind(dim)):
        self.select(dim, i).add_(row, alpha=alpha)
    return self


@pytest.mark.parametrize("gpu_scatter_add", [False, True], ids=["cpu", "a scatter-add rounding at every add"])
@pytest.mark.parametrize("heads", [2, 4], ids=["two copies", "four copies"])
def test_a_copied_kv_heads_gradient_is_its_copies_gradients_summed(heads: int, gpu_scatter_add: bool,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    # MQA over as many ranks as heads: every rank attends with its own copy of the one KV head,
    # and the copies' gradients are summed on the way home: the gradients of the ranks' calls (each
    # one query head over the whole sequence), bit for bit, summed in fp32 and rounded once. A sum
    # that rounded at every add (one bf16 add per copy, as a GPU's scatter-add does) errs here.
    if gpu_scatter_add:  # on the Tensor class: the emulator's ranks are threads
        monkeypatch.setattr(torch.Tensor, "index_add_", _index_add_rounding_at_every_add)
    seq = 64
    gen = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(1, seq, n, D, generator=gen).bfloat16() for n in (heads, 1, 1, heads))
    kernel = get_kernel("cpu_flash", device_type="cpu", dtype=torch.bfloat16)
    _, grads = emulated_attention(q, k, v, dout, ring=1, ulysses=heads, kernel=kernel)
    assert grads is not None
    per_head: list[list[torch.Tensor]] = [[], []]
    for head in range(heads):  # rank ``head``'s call: its query head, its copy of the KV head
        k_copy, v_copy = (x.clone().requires_grad_() for x in (k, v))
        one = slice(head, head + 1)
        local_attention(q[:, :, one], k_copy, v_copy, kernel=kernel).backward(dout[:, :, one])
        per_head[0].append(k_copy.grad)
        per_head[1].append(v_copy.grad)
    for name, got, copies in (("dk", grads[1], per_head[0]), ("dv", grads[2], per_head[1])):
        want = torch.stack(copies).float().sum(dim=0).bfloat16()
        assert torch.equal(got, want), f"{name}: {(got.float() - want.float()).abs().max()}"
