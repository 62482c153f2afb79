"""A context-parallel group emulated in one process, on one device: every rank a thread.

NCCL refuses two ranks of one communicator on the same GPU, so a one-GPU machine cannot run a
real ring; and a CPU machine cannot run CUDA at all, but can run the CUDA code path on fake
CUDA tensors (``FakeTensorMode``), which is how the unit tier catches a tensor made on the
wrong device. Both run the real attention code of every rank at once, each rank a thread, each
handed an ``EmulatedTransport`` (the attention package's ``Transport`` over in-memory mailboxes)
where a job hands a process group's. The exchanges, the blocks, their kernels, the LSE merges
and the fp32 dK/dV accumulators that travel around the ring are the real code's; only the
transport is not, and the CPU tier's gloo tests (tests/dist/test_attention.py) cover it.

``emulated_ring`` calls the loop's forward and backward halves directly rather
than through autograd: on CUDA the engine runs every node of every graph on one thread per
device, where rank 0's backward, waiting for rank 1's message, would keep rank 1's backward from
ever running. ``emulated_attention`` runs any implementation through autograd, for devices whose
backward runs on the calling thread (CPU, meta).

Every rank's thread queues its kernels on the device's default stream, and a message is
copied there too, after the kernels that produced it: stream order alone makes a received
block complete before anything reads it, as NCCL's stream semantics do in the real ring.

Shape legend: B batch, S local sequence, H query heads, K key/value heads, D head dim, U ranks
of a group.
"""

from __future__ import annotations

import contextlib
import threading
from collections import defaultdict, deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ContextManager, Optional, Union

import torch

from ringtrain.topology import CPLayout
from ringtrain.train.attention.call import AttentionCall
from ringtrain.train.attention.documents import Documents
from ringtrain.train.attention.exchanges import EXCHANGES
from ringtrain.train.attention.implementations import ContextParallelAttention, build_attention
from ringtrain.train.attention.kernels import AttentionKernel
from ringtrain.train.attention.loop import attend_backward, attend_forward
from ringtrain.train.attention.transport import check_contiguous, send_recv_tensors
from ringtrain.train.attention.zigzag import cp_shard, cp_unshard, zigzag_shard, zigzag_unshard

Tensor = torch.Tensor
RankContext = Callable[[], ContextManager[Any]]
# Tags of the collectives, apart from the ring's own (which are small).
_ALL_TO_ALL_TAG = 1000
_ALL_GATHER_TAG = 2000
_REDUCE_SCATTER_TAG = 3000

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


_in_transport = threading.local()


def in_transport() -> bool:
    """Whether this thread is inside the emulated transport: a count of the attention code's own
    ops (bench/host_ops.py) leaves out what stands in for the network."""
    return bool(getattr(_in_transport, "depth", 0))


@contextlib.contextmanager
def _transport_work() -> Iterator[None]:
    depth = getattr(_in_transport, "depth", 0)
    _in_transport.depth = depth + 1
    try:
        yield
    finally:
        _in_transport.depth = depth


class _Arrivals:
    """Receives posted by ``send_recv``: each buffer filled from its mailbox on ``wait()``."""

    def __init__(self, mailboxes: _Mailboxes, dst: int, expected: list[tuple[int, int, Tensor]]) -> None:
        self._mailboxes, self._dst, self._expected = mailboxes, dst, expected

    def wait(self) -> None:
        with _transport_work():
            for src, tag, buffer in self._expected:
                buffer.copy_(self._mailboxes.take(src, self._dst, tag))
        self._expected = []


