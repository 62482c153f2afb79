"""Silent-data-corruption probes: fixed-input GEMM, attention and collective, each reduced to a digest.

A rank runs these between steps. The inputs are fixed (seeded on the CPU, so every rank and
every round get the same bits) and the digest is a sha256 of the result's bytes, so identical
hardware and software must produce identical digests, round after round and rank by rank; the
comparison itself is ``ringtrain.policies.sdc``'s job.

- GEMM: the matrix units, fp32 (and bf16 on CUDA).
- Attention: one block through the attention kernel training uses (``attention.kernels``),
  output and log-sum-exp both digested.
- Collective: an all-reduce of fixed integer-valued data over a group. Integers below 2**24 add
  exactly in fp32, so the sum is the same whatever order the library reduces in, and every
  member must hold the same result.

``flip`` corrupts one bit of one probe's output after it is computed: the chaos "bitflip"
fault, passed per call so that nothing global changes.
"""

from __future__ import annotations

import functools
import hashlib
import time
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from ringtrain.train.attention.kernels import default_scale, get_kernel

SEED = 1234
INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass(frozen=True)
class BitFlip:
    """Corrupt bit ``bit`` of element ``element`` (flat index) of probe ``probe``'s output."""

    probe: str
    element: int = 0
    bit: int = 0


@dataclass(frozen=True)
class ProbeResult:
    name: str
    digest: str  # sha256 hex of dtype, shape and bytes of every output tensor
    seconds: float
    tensor: Optional[torch.Tensor] = None  # the (first) output, when asked for, for diagnostics


def digest(*tensors: torch.Tensor) -> str:
    h = hashlib.sha256()
    for t in tensors:
        t = t.detach().contiguous().cpu()
        h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.flatten().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def flip_bit(t: torch.Tensor, element: int, bit: int) -> torch.Tensor:
    """A copy of ``t`` with one bit of one element inverted."""
    width = t.element_size() * 8
    if not 0 <= bit < width:
        raise ValueError(f"bit {bit} outside a {width}-bit element")
    out = t.detach().clone()
    ints = out.view(-1).view(INT_VIEW[t.element_size()])
    mask = 1 << bit
    if mask >= 1 << (width - 1) and ints.dtype != torch.uint8:
        mask -= 1 << width  # the sign bit, as the signed integer type holds it
    ints[element] ^= mask
    return out


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@functools.lru_cache(maxsize=32)
def _fixed(shape: tuple[int, ...], dtype: torch.dtype, device: str, salt: int) -> torch.Tensor:
    """Seeded normal data, generated on the CPU (the same bits everywhere), then moved."""
    gen = torch.Generator().manual_seed(SEED + salt)
    return torch.randn(shape, generator=gen, dtype=torch.float32).to(dtype).to(device)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _result(
    name: str, outputs: tuple[torch.Tensor, ...], start: float, flip: Optional[BitFlip], keep: bool,
    device: torch.device,
) -> ProbeResult:
    if flip is not None and flip.probe == name:
        outputs = (flip_bit(outputs[0], flip.element, flip.bit), *outputs[1:])
    _sync(device)
    seconds = time.perf_counter() - start
    return ProbeResult(name, digest(*outputs), seconds, outputs[0] if keep else None)


def gemm_probe(
    device: torch.device, dtype: torch.dtype = torch.float32, *, size: Optional[int] = None,
    flip: Optional[BitFlip] = None, keep: bool = False,
) -> ProbeResult:
    """``a @ b`` on fixed square matrices (256 on CPU, 2048 on CUDA so every SM takes part)."""
    n = size or (2048 if device.type == "cuda" else 256)
    a = _fixed((n, n), dtype, str(device), 1)
    b = _fixed((n, n), dtype, str(device), 2)
    _sync(device)
    start = time.perf_counter()
    out = a @ b
    return _result(f"gemm_{_dtype_name(dtype)}", (out,), start, flip, keep, device)


def attention_probe(
    device: torch.device, dtype: torch.dtype = torch.float32, *, kernel: str = "auto", seq_len: int = 256,
    num_heads: int = 4, num_kv_heads: int = 2, head_dim: int = 64, flip: Optional[BitFlip] = None,
    keep: bool = False,
) -> ProbeResult:
    """One causal attention block through the training kernel; digests its output and LSE."""
    impl = get_kernel(kernel, device_type=device.type, dtype=dtype, head_dim=head_dim)
    q_BQHD = _fixed((1, seq_len, num_heads, head_dim), dtype, str(device), 3)
    k_BSKD = _fixed((1, seq_len, num_kv_heads, head_dim), dtype, str(device), 4)
    v_BSKD = _fixed((1, seq_len, num_kv_heads, head_dim), dtype, str(device), 5)
    _sync(device)
    start = time.perf_counter()
    with torch.no_grad():
        block = impl.forward(q_BQHD, k_BSKD, v_BSKD, causal=True, scale=default_scale(head_dim))
    name = f"attention_{impl.name}_{_dtype_name(dtype)}"
    return _result(name, (block.out_BQHD, block.lse_BHQ), start, flip, keep, device)


def collective_probe(
    group: Optional[dist.ProcessGroup], device: torch.device, *, numel: int = 65536,
    flip: Optional[BitFlip] = None, keep: bool = False,
) -> ProbeResult:
    """All-reduce (sum) of fixed integer-valued fp32 data over ``group``; collective.

    Each member adds its group rank, so a member whose contribution is lost or doubled changes
    the sum; the values stay far below 2**24, where fp32 addition is exact in any order.
    """
    size = dist.get_world_size(group)
    base = torch.randint(-1024, 1024, (numel,), generator=torch.Generator().manual_seed(SEED + 6))
    x = (base + dist.get_rank(group)).to(torch.float32).to(device)
    _sync(device)
    start = time.perf_counter()
    dist.all_reduce(x, op=dist.ReduceOp.SUM, group=group)
    return _result(f"all_reduce_x{size}", (x,), start, flip, keep, device)


def run_probes(
    device: torch.device, *, group: Optional[dist.ProcessGroup] = None, collective: bool = True,
    kernel: str = "auto", flip: Optional[BitFlip] = None, keep: bool = False,
) -> dict[str, ProbeResult]:
    """One probe round: GEMM (fp32; bf16 too on CUDA), attention, and the collective.

    The collective runs when ``collective`` and a process group exists, over ``group`` (None:
    the world); every member must then run the round together.
    """
    dtypes = (torch.float32, torch.bfloat16) if device.type == "cuda" else (torch.float32,)
    results = [gemm_probe(device, dtype, flip=flip, keep=keep) for dtype in dtypes]
    results.append(attention_probe(device, dtypes[-1], kernel=kernel, flip=flip, keep=keep))
    if collective and dist.is_available() and dist.is_initialized():
        results.append(collective_probe(group, device, flip=flip, keep=keep))
    return {r.name: r for r in results}


def digests(results: dict[str, ProbeResult]) -> dict[str, str]:
    """Probe name -> digest: what a rank reports to the controller."""
    return {name: r.digest for name, r in results.items()}
