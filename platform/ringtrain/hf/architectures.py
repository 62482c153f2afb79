"""The Hugging Face architectures ringtrain reads and writes: their names, what each can express
of ringtrain's model keys, the ones refused and why, and the config a model trained from
scratch exports with.

An architecture's config.json cannot say everything ringtrain's decoder can: Llama has no
attention window, Mistral's window covers every layer, only Gemma 3 has Gemma's block (its
norms, scaled embeddings, attention scale, logit soft-capping) and a RoPE of its own for the
sliding layers. ``check_expressible`` refuses, naming the key, a model its architecture cannot
write back, so an import whose overrides went beyond it stops before training, not at export.
"""

from __future__ import annotations

from typing import Any, Optional

from ringtrain.config import ModelConfig
from ringtrain.errors import ConfigError

LLAMA = "LlamaForCausalLM"
MISTRAL = "MistralForCausalLM"
QWEN2 = "Qwen2ForCausalLM"
QWEN3 = "Qwen3ForCausalLM"
GEMMA3 = "Gemma3ForCausalLM"
ARCHITECTURES = (LLAMA, MISTRAL, QWEN2, QWEN3, GEMMA3)
MODEL_TYPES = {LLAMA: "llama", MISTRAL: "mistral", QWEN2: "qwen2", QWEN3: "qwen3", GEMMA3: "gemma3_text"}
# The architecture a model trained from scratch exports as, without windows or Gemma's block.
DEFAULT_ARCHITECTURE = LLAMA

# Architectures refused with the reason, for a message better than "not supported".
_REFUSED = {
    "Gemma2ForCausalLM": (
        "Gemma 2 soft-caps its attention scores (attn_logit_softcapping), which needs an attention kernel that "
        "applies the cap inside the softmax and still returns the log-sum-exp that merging blocks across a ring "
        "needs; ringtrain's kernels do not"
    ),
    "Gemma3ForConditionalGeneration": (
        "that is Gemma 3's vision-language model; ringtrain trains the text model (Gemma3ForCausalLM)"
    ),
}

# transformers' Gemma3TextConfig defaults for keys a config.json may leave out.
_GEMMA3_DEFAULTS: dict[str, Any] = {
    "head_dim": 256,
    "query_pre_attn_scalar": 256.0,
    "sliding_window": 4096,
    "sliding_window_pattern": 6,
    "rope_theta": 1_000_000.0,
    "rope_local_base_freq": 10_000.0,
}


def refusal(arch: Any) -> Optional[str]:
    """Why ``arch`` is refused, when it is one ringtrain knows and does not train."""
    return _REFUSED.get(arch) if isinstance(arch, str) else None


def gemma3_defaults() -> dict[str, Any]:
    return dict(_GEMMA3_DEFAULTS)


def check_expressible(arch: str, model: ModelConfig, windows: tuple[Optional[int], ...]) -> None:
    """ConfigError naming the first model key whose value ``arch``'s config.json cannot hold."""

    def refuse(key: str, reason: str) -> None:
        raise ConfigError(f"model.{key}", f"{arch} {reason}")

    gemma = arch == GEMMA3
    if (model.norm_style == "gemma") != gemma:
        refuse("norm_style", "has Gemma's norms" if gemma else "has Llama's norms (norm_style llama); Gemma's block exports as Gemma3ForCausalLM")
    if bool(model.scale_embeddings) != gemma:
        refuse("scale_embeddings", "scales its embeddings by sqrt(dim)" if gemma else "does not scale its embeddings")
    if gemma and not model.qk_norm:
        refuse("qk_norm", "normalises every head's query and key")
    if not gemma:
        for key in ("query_pre_attn_scalar", "final_logit_softcapping", "rope_local_theta", "rope_local_scaling"):
            if getattr(model, key) is not None:
                refuse(key, "has no such setting (Gemma3ForCausalLM has)")
    windowed = [w for w in windows if w is not None]
    if arch == LLAMA and windowed:
        refuse("sliding_window", "has no sliding window (a model windowed on every layer exports as MistralForCausalLM)")
    if arch == MISTRAL:
        if windowed and len(windowed) != len(windows):
            refuse("layer_types", "applies its sliding window to every layer; it cannot mix windowed and full layers")
        for key in ("qkv_bias", "o_bias", "mlp_bias"):
            if getattr(model, key):
                refuse(key, "has no biases")
    if gemma and (model.mlp_bias or bool(model.qkv_bias) != bool(model.o_bias)):
        refuse("mlp_bias" if model.mlp_bias else "o_bias", "has one attention_bias for q, k, v and o, and none in its MLP")


def scratch_architecture(model: ModelConfig, windows: tuple[Optional[int], ...]) -> str:
    """The architecture a model trained from scratch exports as."""
    if model.norm_style == "gemma":
        return GEMMA3
    if windows and all(w is not None for w in windows):
        return MISTRAL
    return DEFAULT_ARCHITECTURE


def scratch_config(arch: str, model: ModelConfig) -> dict[str, Any]:
    """The keys of ``arch``'s config.json that ringtrain's model keys do not fill."""
    out: dict[str, Any] = {
        "architectures": [arch],
        "model_type": MODEL_TYPES[arch],
        "attention_dropout": 0.0,
        "initializer_range": model.init_std,
        "use_cache": True,
    }
    if arch == GEMMA3:
        out.update(attn_logit_softcapping=None, use_bidirectional_attention=False, attention_bias=False)
    else:
        out["hidden_act"] = model.activation or "silu"
    return out
