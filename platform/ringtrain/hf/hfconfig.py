"""A Hugging Face ``config.json``, read into ringtrain's model keys and written back.

Supported: the Llama family's four causal LMs. They share one decoder (``train/model.py``) and
differ in switches this module sets: Qwen2 has q/k/v biases, Qwen3 per-head q/k RMSNorm, Llama
optional biases, Mistral a sliding window. Rotary settings are read from both spellings in use:
the top-level ``rope_theta`` + ``rope_scaling`` that published checkpoints carry, and the
``rope_parameters`` dict transformers 5 writes; an export writes the spelling its source used.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Mapping, Optional

from ringtrain.config import JobConfig, ModelConfig, fill_model_defaults, validate, validate_rope_scaling
from ringtrain.errors import ConfigError

CONFIG_FILE = "config.json"
ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
# The architecture a model trained from scratch exports as.
DEFAULT_ARCHITECTURE = "LlamaForCausalLM"
_MODEL_TYPES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
# ModelConfig keys that config.json decides; a job that sets one must agree with it.
SHAPE_KEYS = (
    "vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn_dim", "norm_eps",
    "qkv_bias", "o_bias", "mlp_bias", "qk_norm", "tie_embeddings",
)
# Keys a job may change on purpose: the context-extension knobs.
OVERRIDABLE_KEYS = ("rope_theta", "rope_scaling", "max_position_embeddings")


def read_hf_config(folder: str | Path, key: str = "model.hf") -> dict[str, Any]:
    """``config.json`` of a model folder, or a ConfigError naming ``key`` and the file."""
    path = Path(folder)
    if not path.is_dir():
        raise ConfigError(key, f"no such model folder: {folder}")
    file = path / CONFIG_FILE
    if not file.is_file():
        raise ConfigError(key, f"{file} is missing (a Hugging Face model folder holds config.json and *.safetensors)")
    try:
        cfg = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(key, f"{file} is not valid JSON: {exc}") from None
    if not isinstance(cfg, dict):
        raise ConfigError(key, f"{file} must hold a JSON object")
    return cfg


def architecture(cfg: Mapping[str, Any], where: str = CONFIG_FILE) -> str:
    archs = cfg.get("architectures") or []
    arch = archs[0] if isinstance(archs, list) and archs else None
    if arch not in ARCHITECTURES:
        raise ConfigError("model.hf", f"{where}: architecture {arch!r} is not supported; supported: {', '.join(ARCHITECTURES)}")
    return str(arch)


def rope_settings(cfg: Mapping[str, Any]) -> tuple[float, Optional[dict[str, Any]]]:
    """(theta, rope_scaling or None) from either spelling of a config's rotary settings."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and params:
        theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta = cfg.get("rope_theta", 10000.0)
        scaling = dict(cfg.get("rope_scaling") or {})
    if "type" in scaling and "rope_type" not in scaling:
        scaling["rope_type"] = scaling.pop("type")
    if scaling.get("rope_type", "default") == "default":
        scaling = {}
    if scaling.get("rope_type") in ("llama3", "yarn"):
        scaling.setdefault("original_max_position_embeddings", cfg.get("max_position_embeddings"))
    return float(theta), (scaling or None)


def model_fields(cfg: Mapping[str, Any], where: str = CONFIG_FILE) -> dict[str, Any]:
    """The ModelConfig values a config.json means, after checking it is one ringtrain can train."""
    arch = architecture(cfg, where)
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError("model.hf", f"{where}: hidden_act {act!r} is not supported (the Llama family uses silu)")
    if cfg.get("pretraining_tp", 1) not in (None, 1):
        raise ConfigError("model.hf", f"{where}: pretraining_tp={cfg['pretraining_tp']} is not supported (use 1)")
    theta, scaling = rope_settings(cfg)
    if scaling is not None:
        validate_rope_scaling(scaling, "model.hf")
    heads = int(cfg["num_attention_heads"])
    attention_bias = bool(cfg.get("attention_bias", False))
    fields: dict[str, Any] = {
        "vocab_size": int(cfg["vocab_size"]),
        "dim": int(cfg["hidden_size"]),
        "n_layers": int(cfg["num_hidden_layers"]),
        "n_heads": heads,
        "n_kv_heads": int(cfg.get("num_key_value_heads") or heads),
        "head_dim": int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads),
        "ffn_dim": int(cfg["intermediate_size"]),
        "norm_eps": float(cfg.get("rms_norm_eps", 1e-6)),
        "rope_theta": theta,
        "rope_scaling": scaling,
        "qkv_bias": arch == "Qwen2ForCausalLM" or (arch != "MistralForCausalLM" and attention_bias),
        "o_bias": arch in ("LlamaForCausalLM", "Qwen3ForCausalLM") and attention_bias,
        "mlp_bias": arch == "LlamaForCausalLM" and bool(cfg.get("mlp_bias", False)),
        "qk_norm": arch == "Qwen3ForCausalLM",
        "tie_embeddings": bool(cfg.get("tie_word_embeddings", False)),
        "max_position_embeddings": cfg.get("max_position_embeddings"),
    }
    return fields


