"""A context-parallel group emulated in one process, on one device: every rank a thread.

NCCL refuses two ranks of one communicator on the same GPU, so a one-GPU machine cannot run a
real ring; and a CPU machine cannot run CUDA at all, but can run the CUDA code path on fake
CUDA tensors (``FakeTensorMode``), which is how the unit tier catches a tensor made on the
wrong device. Both run the real attention code of every rank at once, each rank a thread, with
the transport swapped for in-memory mailboxes: the ring's P2P exchange (``RingExchange``),
Ulysses' all-to-all and the doc-id all-gather. The zigzag blocks, their kernels, the LSE merges
and the fp32 dK/dV accumulators that travel around the ring are the real code's; only the
transport is not, and the CPU tier's gloo tests (tests/dist/test_attention.py) cover it.

``emulated_ring`` calls the ring's autograd ``Function``'s forward and backward directly rather
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
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, ContextManager, Optional

import torch

from ringtrain.train.attention import comm
from ringtrain.train.attention import allgather as allgather_module
from ringtrain.train.attention import ring as ring_module
from ringtrain.train.attention.documents import Documents
from ringtrain.train.attention.implementations import build_attention
from ringtrain.train.attention.kernels import AttentionKernel
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


@dataclass(frozen=True)
class EmulatedGroup:
    """What the attention code gets instead of a process group: its rank and size (the
    ``ProcessGroup`` methods ``comm`` reads) and the mailboxes its ranks share."""

    index: int
    world: int
    mailboxes: _Mailboxes

    def rank(self) -> int:
        return self.index

    def size(self) -> int:
        return self.world


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
        self.rank = group.index
        self.world = group.world

    def start(self, send: Sequence[Tensor], recv: Sequence[Tensor], *, tag: int) -> _EmulatedPending:
        if len(send) != len(recv):
            raise ValueError(f"{len(send)} tensors to send but {len(recv)} receive buffers")
        for i, outgoing in enumerate(send):
            self.group.mailboxes.post(self.rank, (self.rank + 1) % self.world, tag + i, outgoing)
        return _EmulatedPending(self.group.mailboxes, (self.rank - 1) % self.world, self.rank, tag, list(recv))


def _all_to_all(output: Tensor, input: Tensor, group: EmulatedGroup) -> None:
    """``comm.all_to_all``: slice u of ``input`` to rank u, slice u of ``output`` from rank u."""
    for dst, piece in enumerate(input.chunk(group.world)):
        group.mailboxes.post(group.index, dst, _ALL_TO_ALL_TAG, piece)
    for src, buffer in enumerate(output.chunk(group.world)):
        buffer.copy_(group.mailboxes.take(src, group.index, _ALL_TO_ALL_TAG))


def _all_gather_stacked(x: Tensor, group: EmulatedGroup) -> Tensor:
    """``comm.all_gather_stacked``: every rank's ``x`` stacked in rank order."""
    for dst in range(group.world):
        group.mailboxes.post(group.index, dst, _ALL_GATHER_TAG, x)
    return torch.stack([group.mailboxes.take(src, group.index, _ALL_GATHER_TAG) for src in range(group.world)])


def _reduce_scatter_stacked(x_U: Tensor, group: EmulatedGroup) -> Tensor:
    """``comm.reduce_scatter_stacked``: slice u of every rank's ``x``, summed on rank u (in rank
    order, so every rank adds the same numbers in the same order)."""
    for dst, piece in enumerate(x_U.unbind(0)):
        group.mailboxes.post(group.index, dst, _REDUCE_SCATTER_TAG, piece)
    parts = [group.mailboxes.take(src, group.index, _REDUCE_SCATTER_TAG) for src in range(group.world)]
    return torch.stack(parts).sum(dim=0)


@contextlib.contextmanager
def emulated_transport() -> Iterator[None]:
    """The attention code's transfers go to the mailboxes of ``EmulatedGroup``s meanwhile."""
    swaps = [(ring_module, "RingExchange", EmulatedExchange), (comm, "all_to_all", _all_to_all),
             (comm, "all_gather_stacked", _all_gather_stacked),
             (comm, "reduce_scatter_stacked", _reduce_scatter_stacked)]
    saved = [getattr(module, name) for module, name, _ in swaps]
    for module, name, stand_in in swaps:
        setattr(module, name, stand_in)
    try:
        yield
    finally:
        for (module, name, _), real in zip(swaps, saved):
            setattr(module, name, real)


