"""Page-locked host memory of an exact size: an ordinary host allocation registered with CUDA.

torch's pinned pool (``pin_memory=True``) rounds every request up to a power of two (its caching
host allocator keeps blocks by size class), so a 13.2 GB snapshot buffer pinned there locks
17.2 GB and a 20.65 GB one 34.4 GB. Memory allocated here and registered with the CUDA runtime
locks what was asked for, and CUDA treats it as page-locked all the same: a ``non_blocking`` copy
from the device into it is an asynchronous DMA, and ``Tensor.is_pinned()`` says True of a tensor
on it.

The memory is a numpy array's, and it stays registered while anything can read or write it:
every numpy view holds the array that owns the memory (its ``base``), a tensor ``torch.from_numpy``
made holds its array, a memoryview holds its exporter, and whoever queues a copy into it holds
one of those until the copy is done. When the owner's last holder is gone, numpy runs its weakref
callbacks before it frees the data (``array_dealloc`` clears the weak references first), and the
callback set here unregisters the memory there: after its last use, before it is freed.
"""

from __future__ import annotations

import logging
import mmap
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Optional, Protocol

import numpy as np
import torch

_log = logging.getLogger(__name__)

# cudaHostRegisterPortable: page-locked for every CUDA context of the process, not only the
# registering thread's.
REGISTER_PORTABLE = 1


class Cudart(Protocol):
    """The CUDA runtime's calls used here, as ``torch.cuda.cudart()`` binds them (tests pass a
    stand-in). Each returns a ``cudaError``: 0 is success."""

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> Any: ...

    def cudaHostUnregister(self, ptr: int) -> Any: ...


class RegistrationError(RuntimeError):
    """The CUDA runtime would not page-lock the memory (the host cannot lock that much, say)."""

    def __init__(self, num_bytes: int, cuda_error: int) -> None:
        super().__init__(f"cudaHostRegister of {num_bytes} bytes failed with cudaError {cuda_error}")
        self.num_bytes = num_bytes
        self.cuda_error = cuda_error


class HostRegistrar:
    """Makes page-locked host memory for copies from ``device``."""

    def __init__(self, cudart: Cudart, device: torch.device) -> None:
        self.cudart = cudart
        self.device = device

    @classmethod
    def for_device(cls, device: torch.device) -> Optional[HostRegistrar]:
        """The CUDA runtime's registrar on a CUDA device; None elsewhere (nothing to lock for)."""
        if device.type != "cuda":
            return None
        # An index of its own: the registering thread is set to it (the caller's current device).
        index = torch.cuda.current_device() if device.index is None else device.index
        return cls(torch.cuda.cudart(), torch.device("cuda", index))

    def page_locked(self, num_bytes: int) -> np.ndarray:
        """A new uint8 array of ``num_bytes``, registered with CUDA until its last holder is gone;
        ``RegistrationError`` where CUDA refuses. The array starts on a page and shares none of
        its pages with other memory: CUDA locks whole pages, and may refuse a page that another
        registration already holds."""
        page = mmap.PAGESIZE
        owner = np.empty(-(-num_bytes // page) * page + page, dtype=np.uint8)
        start = -owner.ctypes.data % page
        memory = owner[start : start + num_bytes]
        address = memory.ctypes.data
        error = _runtime_call(self.device, lambda: self.cudart.cudaHostRegister(address, num_bytes, REGISTER_PORTABLE))
        if error != 0:
            raise RegistrationError(num_bytes, error)
        # On the owner, not on ``memory``: a view taken from ``memory`` holds the owner itself,
        # so ``memory`` may go while such a view still reads the registered pages.
        unregister = weakref.finalize(owner, _unregister, self.cudart, self.device, address, num_bytes)
        # At exit the process's memory goes whole, and the runtime may already be shut down.
        unregister.atexit = False
        return memory


def _runtime_call(device: torch.device, call: Callable[[], Any]) -> int:
    """A CUDA runtime call's cudaError, from a thread of its own set to ``device``: a failed call
    stays its thread's last error, which torch's next checked kernel launch on that thread (the
    training thread's, say) would raise as its own (torch binds no ``cudaGetLastError`` to clear
    it with)."""

    def run() -> int:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        return int(call())

    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="cuda-host-memory") as pool:
        return pool.submit(run).result()


def _unregister(cudart: Cudart, device: torch.device, address: int, num_bytes: int) -> None:
    """The finalizer: it runs on whichever thread drops the memory's last holder."""
    try:
        error = _runtime_call(device, lambda: cudart.cudaHostUnregister(address))
    except RuntimeError:  # no new thread while the interpreter shuts down: the memory goes with the process
        return
    if error != 0:  # a finalizer must not raise; the memory is freed all the same
        _log.warning("cudaHostUnregister of %d bytes at %#x failed with cudaError %d", num_bytes, address, error)
