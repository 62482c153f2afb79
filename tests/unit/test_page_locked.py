"""Page-locked host memory of an exact size, on a stand-in for the CUDA runtime: what is registered,
and that the registration lasts exactly as long as anything can read the memory."""

from __future__ import annotations

import gc
import mmap
import threading

import numpy as np
import pytest
import torch

from ringtrain.train.page_locked import REGISTER_PORTABLE, HostRegistrar, RegistrationError
from tests.unit.cudart_fake import CUDA_ERROR_MEMORY_ALLOCATION, RecordingCudart

CPU = torch.device("cpu")


def test_the_registration_is_the_exact_size_on_pages_of_its_own() -> None:
    cudart = RecordingCudart()
    num_bytes = 3 * mmap.PAGESIZE + 17  # neither a power of two nor whole pages
    memory = HostRegistrar(cudart, CPU).page_locked(num_bytes)
    assert memory.dtype == np.uint8 and memory.shape == (num_bytes,)
    address = memory.ctypes.data
    assert cudart.registered == [(address, num_bytes, REGISTER_PORTABLE)]
    # CUDA locks whole pages: the ones this memory touches belong to its own allocation alone.
    owner = memory.base
    assert isinstance(owner, np.ndarray) and address % mmap.PAGESIZE == 0
    last_page_end = address + -(-num_bytes // mmap.PAGESIZE) * mmap.PAGESIZE
    assert owner.ctypes.data <= address and last_page_end <= owner.ctypes.data + owner.nbytes


def test_it_stays_registered_until_its_last_view_goes_and_is_unregistered_before_it_is_freed() -> None:
    """64 MiB, so the allocator maps it on its own and unmaps it when freed: the stand-in reads
    the memory as it is unregistered, which would fault had numpy freed it first."""
    cudart = RecordingCudart()
    num_bytes = 64 << 20
    memory = HostRegistrar(cudart, CPU).page_locked(num_bytes)
    address = memory.ctypes.data
    memory[:4], memory[-4:] = [1, 2, 3, 4], [5, 6, 7, 8]
    tensor = torch.from_numpy(memory)[8:16]  # a tensor view, as the snapshot's arrays are
    holder = memory.view()  # a numpy view, as a leased blob's holder is; its base is the owner
    holder.flags.writeable = False
    blob = holder.data[10:]  # a memoryview of it, sliced, as a caller keeps a blob
    del memory, holder
    gc.collect()
    assert cudart.unregistered == []
    del tensor
    gc.collect()
    assert cudart.unregistered == [], "unregistered while a blob still reads the memory"
    del blob
    gc.collect()
    assert cudart.unregistered == [address]
    assert cudart.ends_at_unregister[address] == bytes([1, 2, 3, 4, 5, 6, 7, 8])


def test_a_refused_registration_raises_and_leaves_its_error_off_the_callers_thread() -> None:
    """A failed runtime call stays its thread's last error, which torch's next checked launch
    would raise: the registration runs on a thread of its own, not the training thread."""
    cudart = RecordingCudart(refuse_from=0)
    with pytest.raises(RegistrationError, match=f"{1 << 20} bytes failed with cudaError 2") as refused:
        HostRegistrar(cudart, CPU).page_locked(1 << 20)
    assert refused.value.cuda_error == CUDA_ERROR_MEMORY_ALLOCATION
    assert cudart.attempts == 1 and threading.get_ident() not in cudart.threads
    gc.collect()
    assert cudart.registered == [] and cudart.unregistered == []  # nothing to undo


def test_no_registrar_off_cuda() -> None:
    assert HostRegistrar.for_device(CPU) is None
