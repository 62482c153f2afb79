"""The torch.distributed calls the collective recorder wraps, and how one call is described:
its tensors' shapes and dtypes, its P2P peers, and the caller's site (the first frame outside
torch, DeepSpeed, the recorder and the attention package's transport (``transport.py``))."""

from __future__ import annotations

import functools
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class OpSpec:
    tensors: tuple[str, ...]  # parameters whose shapes every member of the group must agree on
    peer: Optional[str] = None  # P2P: the parameter naming the other rank


# Gather/scatter record only the tensor every member passes: the list exists on the root only.
OPS: dict[str, OpSpec] = {
    "all_reduce": OpSpec(("tensor",)),
    "all_reduce_coalesced": OpSpec(("tensors",)),
    "reduce": OpSpec(("tensor",)),
    "broadcast": OpSpec(("tensor",)),
    "all_gather": OpSpec(("tensor_list", "tensor")),
    "all_gather_into_tensor": OpSpec(("output_tensor", "input_tensor")),
    "_all_gather_base": OpSpec(("output_tensor", "input_tensor")),
    "all_gather_coalesced": OpSpec(("output_tensor_lists", "input_tensor_list")),
    "gather": OpSpec(("tensor",)),
    "scatter": OpSpec(("tensor",)),
    "reduce_scatter": OpSpec(("output", "input_list")),
    "reduce_scatter_tensor": OpSpec(("output", "input")),
    "_reduce_scatter_base": OpSpec(("output", "input")),
    "all_to_all_single": OpSpec(("output", "input")),
    "all_to_all": OpSpec(("output_tensor_list", "input_tensor_list")),
    "barrier": OpSpec(()),
    "monitored_barrier": OpSpec(()),
    "send": OpSpec(("tensor",), peer="dst"),
    "recv": OpSpec(("tensor",), peer="src"),
    "isend": OpSpec(("tensor",), peer="dst"),
    "irecv": OpSpec(("tensor",), peer="src"),
    "batch_isend_irecv": OpSpec(("p2p_op_list",)),
    "all_gather_object": OpSpec(()),
    "broadcast_object_list": OpSpec(()),
    "gather_object": OpSpec(()),
    "scatter_object_list": OpSpec(()),
    "send_object_list": OpSpec(()),
    "recv_object_list": OpSpec(()),
}


@functools.lru_cache(maxsize=1)
def skipped_locations() -> tuple[frozenset[str], tuple[str, ...]]:
    """(files, directory prefixes) a call site is never taken from."""
    roots = [Path(torch.__file__).parent]
    spec = importlib.util.find_spec("deepspeed")  # located, not imported
    if spec is not None and spec.submodule_search_locations:
        roots += [Path(p) for p in spec.submodule_search_locations]
    here = Path(__file__).parent
    files = (here / "collectives.py", Path(__file__), here / "attention" / "transport.py")
    return frozenset(str(p.resolve()) for p in files), tuple(str(p.resolve()) + os.sep for p in roots)


def site_file(filename: str) -> Optional[str]:
    """The short path a call site shows for ``filename``, or None when sites skip it."""
    files, roots = skipped_locations()
    resolved = str(Path(filename).resolve()) if os.path.isabs(filename) else filename
    if resolved in files or resolved.startswith(roots):
        return None
    parts = Path(filename).parts
    if "ringtrain" in parts:
        return "/".join(parts[parts.index("ringtrain"):])
    return "/".join(parts[-2:])


def describe(values: list[Any]) -> tuple[list[Any], str, list[int], bool]:
    """Shapes (``torch.Size``), dtype(s), P2P peers and whether a tensor is on CUDA, of a call's tensors."""
    if len(values) == 1 and isinstance(values[0], torch.Tensor):  # most calls: one tensor
        v = values[0]
        return [v.shape], dtype_name(v.dtype), [], v.is_cuda
    shapes: list[Any] = []
    dtypes: list[str] = []
    peers: list[int] = []
    cuda = False
    todo = list(reversed(values))
    while todo:
        v = todo.pop()
        if isinstance(v, torch.Tensor):
            shapes.append(v.shape)
            dtypes.append(dtype_name(v.dtype))
            cuda = cuda or v.is_cuda
        elif isinstance(v, dist.P2POp):
            todo.append(v.tensor)
            peers.append(int(v.peer))
        elif isinstance(v, (list, tuple)):
            todo.extend(reversed(v))
    return shapes, ",".join(dict.fromkeys(dtypes)), peers, cuda


@functools.lru_cache(maxsize=None)
def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
