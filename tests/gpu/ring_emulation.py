"""A context-parallel ring of N ranks emulated in one process, on one device.

NCCL refuses two ranks of one communicator on the same GPU, so a one-GPU machine cannot run a
real ring. This runs the real ring attention (``ringtrain.train.attention.ring``), forward and
backward, for every rank at once, each rank a thread, with the ring's P2P exchange
(``RingExchange``) swapped for in-memory mailboxes. The zigzag blocks, their kernels, the LSE
merges and the fp32 dK/dV accumulators that travel around the ring are the real code's; only
the transport is not, and the CPU tier's gloo tests (tests/dist/test_attention.py) cover it.

The autograd ``Function``'s forward and backward are called directly rather than through
autograd: the engine runs every CUDA node of every graph on one thread per device, where rank
0's backward, waiting for rank 1's message, would keep rank 1's backward from ever running.

Every rank's thread queues its kernels on the device's default stream, and a message is
copied there too, after the kernels that produced it: stream order alone makes a received
block complete before anything reads it, as NCCL's stream semantics do in the real ring.

Shape legend: B batch, S local sequence, H query heads, K key/value heads, D head dim.
"""

from __future__ import annotations

import contextlib
import threading
from collections import defaultdict, deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch

from ringtrain.train.attention import ring as ring_module
from ringtrain.train.attention.kernels import AttentionKernel
from ringtrain.train.attention.zigzag import zigzag_shard, zigzag_unshard

Tensor = torch.Tensor


class _Mailboxes:
    """FIFO queues of tensors keyed by (source rank, destination rank, tag)."""

    def __init__(self, timeout_s: float) -> None:
        self._cond = threading.Condition()
        self._queues: defaultdict[tuple[int, int, int], deque[Tensor]] = defaultdict(deque)
        self._timeout_s = timeout_s
        self._failure: Optional[BaseException] = None

    def post(self, src: int, dst: int, tag: int, tensor: Tensor) -> None:
        # A copy, as a send reads the buffer when it runs: the sender may reuse its own after.
        message = tensor.detach().clone()
        with self._cond:
            self._queues[(src, dst, tag)].append(message)
            self._cond.notify_all()

    def take(self, src: int, dst: int, tag: int) -> Tensor:
        key = (src, dst, tag)
        with self._cond:
            arrived = self._cond.wait_for(lambda: self._failure is not None or bool(self._queues[key]), self._timeout_s)
            if self._failure is not None:
                raise RuntimeError(f"rank {dst}: another rank failed") from self._failure
            if not arrived:
                raise TimeoutError(f"rank {dst}: nothing from rank {src} with tag {tag} within {self._timeout_s:g} s")
            return self._queues[key].popleft()

    def fail(self, error: BaseException) -> None:
        """Wake every waiting rank: one rank's failure must not leave the others blocked."""
        with self._cond:
            self._failure = self._failure or error
            self._cond.notify_all()


@dataclass(frozen=True)
class EmulatedGroup:
    """What the ring's exchange gets instead of a process group."""

    rank: int
    world: int
    mailboxes: _Mailboxes


class _EmulatedPending:
    def __init__(self, mailboxes: _Mailboxes, src: int, dst: int, tag: int, recv: list[Tensor]) -> None:
        self._mailboxes, self._src, self._dst, self._tag, self._recv = mailboxes, src, dst, tag, recv

    def wait(self) -> None:
        for i, buffer in enumerate(self._recv):
            buffer.copy_(self._mailboxes.take(self._src, self._dst, self._tag + i))
        self._recv = []


class EmulatedExchange:
    """``RingExchange``'s interface over mailboxes: send to the next rank, receive from the previous."""

    def __init__(self, group: EmulatedGroup) -> None:
        self.group = group
        self.rank = group.rank
        self.world = group.world

    def start(self, send: Sequence[Tensor], recv: Sequence[Tensor], *, tag: int) -> _EmulatedPending:
        if len(send) != len(recv):
            raise ValueError(f"{len(send)} tensors to send but {len(recv)} receive buffers")
        for i, outgoing in enumerate(send):
            self.group.mailboxes.post(self.rank, (self.rank + 1) % self.world, tag + i, outgoing)
        return _EmulatedPending(self.group.mailboxes, (self.rank - 1) % self.world, self.rank, tag, list(recv))


class _Ctx:
    """The part of autograd's function context the ring's forward and backward use."""

    saved_tensors: tuple[Tensor, ...] = ()

    def save_for_backward(self, *tensors: Tensor) -> None:
        self.saved_tensors = tensors


@contextlib.contextmanager
def _emulated_exchange() -> Iterator[None]:
    real = ring_module.RingExchange
    ring_module.RingExchange = EmulatedExchange  # type: ignore[misc, assignment]
    try:
        yield
    finally:
        ring_module.RingExchange = real  # type: ignore[misc]


@dataclass(frozen=True)
class RingResult:
    """The whole sequence's output and gradients, put back in order from every rank's shard."""

    out_BSHD: Tensor
    dq_BSHD: Tensor
    dk_BSKD: Tensor
    dv_BSKD: Tensor


def emulated_ring(
    q_BSHD: Tensor,
    k_BSKD: Tensor,
    v_BSKD: Tensor,
    dout_BSHD: Tensor,
    *,
    world: int,
    kernel: AttentionKernel,
    causal: bool,
    scale: float,
    timeout_s: float = 120.0,
) -> RingResult:
    """Zigzag-shard the full-sequence inputs over ``world`` ranks, run every rank's ring
    forward and backward (each in a thread), and unshard the results."""
    function: Any = getattr(ring_module, "_RingAttention")
    shard = [
        [zigzag_shard(x, dim=1, world=world, rank=r).contiguous() for r in range(world)]
        for x in (q_BSHD, k_BSKD, v_BSKD, dout_BSHD)
    ]
    mailboxes = _Mailboxes(timeout_s)
    results: list[Optional[tuple[Tensor, Tensor, Tensor, Tensor]]] = [None] * world
    errors: list[BaseException] = []

    def rank_main(rank: int) -> None:
        try:
            if q_BSHD.is_cuda:
                torch.cuda.set_device(q_BSHD.device)  # the current device is per thread
            q, k, v, dout = (parts[rank] for parts in shard)
            ctx = _Ctx()
            group = EmulatedGroup(rank, world, mailboxes)
            with torch.no_grad():
                out = function.forward(ctx, q, k, v, None, group, causal, kernel, scale)
                dq, dk, dv, *_ = function.backward(ctx, dout)
            results[rank] = (out, dq, dk, dv)
        except BaseException as error:  # noqa: BLE001 - reported below, after every thread ended
            errors.append(error)
            mailboxes.fail(error)

    with _emulated_exchange():
        threads = [threading.Thread(target=rank_main, args=(r,), name=f"ring-rank{r}") for r in range(world)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    if errors:
        raise errors[0]
    if q_BSHD.is_cuda:
        torch.cuda.synchronize(q_BSHD.device)
    done = [r for r in results if r is not None]
    assert len(done) == world
    out, dq, dk, dv = (zigzag_unshard([r[i] for r in done], dim=1) for i in range(4))
    return RingResult(out, dq, dk, dv)
