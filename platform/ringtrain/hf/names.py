"""Parameter names: ringtrain's (``layers.3.attention.wq.weight``) <-> Hugging Face's
(``model.layers.3.self_attn.q_proj.weight``), for the Llama family's shared layout.

The tensors themselves need no transformation: ringtrain rotates with the half-split
convention that Hugging Face's Llama port uses, so q/k projection rows are in the same order.
"""

from __future__ import annotations

import re

# Per-layer submodules: ringtrain's suffix -> Hugging Face's, declared once for both directions.
_LAYER = {
    "attention_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attention.wq": "self_attn.q_proj",
    "attention.wk": "self_attn.k_proj",
    "attention.wv": "self_attn.v_proj",
    "attention.wo": "self_attn.o_proj",
    "attention.q_norm": "self_attn.q_norm",
    "attention.k_norm": "self_attn.k_norm",
    "feed_forward.w1": "mlp.gate_proj",
    "feed_forward.w3": "mlp.up_proj",
    "feed_forward.w2": "mlp.down_proj",
}
_TOP = {
    "tok_embeddings": "model.embed_tokens",
    "norm": "model.norm",
    "output": "lm_head",
}
_TO_HF = {**_TOP, **{f"layers.{{}}.{k}": f"model.layers.{{}}.{v}" for k, v in _LAYER.items()}}
_FROM_HF = {v: k for k, v in _TO_HF.items()}
_LAYER_INDEX = re.compile(r"\.(\d+)\.")


def _translate(name: str, table: dict[str, str]) -> str:
    module, _, leaf = name.rpartition(".")  # leaf: weight or bias
    match = _LAYER_INDEX.search(f".{module}.")
    pattern = _LAYER_INDEX.sub(".{}.", f".{module}.", count=1)[1:-1] if match else module
    if pattern not in table:
        raise KeyError(name)
    target = table[pattern].format(match.group(1)) if match else table[pattern]
    return f"{target}.{leaf}"


def to_hf(name: str) -> str:
    """Hugging Face's name of ringtrain parameter ``name``; KeyError for an unknown one."""
    return _translate(name, _TO_HF)


def from_hf(name: str) -> str:
    """ringtrain's name of Hugging Face tensor ``name``; KeyError for one ringtrain has no use for."""
    return _translate(name, _FROM_HF)