def run_in_threads(world: int, rank_main: Callable[[int], Any], mailboxes: Sequence[_Mailboxes],
                   rank_context: RankContext = contextlib.nullcontext) -> list[Any]:
    """``rank_main(rank)`` for every rank, each in a thread inside ``rank_context()``, under the
    emulated transport; their results in rank order. One rank's failure wakes every waiting
    rank and is raised here, after every thread ended."""
    results: list[Any] = [None] * world
    errors: list[BaseException] = []

    def main(rank: int) -> None:
        try:
            with rank_context():
                results[rank] = rank_main(rank)
        except BaseException as error:  # noqa: BLE001 - reported below, after every thread ended
            errors.append(error)
            for boxes in mailboxes:
                boxes.fail(error)

    with emulated_transport():
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
    forward and backward (each in a thread; K/V passed around or all gathered, as
    ``kv_exchange`` says), and unshard the results."""
    function: Any = getattr(ring_module, "_RingAttention") if kv_exchange == "ring" else getattr(
        allgather_module, "_AllGatherAttention"
    )
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
        group = EmulatedGroup(rank, world, mailboxes)
        with torch.no_grad():
            out = function.forward(ctx, q, k, v, Documents.of(docs[rank]), group, causal, kernel, scale, window)
            dq, dk, dv, *_ = function.backward(ctx, dout)
        return out, dq, dk, dv

    done = run_in_threads(world, rank_main, [mailboxes], rank_context)
    if _real_cuda(q_BSHD):
        torch.cuda.synchronize(q_BSHD.device)
    out, dq, dk, dv = (zigzag_unshard([r[i] for r in done], dim=1) for i in range(4))
    return RingResult(out, dq, dk, dv)


def emulated_attention(
    impl: str,
    q_BSHD: Tensor,
    k_BSKD: Tensor,
    v_BSKD: Tensor,
    dout_BSHD: Optional[Tensor],
    *,
    ring: int,
    ulysses: int,
    kernel: str,
    causal: bool = True,
    doc_ids_BS: Optional[Tensor] = None,
    kv_exchange: str = "ring",
    timeout_s: float = 60.0,
    rank_context: RankContext = contextlib.nullcontext,
) -> tuple[Tensor, Optional[tuple[Tensor, Tensor, Tensor]]]:
    """Attention implementation ``impl`` over a ``ring`` x ``ulysses`` CP group of threads, on the
    full-sequence inputs sharded as a job shards them: the unsharded output, and with ``dout``
    the unsharded (dq, dk, dv) through autograd (CPU or meta tensors: see the module doc)."""
    world = ring * ulysses
    ring_boxes = [_Mailboxes(timeout_s) for _ in range(ulysses)]  # one ring per Ulysses index
    ulysses_boxes = [_Mailboxes(timeout_s) for _ in range(ring)]  # one Ulysses group per ring index

    def part(x: Optional[Tensor], rank: int) -> Optional[Tensor]:
        return None if x is None else cp_shard(x, dim=1, ring=ring, ulysses=ulysses, cp_rank=rank).contiguous()

    def rank_main(rank: int) -> tuple[Tensor, ...]:
        ring_idx, ulysses_idx = divmod(rank, ulysses)
        attention = build_attention(
            impl, kernel,
            ring_group=EmulatedGroup(ring_idx, ring, ring_boxes[ulysses_idx]),  # type: ignore[arg-type]
            ulysses_group=EmulatedGroup(ulysses_idx, ulysses, ulysses_boxes[ring_idx]),  # type: ignore[arg-type]
            kv_exchange=kv_exchange,
        )
        inputs = [part(x, rank) for x in (q_BSHD, k_BSKD, v_BSKD)]
        if dout_BSHD is None:
            with torch.no_grad():
                return (attention(*inputs, causal=causal, doc_ids=part(doc_ids_BS, rank)),)
        leaves = [x.detach().requires_grad_() for x in inputs if x is not None]
        out = attention(*leaves, causal=causal, doc_ids=part(doc_ids_BS, rank))
        out.backward(part(dout_BSHD, rank))
        return (out.detach(), *(x.grad for x in leaves))

    done = run_in_threads(world, rank_main, [*ring_boxes, *ulysses_boxes], rank_context)
    out, *grads = (cp_unshard([r[i] for r in done], dim=1, ring=ring, ulysses=ulysses) for i in range(len(done[0])))
    return out, (tuple(grads) if grads else None)  # type: ignore[return-value]
