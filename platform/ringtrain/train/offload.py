"""Activation offload: the tensors autograd saves inside chosen layers wait in host memory until the backward.

``ActivationOffloader.layer(i)`` wraps layer i's forward in ``torch.autograd.graph.
saved_tensors_hooks``: each tensor autograd saves there (parameters and tiny tensors excepted)
is copied to host memory and only a handle stays in the graph, so the device holds none of that
layer's saved activations between its forward and its backward. With activation checkpointing
the checkpoint keeps only the layer's inputs, and those are what is offloaded.

On CUDA the copies go to pinned host memory on a side stream, overlapping the forward. The
backward needs the layers last to first; when it first unpacks a tensor of layer i it starts
copying layer i - 1's tensors back on the side stream, so each layer's transfer overlaps the
backward of the one after it (prefetch one layer ahead), and the current stream waits for a
layer's copy only where it uses it. A layer's device copies are released to autograd as they
are unpacked; at most two offloaded layers are on the device in the backward.

On CPU there is no second memory: the "host" copies are clones kept in a store of their own
(``host_bytes``), and ``saved_bytes``/``kept_bytes`` tell what left the graph and what stayed,
so the saving can be measured on CPU by counting live tensor storage outside that store
(tests/unit/test_offload.py). The values are bit for bit those saved, so gradients are equal.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

import torch
from torch.autograd.graph import saved_tensors_hooks

# Smaller saved tensors stay put: a transfer's fixed cost outweighs their bytes.
DEFAULT_MIN_BYTES = 1024


@dataclass
class _Layer:
    """One offloaded layer's saved tensors: host copies, device copies once fetched."""

    index: int
    host: list[torch.Tensor] = field(default_factory=list)
    device: Optional[list[torch.Tensor]] = None
    event: Optional[Any] = None  # torch.cuda.Event: the device copies are complete
    pending: int = 0  # handles not yet unpacked
    # Within a layer's forward, a tensor saved twice (the normed input of wq, wk and wv) is
    # copied once: (original, slot); the original is held until the layer's forward ends so
    # its address cannot be reused by another tensor meanwhile.
    seen: dict[tuple[Any, ...], tuple[torch.Tensor, int]] = field(default_factory=dict)


@dataclass(frozen=True)
class _Handle:
    layer: int
    slot: int


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _is_parameter(t: torch.Tensor) -> bool:
    """A parameter or a view of one (a linear layer on CPU saves its weight transposed)."""
    base = t._base if t._base is not None else t
    return base.is_leaf and base.requires_grad


class ActivationOffloader:
    """Offloads the saved activations of layers ``0 .. num_layers - 1`` (see module doc)."""

    def __init__(self, num_layers: int, device: torch.device, *, min_bytes: int = DEFAULT_MIN_BYTES) -> None:
        self.num_layers = num_layers
        self.device = device
        self.min_bytes = min_bytes
        self.layers: dict[int, _Layer] = {}
        self._stream: Optional[Any] = None
        self.saved_bytes = 0  # moved off the device in the last forward
        self.kept_bytes = 0  # saved inside offloaded layers but left on the device

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def host_bytes(self) -> int:
        """Bytes of host copies held now."""
        return sum(_nbytes(h) for layer in self.layers.values() for h in layer.host)

    def host_storages(self) -> list[torch.UntypedStorage]:
        """The storages of the host copies held now (what a CPU measurement must not count as device)."""
        return [h.untyped_storage() for layer in self.layers.values() for h in layer.host]

    def _side_stream(self) -> Any:
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        return self._stream

    @contextlib.contextmanager
    def layer(self, index: int) -> Iterator[None]:
        """Offload what autograd saves inside this block, when layer ``index`` is one to offload."""
        if index >= self.num_layers or not torch.is_grad_enabled():
            yield
            return
        if index == 0:
            self.saved_bytes = self.kept_bytes = 0
        state = _Layer(index)
        self.layers[index] = state
        try:
            with saved_tensors_hooks(lambda t: self._pack(state, t), self._unpack):
                yield
        finally:
            state.seen.clear()

    def _pack(self, state: _Layer, t: torch.Tensor) -> Any:
        if _is_parameter(t):
            return t  # weights are not activations: they stay, and are not counted
        if t.device != self.device or _nbytes(t) < self.min_bytes:
            self.kept_bytes += _nbytes(t)
            return t  # not worth a transfer
        key = (t.data_ptr(), t.dtype, tuple(t.shape), t.stride())
        if key in state.seen:
            state.pending += 1
            return _Handle(state.index, state.seen[key][1])
        if self.cuda:
            stream = self._side_stream()
            host = torch.empty_like(t, device="cpu", pin_memory=True)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                host.copy_(t, non_blocking=True)
            t.record_stream(stream)  # the allocator keeps t's memory until the copy is done
        else:
            host = t.detach().clone()
        state.host.append(host)
        state.seen[key] = (t, len(state.host) - 1)
        state.pending += 1
        self.saved_bytes += _nbytes(t)
        return _Handle(state.index, len(state.host) - 1)

    def _fetch(self, state: _Layer) -> None:
        """Start copying a layer's tensors back to the device (on the side stream on CUDA)."""
        if state.device is not None:
            return
        if self.cuda:
            stream = self._side_stream()
            with torch.cuda.stream(stream):
                state.device = [h.to(self.device, non_blocking=True) for h in state.host]
                state.event = torch.cuda.Event()
                state.event.record(stream)
        else:
            state.device = [h.clone() for h in state.host]

    def _unpack(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, _Handle):
            assert isinstance(packed, torch.Tensor)
            return packed
        state = self.layers[packed.layer]
        self._fetch(state)
        earlier = self.layers.get(packed.layer - 1)
        if earlier is not None:
            self._fetch(earlier)  # prefetch one layer ahead of the backward
        assert state.device is not None
        out = state.device[packed.slot]
        if self.cuda:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(state.event)
            out.record_stream(current)
        state.pending -= 1
        if state.pending == 0:
            del self.layers[packed.layer]  # every handle unpacked: autograd holds what it needs
        return out