@dataclass(frozen=True)
class EmulatedTransport:
    """A ``Transport`` whose messages go through mailboxes in memory: rank ``index`` of a group of
    ``world`` ranks that share ``mailboxes``."""

    index: int
    world: int
    mailboxes: _Mailboxes

    def rank(self) -> int:
        return self.index

    def size(self) -> int:
        return self.world

    def send_recv(self, sends: Mapping[int, Sequence[Tensor]], recvs: Mapping[int, Sequence[Tensor]], *,
                  tag: int) -> _Arrivals:
        with _transport_work():
            check_contiguous("send_recv", *send_recv_tensors(sends, recvs))
            for peer, tensors in sends.items():
                for i, outgoing in enumerate(tensors):
                    self.mailboxes.post(self.index, peer, tag + i, outgoing)
        return _Arrivals(self.mailboxes, self.index,
                         [(peer, tag + i, buffer) for peer, buffers in recvs.items() for i, buffer in enumerate(buffers)])

    def all_to_all(self, output: Tensor, input: Tensor) -> None:
        with _transport_work():
            check_contiguous("all_to_all", output, input)
            for dst, piece in enumerate(input.chunk(self.world)):
                self.mailboxes.post(self.index, dst, _ALL_TO_ALL_TAG, piece)
            for src, buffer in enumerate(output.chunk(self.world)):
                buffer.copy_(self.mailboxes.take(src, self.index, _ALL_TO_ALL_TAG))

    def all_gather(self, x: Tensor) -> Tensor:
        with _transport_work():
            for dst in range(self.world):
                self.mailboxes.post(self.index, dst, _ALL_GATHER_TAG, x)
            return torch.stack([self.mailboxes.take(src, self.index, _ALL_GATHER_TAG) for src in range(self.world)])

    def reduce_scatter(self, x_U: Tensor) -> Tensor:
        """Slice u of every rank's ``x``, summed on rank u (in rank order, so every rank adds the
        same numbers in the same order)."""
        with _transport_work():
            for dst, piece in enumerate(x_U.unbind(0)):
                self.mailboxes.post(self.index, dst, _REDUCE_SCATTER_TAG, piece)
            parts = [self.mailboxes.take(src, self.index, _REDUCE_SCATTER_TAG) for src in range(self.world)]
            return torch.stack(parts).sum(dim=0)


