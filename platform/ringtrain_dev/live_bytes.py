"""Live tensor storage, counted as torch allocates and frees it, and its peak: what the planner
predicts of a rank's memory (parameters, gradients, optimizer states, buffers, activations and
the backward's working set) and nothing outside torch (the interpreter, numpy arrays, gloo's own
buffers). On a CPU it stands in for the CUDA allocator's peak.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Optional


class LiveBytes:
    """Bytes of every tensor storage created while active, and their peak.

    A ``TorchDispatchMode`` sees every op's outputs, autograd's backward ops included (on a CPU
    they run on the calling thread). Each new storage is counted once, however many views share
    it, and a weakref finalizer takes it off when the storage dies, on whichever thread drops
    the last reference (gloo's worker threads do for some communication buffers). Storages that
    already existed when the mode was entered are not counted. ``device_type`` counts only the
    storages of that device type (None: every one).

    Used as ``with LiveBytes() as live:`` (or ``with live.mode:``), then ``live.peak``.
    """

    def __init__(self, device_type: Optional[str] = None) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        tracker = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Optional[dict[str, Any]] = None) -> Any:
                out = func(*args, **(kwargs or {}))
                tracker.observe(out)
                return out

        self.mode = _Mode()
        self.device_type = device_type
        self.live: dict[int, int] = {}
        self.current = 0
        self.peak = 0
        self._lock = threading.Lock()

    def observe(self, out: Any) -> None:
        import torch
        from torch.utils._pytree import tree_leaves

        for leaf in tree_leaves(out):
            if not isinstance(leaf, torch.Tensor) or self.device_type not in (None, leaf.device.type):
                continue
            storage = leaf.untyped_storage()
            key, nbytes = id(storage), storage.nbytes()
            with self._lock:
                known = key in self.live
                self.current += nbytes - self.live.get(key, 0)  # in-place resizes change nbytes
                self.live[key] = nbytes
            if not known:
                weakref.finalize(storage, self._forget, key)
        self.peak = max(self.peak, self.current)

    def _forget(self, key: int) -> None:
        with self._lock:
            self.current -= self.live.pop(key, 0)

    def reset_peak(self) -> None:
        """The peak from here on: what was live before still counts, its own peak not."""
        self.peak = self.current

    def __enter__(self) -> LiveBytes:
        self.mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.mode.__exit__(*exc)


def loss_peak(hidden: Any, weight: Any, labels: Any, chunk: int) -> int:
    """Peak live bytes of one forward and backward of the output projection and the loss
    (train/loss.py) over ``hidden``: in chunks of ``chunk`` tokens, or over whole logits (0).
    What the inputs hold already is not counted."""
    import gc

    from ringtrain.train.loss import chunked_cross_entropy_sum, full_cross_entropy_sum

    gc.collect()
    with LiveBytes() as live:
        loss = chunked_cross_entropy_sum(hidden, weight, labels, chunk) if chunk else full_cross_entropy_sum(hidden, weight, labels)
        loss.backward()
        del loss
    return live.peak
