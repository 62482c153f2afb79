"""The attention package's only door to torch.distributed: ring P2P, all-to-all, all-gather,
reduce-scatter.

Every transfer the attention code issues goes through a function here and is tallied by kind
("isend", "irecv", "all_to_all", "all_gather", "reduce_scatter") into any active
``count_comm()`` counter, so a
test can pin the exact number of transfers per forward+backward and catch a regression that
adds a round trip.

A ``group`` of ``None`` means "no context parallelism": a group of one rank.

Shape legend: B batch, S local sequence, U ranks in the group.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator, Sequence
from typing import Optional

import torch
import torch.distributed as dist

ProcessGroup = dist.ProcessGroup

_active_counters: list[Counter[str]] = []


@contextlib.contextmanager
def count_comm() -> Iterator[Counter[str]]:
    """Count, by kind, the transfers issued inside the ``with`` block (on this rank)."""
    counter: Counter[str] = Counter()
    _active_counters.append(counter)
    try:
        yield counter
    finally:
        _active_counters.remove(counter)


def _record(kind: str, n: int = 1) -> None:
    for counter in _active_counters:
        counter[kind] += n


# The group's own methods rather than ``dist.get_world_size(group)``: they answer the same for a
# process group, and a stand-in that has them (one process emulating a group in tests) works too.
def group_size(group: Optional[ProcessGroup]) -> int:
    return 1 if group is None else group.size()


def group_rank(group: Optional[ProcessGroup]) -> int:
    return 0 if group is None else group.rank()


class Pending:
    """Transfers in flight. ``wait()`` before reading the receive buffers or reusing the send ones."""

    def __init__(self, works: list[dist.Work]) -> None:
        self._works = works

    def wait(self) -> None:
        for work in self._works:
            work.wait()
        self._works = []


class RingExchange:
    """Send to the next rank of a ring while receiving from the previous one, asynchronously.

    Every tensor pair goes in one ``batch_isend_irecv`` so NCCL fuses them into a single group
    launch. Each stream of transfers gets its own tag: with gloo, two streams in flight between
    the same pair of ranks (a ring of 2 sends to and receives from the same peer, and K/V and
    dK/dV overlap in the backward) then never match one stream's send to the other's receive.
    """

    def __init__(self, group: ProcessGroup) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self._send_to = dist.get_global_rank(group, (self.rank + 1) % self.world)
        self._recv_from = dist.get_global_rank(group, (self.rank - 1) % self.world)

    def start(self, send: Sequence[torch.Tensor], recv: Sequence[torch.Tensor], *, tag: int) -> Pending:
        """Post ``send[i] -> next`` and ``recv[i] <- previous`` for every i; returns at once."""
        if len(send) != len(recv):
            raise ValueError(f"{len(send)} tensors to send but {len(recv)} receive buffers")
        ops = []
        for i, (outgoing, incoming) in enumerate(zip(send, recv)):
            ops.append(dist.P2POp(dist.isend, outgoing, self._send_to, group=self.group, tag=tag + i))
            ops.append(dist.P2POp(dist.irecv, incoming, self._recv_from, group=self.group, tag=tag + i))
        _record("isend", len(send))
        _record("irecv", len(recv))
        return Pending(dist.batch_isend_irecv(ops))


def exchange(
    sends: dict[int, Sequence[torch.Tensor]], recvs: dict[int, Sequence[torch.Tensor]], group: ProcessGroup, *, tag: int
) -> Pending:
    """Send ``sends[peer]`` to each peer and receive ``recvs[peer]`` from each, all in one group
    launch; peers are group ranks. Returns at once."""
    ops = []
    for peer, tensors in sends.items():
        for i, outgoing in enumerate(tensors):
            ops.append(dist.P2POp(dist.isend, outgoing, dist.get_global_rank(group, peer), group=group, tag=tag + i))
    for peer, tensors in recvs.items():
        for i, incoming in enumerate(tensors):
            ops.append(dist.P2POp(dist.irecv, incoming, dist.get_global_rank(group, peer), group=group, tag=tag + i))
    _record("isend", sum(len(t) for t in sends.values()))
    _record("irecv", sum(len(t) for t in recvs.values()))
    return Pending(dist.batch_isend_irecv(ops) if ops else [])


def all_to_all(output: torch.Tensor, input: torch.Tensor, group: ProcessGroup) -> None:
    """Equal-split all-to-all along dim 0: slice ``i`` of ``input`` goes to rank ``i``."""
    _record("all_to_all")
    dist.all_to_all_single(output, input, group=group)


def all_gather_stacked(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Every rank's ``x``, stacked in group-rank order: ``[U, *x.shape]``."""
    _record("all_gather")
    out = torch.empty((group_size(group), *x.shape), dtype=x.dtype, device=x.device)
    dist.all_gather(list(out.unbind(0)), x.contiguous(), group=group)
    return out


def reduce_scatter_stacked(x_U: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """The sum over ranks of slice ``u`` of every rank's ``[U, ...]`` ``x``, on rank ``u``."""
    _record("reduce_scatter")
    out = torch.empty(x_U.shape[1:], dtype=x_U.dtype, device=x_U.device)
    dist.reduce_scatter(out, [part.contiguous() for part in x_U.unbind(0)], group=group)
    return out
