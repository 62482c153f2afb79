"""The safetensors files of an exported model: which tensors go in which file, and the index.

Tensors are packed in the model's order (embeddings, layers, final norm, output) into files of
at most ``max_bytes`` of tensor data, as ``save_pretrained`` does: one ``model.safetensors`` when
everything fits, else ``model-0000i-of-0000n.safetensors`` files and a
``model.safetensors.index.json`` mapping each tensor to its file. A tensor larger than the limit
gets a file of its own. Sizes count tensor bytes only, as Hugging Face's limit does.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Sequence

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_SIZE = "5GB"
# Hugging Face's spelling of sizes: decimal units (5GB = 5e9 bytes) and binary ones (5GiB).
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*$")


@dataclass(frozen=True)
class OutputTensor:
    name: str  # ringtrain's parameter name
    hf_name: str
    shape: tuple[int, ...]
    num_bytes: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class OutputShard:
    file: str
    tensors: tuple[OutputTensor, ...]

    @property
    def num_bytes(self) -> int:
        return sum(t.num_bytes for t in self.tensors)


def parse_size(text: str) -> int:
    """Bytes of a size such as ``5GB``, ``500MiB`` or ``1000000``; ValueError saying the form."""
    match = _SIZE.match(str(text))
    unit = match.group(2).upper() if match else ""
    if match is None or unit not in _UNITS:
        raise ValueError(f"{text!r} is not a size: use bytes or a number with KB, MB, GB (or KiB, MiB, GiB)")
    size = int(float(match.group(1)) * _UNITS[unit])
    if size < 1:
        raise ValueError(f"{text!r} must be at least one byte")
    return size


def plan_shards(tensors: Sequence[OutputTensor], max_bytes: int) -> list[OutputShard]:
    """Files of at most ``max_bytes`` each (a larger tensor alone), in the order given."""
    groups: list[list[OutputTensor]] = []
    size = 0
    for tensor in tensors:
        if not groups or (groups[-1] and size + tensor.num_bytes > max_bytes):
            groups.append([])
            size = 0
        groups[-1].append(tensor)
        size += tensor.num_bytes
    if len(groups) == 1:
        return [OutputShard(SINGLE_FILE, tuple(groups[0]))]
    n = len(groups)
    return [OutputShard(f"model-{i:05d}-of-{n:05d}.safetensors", tuple(g)) for i, g in enumerate(groups, start=1)]


def index(shards: Sequence[OutputShard]) -> dict[str, Any]:
    """``model.safetensors.index.json``'s content: total size and the tensor -> file map."""
    return {
        "metadata": {"total_size": sum(s.num_bytes for s in shards)},
        "weight_map": {t.hf_name: s.file for s in shards for t in s.tensors},
    }