def run_in_threads(world: int, rank_main: Callable[[int], Any], mailboxes: Sequence[_Mailboxes]) -> list[Any]:
    """``rank_main(rank)`` for every rank, each in a thread; their results in rank order. One
    rank's failure wakes every waiting rank and is raised here, after every thread ended."""
    results: list[Any] = [None] * world
    errors: list[BaseException] = []

    def main(rank: int) -> None:
        try:
            results[rank] = rank_main(rank)
        except BaseException as error:  # noqa: BLE001 - reported below, after every thread ended
            errors.append(error)
            for boxes in mailboxes:
                boxes.fail(error)

    threads = [threading.Thread(target=main, args=(r,), name=f"cp-rank{r}") for r in range(world)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return results


class _Ctx:
    """The part of autograd's function context the ring's forward and backward use."""

    saved_tensors: tuple[Tensor, ...] = ()

    def save_for_backward(self, *tensors: Tensor) -> None:
        self.saved_tensors = tensors


@dataclass(frozen=True)
class RingResult:
    """The whole sequence's output and gradients, put back in order from every rank's shard."""

    out_BSHD: Tensor
    dq_BSHD: Tensor
    dk_BSKD: Tensor
    dv_BSKD: Tensor


def _real_cuda(x: Tensor) -> bool:
    """A tensor on a real GPU (a fake CUDA tensor on a machine without one has no stream)."""
    return x.is_cuda and torch.cuda.is_available()


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
    doc_ids_BS: Optional[Tensor] = None,
    kv_exchange: str = "ring",
    window: Optional[int] = None,
    timeout_s: float = 120.0,
    rank_context: RankContext = contextlib.nullcontext,
) -> RingResult:
    """Zigzag-shard the full-sequence inputs over ``world`` ranks, run every rank's ring
    forward and backward (each in a thread, the loop's halves called directly; K/V moved by the
    exchange ``kv_exchange`` names), and unshard the results."""
    if kv_exchange not in EXCHANGES:
        raise ValueError(f"kv_exchange {kv_exchange!r}: the emulated ring runs {', '.join(EXCHANGES)}")
    shard = [
        [zigzag_shard(x, dim=1, world=world, rank=r).contiguous() for r in range(world)]
        for x in (q_BSHD, k_BSKD, v_BSKD, dout_BSHD)
    ]
    docs = [None] * world if doc_ids_BS is None else [zigzag_shard(doc_ids_BS, dim=1, world=world, rank=r)
                                                     for r in range(world)]
    mailboxes = _Mailboxes(timeout_s)

    def rank_main(rank: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        if _real_cuda(q_BSHD):
            torch.cuda.set_device(q_BSHD.device)  # the current device is per thread
        q, k, v, dout = (parts[rank] for parts in shard)
        ctx = _Ctx()
        # The exchange as asked, even where a window would send K/V to the neighbours alone.
        call = AttentionCall(EmulatedTransport(rank, world, mailboxes), rank, world, q.shape[1], causal,
                             Documents.of(docs[rank]), window, scale, kernel, kv_exchange)
        with rank_context(), torch.no_grad():
            out = attend_forward(ctx, call, q, k, v)
            dq, dk, dv = attend_backward(ctx, dout)
        return out, dq, dk, dv

    done = run_in_threads(world, rank_main, [mailboxes])
    if _real_cuda(q_BSHD):
        torch.cuda.synchronize(q_BSHD.device)
    out, dq, dk, dv = (zigzag_unshard([r[i] for r in done], dim=1) for i in range(4))
    return RingResult(out, dq, dk, dv)


class EmulatedGroups:
    """The ring and Ulysses groups of one emulated CP group of ``layout``: CP rank c is ring index
    c // U and Ulysses index c % U, as ``topology`` numbers a job's."""

    def __init__(self, layout: CPLayout, timeout_s: float = 60.0) -> None:
        self.layout = layout
        self.ring_boxes = [_Mailboxes(timeout_s) for _ in range(layout.ulysses)]  # one ring per Ulysses index
        self.ulysses_boxes = [_Mailboxes(timeout_s) for _ in range(layout.ring)]  # one group per ring index

    def attention(self, rank: int, kernel: Union[str, AttentionKernel] = "auto") -> ContextParallelAttention:
        """CP rank ``rank``'s attention of the layout, on its emulated groups."""
        ring_idx, ulysses_idx = divmod(rank, self.layout.ulysses)
        return build_attention(
            self.layout, kernel,
            ring_group=EmulatedTransport(ring_idx, self.layout.ring, self.ring_boxes[ulysses_idx]),
            ulysses_group=EmulatedTransport(ulysses_idx, self.layout.ulysses, self.ulysses_boxes[ring_idx]),
        )

    def run(self, rank_main: Callable[[int], Any]) -> list[Any]:
        """``rank_main(rank)`` on every CP rank, each a thread; their results in rank order."""
        return run_in_threads(self.layout.cp, rank_main, [*self.ring_boxes, *self.ulysses_boxes])


def emulated_attention(
    q_BSHD: Tensor,
    k_BSKD: Tensor,
    v_BSKD: Tensor,
    dout_BSHD: Optional[Tensor],
    *,
    ring: int,
    ulysses: int,
    kernel: Union[str, AttentionKernel],
    causal: bool = True,
    doc_ids_BS: Optional[Tensor] = None,
    kv_exchange: str = "ring",
    timeout_s: float = 60.0,
    rank_context: RankContext = contextlib.nullcontext,
    documents: Optional[list[Optional[Documents]]] = None,
    window: Optional[int] = None,
) -> tuple[Tensor, Optional[tuple[Tensor, Tensor, Tensor]]]:
    """The attention of the CP layout ``ring`` x ``ulysses`` (K/V exchanged as ``kv_exchange``
    asks) over a CP group of threads, on the full-sequence inputs sharded as a job shards them:
    the unsharded output, and with ``dout`` the unsharded (dq, dk, dv) through autograd (CPU or
    meta tensors: see the module doc). ``rank_context()`` holds each rank's attention call and
    backward; ``documents``: each rank's ``Documents`` of ``doc_ids_BS`` where a caller keeps
    them across calls (as a forward's layers share theirs); ``window``: a causal sliding window
    of that many tokens."""
    layout = CPLayout(ring, ulysses, kv_exchange)
    world = layout.cp
    groups = EmulatedGroups(layout, timeout_s)

    def parts(x: Optional[Tensor]) -> list[Optional[Tensor]]:
        return [None if x is None else cp_shard(x, dim=1, ring=ring, ulysses=ulysses, cp_rank=rank).contiguous()
                for rank in range(world)]

    # Each rank's inputs arrive sharded, as a job's do, and its documents made, as a model makes
    # them once a forward for every layer: ``rank_context()`` holds a layer's work alone.
    q_parts, k_parts, v_parts, dout_parts, doc_parts = map(parts, (q_BSHD, k_BSKD, v_BSKD, dout_BSHD, doc_ids_BS))
    documents = documents if documents is not None else [Documents.of(d) for d in doc_parts]

    def rank_main(rank: int) -> tuple[Tensor, ...]:
        attention = groups.attention(rank, kernel)
        inputs = [q_parts[rank], k_parts[rank], v_parts[rank]]
        if dout_BSHD is None:
            with rank_context(), torch.no_grad():
                return (attention(*inputs, causal=causal, doc_ids=documents[rank], window=window),)
        leaves = [x.detach().requires_grad_() for x in inputs if x is not None]
        with rank_context():
            out = attention(*leaves, causal=causal, doc_ids=documents[rank], window=window)
            out.backward(dout_parts[rank])
        return (out.detach(), *(x.grad for x in leaves))

    done = groups.run(rank_main)
    out, *grads = (cp_unshard([r[i] for r in done], dim=1, ring=ring, ulysses=ulysses) for i in range(len(done[0])))
    return out, (tuple(grads) if grads else None)  # type: ignore[return-value]
