"""One rank of a context-parallel ring on one device, its transport looped back.

A bench that times one rank's share of ring attention (bench/attention.py and its siblings), and
a test that runs one rank's call alone, hand the real attention code a ``LoopbackTransport``
where a job hands a process group's: what the rank receives is a device copy of what it sends
(its own block), so what runs is the rank's compute and copies, not the network.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from ringtrain.train.attention.transport import Done, check_contiguous, send_recv_tensors


@dataclass(frozen=True)
class LoopbackTransport:
    """A ``Transport`` for one rank of a ring on one device: what it receives is a device copy of
    what it sends (the rank's own block), a gather stacks R copies, a reduce-scatter keeps its
    own slice."""

    index: int
    world: int

    def rank(self) -> int:
        return self.index

    def size(self) -> int:
        return self.world

    def send_recv(self, sends: Mapping[int, Sequence[torch.Tensor]], recvs: Mapping[int, Sequence[torch.Tensor]], *,
                  tag: int) -> Done:
        check_contiguous("send_recv", *send_recv_tensors(sends, recvs))
        outgoing = next(iter(sends.values()), None)
        for buffers in recvs.values():
            for i, buffer in enumerate(buffers):
                buffer.copy_(outgoing[i]) if outgoing is not None else buffer.zero_()
        return Done()

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor) -> None:
        check_contiguous("all_to_all", output, input)
        output.copy_(input)

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        return x.unsqueeze(0).expand(self.world, *x.shape).contiguous()

    def reduce_scatter(self, x_U: torch.Tensor) -> torch.Tensor:
        return x_U[self.index].clone()