def sliding_window(cfg: Mapping[str, Any]) -> Optional[int]:
    """The attention window the model was trained with, or None when attention is full."""
    if _MODEL_TYPES.get(architecture(cfg)) in ("qwen2", "qwen3") and not cfg.get("use_sliding_window", False):
        return None
    window = cfg.get("sliding_window")
    return int(window) if window else None


def resolve_job(job: JobConfig) -> JobConfig:
    """``job`` with its model keys read from ``model.hf``'s config.json (a copy; ``job`` is kept).

    Shape keys the job set must agree with the file; rope_theta, rope_scaling and
    max_position_embeddings set in the job override it (that is how context is extended).
    """
    if not job.model.hf:
        return job
    cfg = read_hf_config(job.model.hf)
    where = str(Path(job.model.hf) / CONFIG_FILE)
    try:
        fields = model_fields(cfg, where)
    except KeyError as exc:
        raise ConfigError("model.hf", f"{where} lacks {exc.args[0]!r}") from None
    model = dataclasses.replace(job.model)
    for key in SHAPE_KEYS:
        mine, theirs = getattr(model, key), fields[key]
        if mine is not None and mine != theirs:
            raise ConfigError(f"model.{key}", f"{mine!r} contradicts {where} ({theirs!r}); leave it unset to use the model's")
        setattr(model, key, theirs)
    for key in OVERRIDABLE_KEYS:
        if getattr(model, key) is None:
            setattr(model, key, fields[key])
    if model.rope_scaling and model.rope_scaling.get("rope_type", model.rope_scaling.get("type")) == "default":
        model.rope_scaling = None  # {rope_type: default} is how a job drops the checkpoint's scaling
    window = sliding_window(cfg)
    if window is not None and window < job.data.seq_len:
        raise ConfigError(
            "data.seq_len",
            f"{job.data.seq_len} is longer than the sliding window {window} of {where}; ringtrain trains full "
            "causal attention, so use data.seq_len <= the window or a model without one",
        )
    resolved = dataclasses.replace(job, model=model)
    fill_model_defaults(resolved)
    validate(resolved)
    return resolved


def hf_config(model: ModelConfig, source: Optional[Mapping[str, Any]], *, trained_seq_len: int, dtype: str) -> dict[str, Any]:
    """The config.json of an exported model: the source's with what training changed, or a
    Llama config for a model trained from scratch."""
    out: dict[str, Any] = dict(source) if source else {
        "architectures": [DEFAULT_ARCHITECTURE],
        "model_type": "llama",
        "hidden_act": "silu",
        "attention_dropout": 0.0,
        "initializer_range": model.init_std,
        "use_cache": True,
    }
    arch = architecture(out)
    out.update(
        vocab_size=model.vocab_size,
        hidden_size=model.dim,
        num_hidden_layers=model.n_layers,
        num_attention_heads=model.n_heads,
        num_key_value_heads=model.n_kv_heads,
        head_dim=model.head_dim or (int(model.dim or 0) // int(model.n_heads or 1)),
        intermediate_size=model.ffn_dim,
        rms_norm_eps=model.norm_eps,
        tie_word_embeddings=bool(model.tie_embeddings),
        max_position_embeddings=max(int(model.max_position_embeddings or 0), trained_seq_len),
        dtype={"bf16": "bfloat16", "fp32": "float32"}[dtype],
    )
    out.pop("torch_dtype", None)
    if arch == "LlamaForCausalLM":
        out.update(attention_bias=bool(model.qkv_bias), mlp_bias=bool(model.mlp_bias))
    elif arch == "Qwen3ForCausalLM":
        out.update(attention_bias=bool(model.qkv_bias))
    _write_rope(out, float(model.rope_theta or 10000.0), dict(model.rope_scaling) if model.rope_scaling else None)
    return out


def _write_rope(out: dict[str, Any], theta: float, scaling: Optional[dict[str, Any]]) -> None:
    """Rotary settings in the spelling the source used (rope_parameters when it had them)."""
    if isinstance(out.get("rope_parameters"), dict):
        out["rope_parameters"] = {"rope_type": "default", **(scaling or {}), "rope_theta": theta}
        out.pop("rope_scaling", None)
        out.pop("rope_theta", None)
    else:
        out["rope_theta"] = theta
        out["rope_scaling"] = scaling
