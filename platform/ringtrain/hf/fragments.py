"""A durable checkpoint's fp32 master weights, gathered tensor by tensor from its rank shards.

A checkpoint holds one snapshot blob per rank, each with that rank's fragments (parameter,
state key, element range) of the weights and both Adam moments. ``FragmentIndex`` needs every
blob in memory at once, three times the model in fp32; an export needs only the weights, a few
tensors at a time. ``MasterWeights.gather`` fills the tensors of one output file, reading blobs
one at a time and keeping only the last one read:

- Under ZeRO-1/2 each rank owns a contiguous run of the flattened parameters, so consecutive
  files come from consecutive ranks: each blob is read about once, and memory stays near one
  output file plus one blob.
- Under ZeRO-0/3 every rank holds a slice of every parameter, so every file needs every blob:
  memory stays the same, and the checkpoint is read once per output file instead.

A blob's header (which fragments it holds) is known only once it has been read; later gathers
skip the blobs that hold nothing they want.
"""

from __future__ import annotations

import warnings
from typing import Callable, Mapping, Optional, Sequence

import torch

from ringtrain.checkpoint.wire import DecodedShard, SnapshotFormatError, decode
from ringtrain.errors import RingtrainError

# The state key of the fp32 master weight; exp_avg and exp_avg_sq are Adam's and not exported.
PARAM_KEY = "param"


class FragmentError(RingtrainError):
    """The checkpoint's fragments do not make up the model its meta describes."""


class MasterWeights:
    """Reads the ``param`` fragments of a checkpoint's blobs (``read_blob(name) -> bytes``)."""

    def __init__(
        self,
        read_blob: Callable[[str], bytes],
        blob_names: Sequence[str],
        shapes: Mapping[str, tuple[int, ...]],
        say: Callable[[str], None] = lambda line: None,
    ) -> None:
        self._read_blob = read_blob
        self._names = list(blob_names)
        self._shapes = dict(shapes)
        self._say = say
        self._holds: dict[str, set[str]] = {}  # blob -> the parameters it has fragments of, once read
        self._last: Optional[tuple[str, DecodedShard]] = None
        self.num_reads = 0

    def gather(self, out: Mapping[str, torch.Tensor]) -> None:
        """Fill each tensor of ``out`` (parameter name -> tensor of its shape, any dtype) with
        the checkpoint's values, cast to the tensor's dtype; FragmentError if one is not
        covered exactly."""
        covered: dict[str, list[tuple[int, int]]] = {name: [] for name in out}
        missing = sum(t.numel() for t in out.values())
        for blob in self._reading_order(set(out)):
            if missing == 0:
                break  # the rest can only hold other tensors: every element is in already
            shard = self._decode(blob)
            for entry in shard.entries:
                if entry["key"] != PARAM_KEY or entry["name"] not in out:
                    continue
                name, start, numel = entry["name"], int(entry["start"]), int(entry["numel"])
                flat = out[name].view(-1)
                if start < 0 or start + numel > flat.numel():
                    raise FragmentError(
                        f"{blob}: fragment [{start}, {start + numel}) of {name} lies outside its {flat.numel()} elements"
                    )
                with warnings.catch_warnings():
                    # The blob's bytes are read-only; they are only ever copied from.
                    warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
                    flat[start : start + numel].copy_(torch.from_numpy(shard.array(entry)))
                covered[name].append((start, numel))
                missing -= numel
        for name, pieces in covered.items():
            _check_tiling(name, pieces, out[name].numel())

    def _reading_order(self, wanted: set[str]) -> list[str]:
        """Blobs known to hold a wanted tensor (the one in memory first), then unread ones."""
        known = [b for b in self._names if b in self._holds and self._holds[b] & wanted]
        if self._last is not None and self._last[0] in known:
            known.remove(self._last[0])
            known.insert(0, self._last[0])
        return known + [b for b in self._names if b not in self._holds]

    def _decode(self, blob: str) -> DecodedShard:
        if self._last is not None and self._last[0] == blob:
            return self._last[1]
        self._last = None  # let the previous blob go before the next one is read
        self._say(f"reading {blob}")
        try:
            shard = decode(self._read_blob(blob))
        except SnapshotFormatError as exc:
            raise FragmentError(f"{blob}: {exc}") from None
        self.num_reads += 1
        holds = set()
        for entry in shard.entries:
            if entry["key"] != PARAM_KEY:
                continue
            name = entry["name"]
            if name not in self._shapes:
                raise FragmentError(f"{blob} holds parameter {name}, which the checkpoint's model section does not have")
            if tuple(entry["shape"]) != self._shapes[name]:
                raise FragmentError(
                    f"{blob}: {name} has shape {list(entry['shape'])}, the model section says {list(self._shapes[name])}"
                )
            holds.add(name)
        self._holds[blob] = holds
        self._last = (blob, shard)
        return shard


def _check_tiling(name: str, pieces: list[tuple[int, int]], total: int) -> None:
    expected = 0
    for start, numel in sorted(pieces):
        if start != expected:
            raise FragmentError(f"{name}: elements [{expected}, {start}) are missing or overlap in the checkpoint")
        expected = start + numel
    if expected != total:
        raise FragmentError(f"{name}: the checkpoint covers {expected} of its {total} elements")
