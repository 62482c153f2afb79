"""The flash-attn block kernel: the ``flash_attn`` package's FlashAttention-2 internals, which return the LSE.

``flash_attn_func`` returns the output only; its internals ``_flash_attn_forward`` and
``_flash_attn_backward`` take and return the LSE, but their signatures move between releases,
so calls are built from the installed function's own signature. The package is imported on
first use, never at module import (it loads a CUDA extension).

Shape legend: B batch, Q query length of the block, S key length of the block, H query heads,
K key/value heads, D head dim (padded to a multiple of 8).
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

import torch

from ringtrain.train.attention.block_kernel import (HALF, AttentionKernel, BackwardInputs, BlockCall, Grads, KernelSpec,
                                                    KernelUnavailableError)

Tensor = torch.Tensor


# The values we set whatever the release calls them: no sliding window, softcap or ALiBi.
_NEUTRAL = {
    "window_size": (-1, -1),
    "window_size_left": -1,
    "window_size_right": -1,
    "softcap": 0.0,
    "alibi_slopes": None,
}


@functools.lru_cache(maxsize=None)
def _call_defaults(fn: Callable[..., Any]) -> tuple[tuple[str, ...], Mapping[str, Any]]:
    """``fn``'s parameter names and the values we pass unless told otherwise (its own
    defaults, then ``_NEUTRAL``); read once per function, not on every block call."""
    params = inspect.signature(getattr(fn, "_init_fn", fn)).parameters
    defaults = {n: p.default for n, p in params.items() if p.default is not inspect.Parameter.empty}
    defaults.update({n: value for n, value in _NEUTRAL.items() if n in params})
    return tuple(params), MappingProxyType(defaults)


def _flash_attn_call_kwargs(fn: Callable[..., Any], **given: Any) -> dict[str, Any]:
    """Keyword arguments for a flash-attn internal whose signature moves between releases:
    ``given`` where ``fn`` takes it, ``_call_defaults`` for the rest."""
    names, defaults = _call_defaults(fn)
    kwargs = dict(defaults)
    kwargs.update({n: value for n, value in given.items() if n in names})
    missing = [n for n in names if n not in kwargs]
    if missing:
        raise KernelUnavailableError(
            "flash_attn", f"unsupported flash-attn release: {fn.__name__} also needs {missing}"
        )
    return kwargs


# From 2.1 flash-attn aligns the causal mask of a block wider than tall bottom-right, as
# ``aligns_causal_bottom_right`` says; an older one aligns it top-left and is not offered.
_OLDEST = (2, 1)


def _flash_attn_importable() -> bool:
    try:
        importlib.import_module("flash_attn.flash_attn_interface")
        release = _release(importlib.import_module("flash_attn").__version__)
    except Exception:  # an ImportError, a CUDA/ABI mismatch raised while loading its extension, a bad version
        return False
    return release >= _OLDEST


def _release(version: str) -> tuple[int, ...]:
    """``"2.8.3.post2"`` -> ``(2, 8)``: the major and minor release of a version string."""
    return tuple(int(part) for part in version.split(".")[:2])


class FlashAttnKernel(AttentionKernel):
    """The ``flash_attn`` package (FlashAttention-2): BSHD layout and GQA natively."""

    name = "flash_attn"
    # FlashAttention-2: D <= 256 (flash-attn's mha_fwd/mha_bwd).
    spec = KernelSpec(frozenset({"cuda"}), HALF, max_head_dim=256)
    # ``_flash_attn_forward``/``_backward`` take D % 8 == 0 and leave the padding to
    # ``FlashAttnFunc``, which this kernel bypasses to get the LSE.
    pad_head_dim_to = 8
    # A chunk's rows against its prefix and itself run as one call (flash-attn from 2.1, ``_OLDEST``).
    aligns_causal_bottom_right = True
    unavailable = "the flash_attn package (2.1 or newer) is not importable here, or the GPU is older than sm80"

    @classmethod
    def runs_here(cls, device_type: str) -> bool:
        return (
            device_type == "cuda"
            and torch.cuda.is_available()
            and torch.cuda.get_device_capability() >= (8, 0)
            and _flash_attn_importable()
        )

    def takes_gqa(self) -> bool:
        return True

    def _op_forward(self, q_BQHD: Tensor, k_BSKD: Tensor, v_BSKD: Tensor, call: BlockCall) -> tuple[Tensor, Tensor, Any]:
        fa = importlib.import_module("flash_attn.flash_attn_interface")
        kwargs = _flash_attn_call_kwargs(fa._flash_attn_forward, q=q_BQHD, k=k_BSKD, v=v_BSKD, dropout_p=0.0,
                                         softmax_scale=call.scale, causal=call.causal, return_softmax=False)
        result = fa._flash_attn_forward(**kwargs)
        # >= 2.6: (out, lse, S_dmask, rng_state); before: (out, q, k, v, out_padded, lse, S_dmask, rng_state)
        if len(result) == 4:
            return result[0], result[1], result[3]
        return result[0], result[5], result[7]

    def _op_backward(self, inputs: BackwardInputs, aux: Any, call: BlockCall) -> Grads:
        fa = importlib.import_module("flash_attn.flash_attn_interface")
        dq, dk, dv = torch.empty_like(inputs.q), torch.empty_like(inputs.k), torch.empty_like(inputs.v)
        kwargs = _flash_attn_call_kwargs(fa._flash_attn_backward, dout=inputs.dout, q=inputs.q, k=inputs.k, v=inputs.v,
                                         out=inputs.out, softmax_lse=inputs.lse, dq=dq, dk=dk, dv=dv, dropout_p=0.0,
                                         softmax_scale=call.scale, causal=call.causal, deterministic=False,
                                         rng_state=aux)
        fa._flash_attn_backward(**kwargs)
        return dq, dk, dv
