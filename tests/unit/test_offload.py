"""Activation offload (train/offload.py): gradients bit for bit those without it, and the bytes
left on the device fall by what the offloaded layers saved.

How the saving is measured on CPU, where host and "device" are the same memory: a dispatch mode
(``LiveBytes``) adds up every live tensor storage after the forward, and the offloader's host
copies (its own store, which on a GPU is pinned host memory) are subtracted; what remains is what
a GPU would hold. The expected fall is measured too, not derived: a forward without offload
records which storages autograd saved inside each layer, and the ones that only offloaded layers
saved are what must leave.
"""

from __future__ import annotations

import gc
from typing import Any

import pytest
import torch

from ringtrain.train.model import MemorySavers, Transformer
from ringtrain.train.offload import DEFAULT_MIN_BYTES, _is_parameter
from ringtrain_dev.live_bytes import LiveBytes
from tests.unit.savers_tools import TINY, batch, grads, quiet_cpu, tiny_model  # noqa: F401

SEQ = 32  # tokens per row: enough for every saved tensor to clear DEFAULT_MIN_BYTES


@pytest.mark.parametrize("checkpointing", ["none", "full", "selective"])
def test_gradients_are_bitwise_equal_with_and_without_offload(checkpointing: str) -> None:
    ref = grads(tiny_model(MemorySavers(checkpointing=checkpointing, mlp_tiles=2)), seq=SEQ)
    got = grads(tiny_model(MemorySavers(checkpointing=checkpointing, offload_layers=2, mlp_tiles=2)), seq=SEQ)
    assert ref.keys() == got.keys()
    assert all(torch.equal(got[k], ref[k]) for k in ref), [k for k in ref if not torch.equal(got[k], ref[k])]


def _device_bytes_after_forward(model: Transformer) -> tuple[int, Any]:
    ids, pos, labels = batch(SEQ)
    gc.collect()
    with LiveBytes() as live:
        loss = model(ids, pos, labels)
        gc.collect()
        host = model.offloader.host_bytes() if model.offloader is not None else 0
        device = live.current - host
    return device, loss


def _saved_only_by(model: Transformer, offloaded: int) -> int:
    """Bytes of the storages autograd saves inside layers < ``offloaded`` and nowhere else
    (module hooks mark which layer runs; a forward without offload)."""
    region: list[Any] = ["rest"]
    saved: dict[int, tuple[int, set[Any]]] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if not _is_parameter(t):
            s = t.untyped_storage()
            saved.setdefault(s.data_ptr(), (s.nbytes(), set()))[1].add(region[0])
        return t

    for i, layer in enumerate(model.layers):
        layer.register_forward_pre_hook(lambda m, a, i=i: region.__setitem__(0, i))
        layer.register_forward_hook(lambda m, a, o: region.__setitem__(0, "rest"))
    ids, pos, labels = batch(SEQ)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(ids, pos, labels)
    # Tensors under DEFAULT_MIN_BYTES stay on the device by design (a transfer costs more).
    return sum(
        n for n, where in saved.values() if n >= DEFAULT_MIN_BYTES and all(w != "rest" and w < offloaded for w in where)
    )


def test_device_bytes_fall_by_what_the_offloaded_layers_saved() -> None:
    plain, _ = _device_bytes_after_forward(tiny_model())
    model = tiny_model(MemorySavers(offload_layers=2))
    offloaded, loss = _device_bytes_after_forward(model)
    expected = _saved_only_by(tiny_model(), 2)
    assert expected > 0
    assert plain - offloaded == expected, (plain, offloaded, expected)
    assert model.offloader is not None and model.offloader.saved_bytes >= expected
    loss.backward()
    assert model.offloader.host_bytes() == 0  # every layer came back and was released


def test_with_checkpointing_the_layer_inputs_are_what_leaves() -> None:
    full = MemorySavers(checkpointing="full")
    plain, _ = _device_bytes_after_forward(tiny_model(full))
    offloaded, _ = _device_bytes_after_forward(tiny_model(MemorySavers(checkpointing="full", offload_layers=2)))
    layer_input = 2 * SEQ * TINY.dim * 4  # batch x seq x dim fp32
    assert plain - offloaded == 2 * layer_input


def test_a_tensor_every_layer_saves_has_one_host_copy() -> None:
    """The rotary cos/sin tables are saved by every layer (and by every checkpoint): one host copy
    each, not one per layer, and the host holds exactly the distinct storages the layers saved."""
    for mode in ("none", "full"):
        model = tiny_model(MemorySavers(checkpointing=mode, offload_layers=TINY.n_layers))
        ids, pos, labels = batch(SEQ)
        cos, _ = model.rope.cos_sin(pos)
        loss = model(ids, pos, labels)
        assert model.offloader is not None
        held = [c.host for c in model.offloader._held()]
        assert sum(h.shape == cos.shape for h in held) == 2, (mode, [tuple(h.shape) for h in held])
        assert model.offloader.host_bytes() == model.offloader.saved_bytes
        loss.backward()
        assert model.offloader.host_bytes() == 0
