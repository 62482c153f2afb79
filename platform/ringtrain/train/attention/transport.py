"""How the attention code reaches the other ranks of its group: the ``Transport`` seam.

Every transfer the attention code issues goes through a ``Transport``: point-to-point sends and
receives in one group launch, all-to-all, all-gather and reduce-scatter. Three implement it:
``ProcessGroupTransport`` here (torch.distributed, what a job runs), the one-process emulator
of the tests (``ringtrain_dev/emulated_cp.py``: ranks as threads, mailboxes in memory) and the
benches' loopback (``ringtrain_dev/loopback.py``: one rank on one device). The attention code is handed one
(``as_transport``); nothing replaces module globals.

``ProcessGroupTransport`` tallies every transfer by kind ("isend", "irecv", "all_to_all",
"all_gather", "reduce_scatter") into any active ``count_comm()`` counter, so a test can pin the
exact number of transfers per forward+backward and catch a regression that adds a round trip.
It is also the file the collective recorder passes over when it names a call's site
(``collective_calls.skipped_locations``): the site is the exchange that asked.

Shape legend: U ranks in the group.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from typing import Optional, Protocol, Union, runtime_checkable

import torch
import torch.distributed as dist

Tensor = torch.Tensor
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


def check_contiguous(kind: str, *tensors: Tensor) -> None:
    """Raise ValueError unless every tensor a transfer sends or receives into is contiguous: NCCL
    takes no other, and gloo (and an in-memory transport) would take a strided one and hide it
    until a GPU run. Every ``Transport`` checks its point-to-point and all-to-all tensors here."""
    for tensor in tensors:
        if not tensor.is_contiguous():
            raise ValueError(f"{kind}: a tensor of shape {tuple(tensor.shape)} and strides {tensor.stride()} is "
                             "not contiguous; transfers take contiguous tensors only")


def send_recv_tensors(sends: Mapping[int, Sequence[Tensor]], recvs: Mapping[int, Sequence[Tensor]]) -> list[Tensor]:
    """Every tensor of one ``send_recv``, sent or received into."""
    return [tensor for by_peer in (sends, recvs) for tensors in by_peer.values() for tensor in tensors]


class Pending(Protocol):
    """Transfers in flight: ``wait()`` before reading the receive buffers or writing the sent ones."""

    def wait(self) -> None: ...


class Done:
    """Transfers that completed when they were posted."""

    def wait(self) -> None:
        pass


@runtime_checkable
class Transport(Protocol):
    """One rank's view of its group and the transfers it may issue (peers are group ranks)."""

    def rank(self) -> int: ...

    def size(self) -> int: ...

    def send_recv(
        self, sends: Mapping[int, Sequence[Tensor]], recvs: Mapping[int, Sequence[Tensor]], *, tag: int
    ) -> Pending:
        """Post ``sends[peer][i]`` to each peer and receive into ``recvs[peer][i]`` from each, all
        at once; tensor i of a peer goes with tag ``tag + i``. Returns at once. Every tensor is
        contiguous (``check_contiguous``)."""
        ...

    def all_to_all(self, output: Tensor, input: Tensor) -> None:
        """Equal-split along dim 0: slice u of ``input`` to rank u, slice u of ``output`` from rank u;
        both contiguous (``check_contiguous``)."""
        ...

    def all_gather(self, x: Tensor) -> Tensor:
        """Every rank's ``x``, stacked in rank order: ``[U, *x.shape]``."""
        ...

    def reduce_scatter(self, x_U: Tensor) -> Tensor:
        """The sum over ranks of slice u of every rank's ``[U, ...]`` ``x``, on rank u."""
        ...


class _Works:
    def __init__(self, works: list[dist.Work]) -> None:
        self._works = works

    def wait(self) -> None:
        for work in self._works:
            work.wait()
        self._works = []


class ProcessGroupTransport:
    """A ``Transport`` over a torch.distributed process group.

    Every send and receive of one ``send_recv`` goes in one ``batch_isend_irecv``, which NCCL
    fuses into a single group launch. Each stream of transfers has its own tags: with gloo, two
    streams in flight between the same pair of ranks (a ring of 2 sends to and receives from one
    peer, and K/V and dK/dV overlap in a ring's backward) then never match one stream's send to
    the other's receive.
    """

    def __init__(self, group: ProcessGroup) -> None:
        self.group = group
        self._rank = dist.get_rank(group)
        self._size = dist.get_world_size(group)
        self._global = [dist.get_global_rank(group, r) for r in range(self._size)]

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

    def send_recv(
        self, sends: Mapping[int, Sequence[Tensor]], recvs: Mapping[int, Sequence[Tensor]], *, tag: int
    ) -> Pending:
        check_contiguous("send_recv", *send_recv_tensors(sends, recvs))
        ops = [dist.P2POp(dist.isend, t, self._global[peer], group=self.group, tag=tag + i)
               for peer, tensors in sends.items() for i, t in enumerate(tensors)]
        ops += [dist.P2POp(dist.irecv, t, self._global[peer], group=self.group, tag=tag + i)
                for peer, tensors in recvs.items() for i, t in enumerate(tensors)]
        _record("isend", sum(len(t) for t in sends.values()))
        _record("irecv", sum(len(t) for t in recvs.values()))
        return _Works(dist.batch_isend_irecv(ops) if ops else [])

    def all_to_all(self, output: Tensor, input: Tensor) -> None:
        check_contiguous("all_to_all", output, input)
        _record("all_to_all")
        dist.all_to_all_single(output, input, group=self.group)

    def all_gather(self, x: Tensor) -> Tensor:
        _record("all_gather")
        out = torch.empty((self._size, *x.shape), dtype=x.dtype, device=x.device)
        dist.all_gather(list(out.unbind(0)), x.contiguous(), group=self.group)
        return out

    def reduce_scatter(self, x_U: Tensor) -> Tensor:
        _record("reduce_scatter")
        out = torch.empty(x_U.shape[1:], dtype=x_U.dtype, device=x_U.device)
        dist.reduce_scatter(out, [part.contiguous() for part in x_U.unbind(0)], group=self.group)
        return out

    def __repr__(self) -> str:
        return f"ProcessGroupTransport(rank={self._rank}, size={self._size})"


GroupArg = Union[ProcessGroup, Transport, None]


def as_transport(group: GroupArg) -> Optional[Transport]:
    """The transport of ``group``: a process group wrapped, a transport as it is; None (no
    context parallelism) stays None."""
    # A process group has rank() and size() too; only a transport sends (and a protocol's own
    # isinstance check costs more than a layer's ops at short blocks).
    if group is None or hasattr(group, "send_recv"):
        return group  # type: ignore[return-value]
    return ProcessGroupTransport(group)


def group_size(group: GroupArg) -> int:
    """Ranks in ``group``; None counts as one."""
    return 1 if group is None else group.size()
