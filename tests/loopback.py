"""One rank of a context-parallel group in one thread, for unit tests: what it sends comes back
(a ring's visitor is its own K/V; a Ulysses all-to-all hands it its own tokens from every rank)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from ringtrain.train.attention.transport import Done


class Loopback:
    """The last rank of a group of ``size``: the rank whose ring blocks take half of a visitor's
    columns (a zigzag rank's visitors all come from ranks before it)."""

    def __init__(self, size: int) -> None:
        self._size = size

    def rank(self) -> int:
        return self._size - 1

    def size(self) -> int:
        return self._size

    def send_recv(self, sends: Mapping[int, Sequence[torch.Tensor]], recvs: Mapping[int, Sequence[torch.Tensor]], *,
                  tag: int) -> Done:
        (sent,), (into,) = sends.values(), recvs.values()
        for buffer, tensor in zip(into, sent):
            buffer.copy_(tensor)
        return Done()

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor) -> None:
        output.copy_(input)
