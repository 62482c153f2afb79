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

A tensor saved more than once (the normed input of wq, wk and wv inside a layer; the rotary
cos/sin tables every layer saves) has one host copy: saved tensors are keyed by storage
identity (storage, offset, dtype, shape, strides, version counter), and a key is only trusted
while a weak reference to its storage is alive, so a freed storage whose address is reused
never matches. The host copy is shared by every layer that saved it and released when the last
of them has been unpacked; a layer fetched while another's copy of the same tensor is still on
the device reuses it.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

import torch
from torch.autograd.graph import saved_tensors_hooks

# Smaller saved tensors stay put: a transfer's fixed cost outweighs their bytes.
DEFAULT_MIN_BYTES = 1024


@dataclass
class _Copy:
    """One saved tensor's host copy, shared by every layer that saved the same storage."""

    host: torch.Tensor
    users: int = 0  # handles, over all layers, not yet unpacked
    device: Optional[torch.Tensor] = None  # the fetched copy, while a layer still needs it


@dataclass
class _Layer:
    """One offloaded layer's saved tensors: shared host copies, device copies once fetched."""

    index: int
    copies: list[_Copy] = field(default_factory=list)
    device: Optional[list[torch.Tensor]] = None
    event: Optional[Any] = None  # torch.cuda.Event: the device copies are complete
    pending: int = 0  # handles not yet unpacked


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
        # Storage identity -> (weak reference to the storage, its copy): see the module doc.
        self._copies: dict[tuple[Any, ...], tuple[Any, _Copy]] = {}
        self._stream: Optional[Any] = None
        self.saved_bytes = 0  # moved off the device in the last forward
        self.kept_bytes = 0  # saved inside offloaded layers but left on the device

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def _held(self) -> list[_Copy]:
        unique = {id(c): c for layer in self.layers.values() for c in layer.copies}
        return list(unique.values())

    def host_bytes(self) -> int:
        """Bytes of host copies held now (each shared copy once)."""
        return sum(_nbytes(c.host) for c in self._held())

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
            self._copies.clear()
        state = _Layer(index)
        self.layers[index] = state
        with saved_tensors_hooks(lambda t: self._pack(state, t), self._unpack):
            yield
        if index == self.num_layers - 1:
            self._copies.clear()  # the forward's last offloaded layer: no more saves to match

    def _pack(self, state: _Layer, t: torch.Tensor) -> Any:
        if _is_parameter(t):
            return t  # weights are not activations: they stay, and are not counted
        if t.device != self.device or _nbytes(t) < self.min_bytes:
            self.kept_bytes += _nbytes(t)
            return t  # not worth a transfer
        storage = t.untyped_storage()
        # The version counter too: a storage written in place between two saves is two values.
        key = (storage.data_ptr(), storage.nbytes(), t.storage_offset(), t.dtype, tuple(t.shape), t.stride(), t._version)
        known = self._copies.get(key)
        if known is not None and known[0]() is storage:
            copy = known[1]
        else:
            copy = _Copy(self._copy_out(t))
            self._copies[key] = (weakref.ref(storage), copy)
            self.saved_bytes += _nbytes(t)
        copy.users += 1
        state.pending += 1
        if not any(c is copy for c in state.copies):
            state.copies.append(copy)
        return _Handle(state.index, next(i for i, c in enumerate(state.copies) if c is copy))

    def _copy_out(self, t: torch.Tensor) -> torch.Tensor:
        if not self.cuda:
            return t.detach().clone()
        stream = self._side_stream()
        host = torch.empty_like(t, device="cpu", pin_memory=True)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            host.copy_(t, non_blocking=True)
        t.record_stream(stream)  # the allocator keeps t's memory until the copy is done
        return host

    def _fetch(self, state: _Layer) -> None:
        """Start copying a layer's tensors back to the device (on the side stream on CUDA);
        a copy another layer has fetched and not yet released is reused."""
        if state.device is not None:
            return
        if self.cuda:
            stream = self._side_stream()
            with torch.cuda.stream(stream):
                state.device = [self._device_copy(c) for c in state.copies]
                state.event = torch.cuda.Event()
                state.event.record(stream)
        else:
            state.device = [self._device_copy(c) for c in state.copies]

    def _device_copy(self, copy: _Copy) -> torch.Tensor:
        if copy.device is None:
            copy.device = copy.host.to(self.device, non_blocking=True) if self.cuda else copy.host.clone()
        return copy.device

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
        copy = state.copies[packed.slot]
        copy.users -= 1
        if copy.users == 0:
            copy.device = None  # autograd holds what it needs; the host copy goes with the last layer
        state.pending -= 1
        if state.pending == 0:
            del self.layers[packed.layer]  # every handle unpacked: autograd holds what it needs
        return out
