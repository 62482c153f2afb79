"""Parameter names: ringtrain's (``layers.3.attention.wq.weight``) <-> Hugging Face's
(``model.layers.3.self_attn.q_proj.weight``), for the Llama family's layout and Gemma 3's.

The two layouts differ only in the norms of a layer: Llama's ``post_attention_layernorm`` is the
norm before the MLP, while Gemma names its four norms by where they sit around each branch (its
``post_attention_layernorm`` norms the attention's output). So the table is chosen by the
model's ``norm_style``, the config key that decides which norms a layer has.

The tensors themselves need no transformation: ringtrain rotates with the half-split
convention that Hugging Face's Llama and Gemma ports use, so q/k projection rows are in the same
order, and a Gemma gain is stored as Gemma stores it (the w of 1 + w).
"""

from __future__ import annotations

import re

# Per-layer submodules both layouts share: ringtrain's suffix -> Hugging Face's.
_SHARED_LAYER = {
    "attention_norm": "input_layernorm",
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
# The norms after the attention, by norm style (config's NORM_STYLES).
_STYLE_LAYER = {
    "llama": {"ffn_norm": "post_attention_layernorm"},
    "gemma": {
        "attention_out_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm",
        "ffn_out_norm": "post_feedforward_layernorm",
    },
}
_TOP = {
    "tok_embeddings": "model.embed_tokens",
    "norm": "model.norm",
    "output": "lm_head",
}
_LAYER_INDEX = re.compile(r"\.(\d+)\.")


def _to_hf_table(style: str) -> dict[str, str]:
    layer = {**_SHARED_LAYER, **_STYLE_LAYER[style]}
    return {**_TOP, **{f"layers.{{}}.{k}": f"model.layers.{{}}.{v}" for k, v in layer.items()}}


_TO_HF = {style: _to_hf_table(style) for style in _STYLE_LAYER}
_FROM_HF = {style: {v: k for k, v in table.items()} for style, table in _TO_HF.items()}


def _translate(name: str, table: dict[str, str]) -> str:
    module, _, leaf = name.rpartition(".")  # leaf: weight or bias
    match = _LAYER_INDEX.search(f".{module}.")
    pattern = _LAYER_INDEX.sub(".{}.", f".{module}.", count=1)[1:-1] if match else module
    if pattern not in table:
        raise KeyError(name)
    target = table[pattern].format(match.group(1)) if match else table[pattern]
    return f"{target}.{leaf}"


def to_hf(name: str, style: str = "llama") -> str:
    """Hugging Face's name of ringtrain parameter ``name`` in a model of norm style ``style``;
    KeyError for an unknown one."""
    return _translate(name, _TO_HF[style])


def from_hf(name: str, style: str = "llama") -> str:
    """ringtrain's name of Hugging Face tensor ``name``; KeyError for one ringtrain has no use for."""
    return _translate(name, _FROM_HF[style])
