"""Every tensor the attention code and the model make lands on their inputs' device: checked on
a machine without a GPU.

A tensor made without ``device=`` is made on the CPU, and on a GPU the next op that mixes it
with a CUDA tensor fails (``expected self and mask to be on the same device``); on the CPU tier,
where everything is on the CPU, nothing shows. So the code runs here on ``meta`` tensors
(shapes, dtypes and a device, no data; autograd works on them), under ``SameDevice``, which
refuses any op that mixes devices as CUDA does: a CPU tensor may meet a device tensor only as
a 0-dim scalar, or in a copy between devices. The CUDA kernels' aten ops have shape functions
for meta, so the fused kernels' calls run here too.

Shape legend: B batch, S sequence, H query heads, K key/value heads, D head dim.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Optional

import numpy as np
import pytest
import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from ringtrain.topology import CPLayout
from ringtrain.train.attention.block_kernel import AttentionKernel, default_scale
from ringtrain.train.attention.blocks import Cut, block_backward, block_forward
from ringtrain.train.attention.implementations import build_attention
from ringtrain.train.attention.kernels import (
    MathKernel,
    SdpaCudnnKernel,
    SdpaEfficientKernel,
    SdpaFlashKernel,
)
from ringtrain.train.model import MemorySavers, ModelArgs, Transformer
from ringtrain_dev.emulated_cp import emulated_attention, emulated_ring

aten = torch.ops.aten
DEVICE = "meta"
# The ops that take tensors on two devices on purpose.
_COPIES = (aten._to_copy, aten.copy_, aten._copy_from, aten._copy_from_and_resize)


class SameDevice(TorchDispatchMode):
    """Refuse an op whose tensors are on different devices, as CUDA ops do (meta ops alone
    let some pass, a matmul's for one)."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func.overloadpacket not in _COPIES:
            devices = {
                t.device
                for t in pytree.tree_leaves((args, kwargs))
                if isinstance(t, torch.Tensor) and not (t.device.type == "cpu" and t.dim() == 0)
            }
            if len(devices) > 1:
                raise RuntimeError(f"{func} mixes tensors on {', '.join(sorted(map(str, devices)))}")
        return func(*args, **kwargs)


@contextlib.contextmanager
def same_device() -> Iterator[None]:
    """Per thread: dispatch modes are thread-local, so every emulated rank enters its own."""
    with SameDevice():
        yield


B, HEADS, KV_HEADS, HEAD_DIM = 2, 8, 2, 64
SCALE = default_scale(HEAD_DIM)
# The block kernels a CUDA job can run, built directly: on a machine without CUDA none of the
# fused ones is "available" to look up by name.
CUDA_KERNELS: dict[str, type[AttentionKernel]] = {
    "math": MathKernel,
    "sdpa_flash": SdpaFlashKernel,
    "sdpa_cudnn": SdpaCudnnKernel,
    "sdpa_efficient": SdpaEfficientKernel,
}


def _doc_ids(seq: int) -> torch.Tensor:
    """Two documents and two padding tokens, so cut blocks and empty rows both occur. On the CPU:
    document ids never meet the compute tensors (blocks are cut by them on the host), and meta
    ids would have no values to cut by."""
    doc = torch.zeros(B, seq, dtype=torch.long)
    doc[:, seq // 3 :] = 1
    doc[:, -2:] = -1
    return doc


def _qkv(seq: int) -> list[torch.Tensor]:
    shapes = [(B, seq, HEADS, HEAD_DIM), (B, seq, KV_HEADS, HEAD_DIM), (B, seq, KV_HEADS, HEAD_DIM),
              (B, seq, HEADS, HEAD_DIM)]
    return [torch.empty(s, device=DEVICE, dtype=torch.bfloat16) for s in shapes]


def _on_device(*tensors: Optional[torch.Tensor]) -> bool:
    return all(t is not None and t.device.type == DEVICE for t in tensors)


# A sliding window is causal: it comes only with causal blocks.
BLOCK_CUTS = [(causal, cut) for causal in (True, False)
              for cut in ("whole", "documents", "window", "documents-and-window") if causal or "window" not in cut]


@pytest.mark.parametrize("name", CUDA_KERNELS)
@pytest.mark.parametrize(("causal", "cut"), BLOCK_CUTS,
                         ids=[f"{'causal' if c else 'full'}-{cut}" for c, cut in BLOCK_CUTS])
def test_blocks_keep_to_their_inputs_device(name: str, causal: bool, cut: str) -> None:
    kernel: AttentionKernel = CUDA_KERNELS[name]()
    q, k, v, dout = _qkv(128)
    docs = _doc_ids(128).numpy() if "documents" in cut else None
    positions = np.arange(128)
    how = Cut(docs, docs, 40 if "window" in cut else None, positions, positions)
    with same_device():
        fwd = block_forward(kernel, q, k, v, causal=causal, scale=SCALE, cut=how)
        grads = block_backward(kernel, dout, q, k, v, fwd.out_BQHD, fwd.lse_BHQ, fwd.aux, causal=causal,
                               scale=SCALE, cut=how)
    assert _on_device(fwd.out_BQHD, fwd.lse_BHQ, *grads)


@pytest.mark.parametrize("name", CUDA_KERNELS)
@pytest.mark.parametrize("docs", [False, True], ids=["unpacked", "packed"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_the_ring_keeps_to_its_inputs_device(name: str, docs: bool, causal: bool) -> None:
    """Every rank's ring forward and backward: half blocks, merges, travelling accumulators
    (the transport emulated, see ringtrain_dev/emulated_cp.py)."""
    kernel = CUDA_KERNELS[name]()
    q, k, v, dout = _qkv(192)
    ring = emulated_ring(q, k, v, dout, world=3, kernel=kernel, causal=causal, scale=SCALE,
                         doc_ids_BS=_doc_ids(192) if docs else None, timeout_s=20.0, rank_context=same_device)
    assert _on_device(ring.out_BSHD, ring.dq_BSHD, ring.dk_BSKD, ring.dv_BSKD)


@pytest.mark.parametrize(("ring", "ulysses", "kv_exchange"), [
    pytest.param(ring, ulysses, exchange, id=f"{runs}-{ring}-{ulysses}-{exchange}")
    for runs, ring, ulysses, exchange in [("local", 1, 1, "ring"), ("ring", 2, 1, "ring"), ("ring", 2, 1, "allgather"),
                                          ("ulysses", 1, 2, "ring"), ("hybrid", 2, 2, "ring"),
                                          ("hybrid", 2, 2, "allgather")]
])
@pytest.mark.parametrize("docs", [False, True], ids=["unpacked", "packed"])
def test_each_implementation_keeps_to_its_inputs_device(ring: int, ulysses: int, kv_exchange: str, docs: bool) -> None:
    """Forward and backward through autograd, as the model calls it."""
    q, k, v, dout = _qkv(128)
    out, grads = emulated_attention(q, k, v, dout, ring=ring, ulysses=ulysses, kernel="auto",
                                    doc_ids_BS=_doc_ids(128) if docs else None, kv_exchange=kv_exchange,
                                    timeout_s=20.0, rank_context=same_device)
    assert grads is not None and _on_device(out, *grads)


# Llama 3 RoPE scaling and Qwen3's q/k norms, so every branch of the forward runs.
TINY = ModelArgs(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, ffn_dim=48, norm_eps=1e-5,
                 rope_theta=10000.0, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
                 qk_norm=True)


@pytest.mark.parametrize("savers", [MemorySavers(), MemorySavers(checkpointing="selective", mlp_tiles=2),
                                    MemorySavers(checkpointing="full", loss_chunk_tokens=8)],
                         ids=["plain", "selective-tiled", "full-chunked"])
def test_the_model_keeps_to_its_device(savers: MemorySavers) -> None:
    """Embedding, RoPE (its frequencies kept on the CPU until used), norms, attention, MLP and
    loss, forward and backward, with each of the memory savers' paths."""
    attention = build_attention(CPLayout(1, 1), "auto", ring_group=None, ulysses_group=None)
    model = Transformer(TINY, attention_fn=attention, savers=savers).to(DEVICE).train()
    ids = torch.zeros(1, 32, dtype=torch.long, device=DEVICE)
    positions = torch.arange(32)[None].to(DEVICE)
    with same_device():
        model(ids, positions, ids).backward()
        logits = model(ids, positions)
    assert _on_device(logits, *(p.grad for p in model.parameters()))
