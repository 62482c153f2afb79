"""A stand-in for the CUDA runtime's host registration (``torch.cuda.cudart()``), for tests on CPU."""

from __future__ import annotations

import ctypes
import threading
from typing import Optional

CUDA_ERROR_MEMORY_ALLOCATION = 2  # what cudaHostRegister answers when the host cannot lock more


class RecordingCudart:
    """Records each registration (address, size, flags) and the thread it came from, and each
    unregistration with the first and last bytes the memory held then (read from the memory
    itself: were it freed and unmapped already, the read would fault). From registration
    ``refuse_from`` on (counting from 0) it refuses, as a host out of lockable memory does."""

    def __init__(self, refuse_from: Optional[int] = None) -> None:
        self.refuse_from = refuse_from
        self.attempts = 0
        self.registered: list[tuple[int, int, int]] = []
        self.threads: list[int] = []
        self.unregistered: list[int] = []
        self.ends_at_unregister: dict[int, bytes] = {}
        self._sizes: dict[int, int] = {}

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:
        self.threads.append(threading.get_ident())
        self.attempts += 1
        if self.refuse_from is not None and self.attempts > self.refuse_from:
            return CUDA_ERROR_MEMORY_ALLOCATION
        self.registered.append((ptr, size, flags))
        self._sizes[ptr] = size
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:
        size = self._sizes.pop(ptr)
        self.ends_at_unregister[ptr] = ctypes.string_at(ptr, 4) + ctypes.string_at(ptr + size - 4, 4)
        self.unregistered.append(ptr)
        return 0

    def addresses(self) -> list[int]:
        return [ptr for ptr, _, _ in self.registered]
