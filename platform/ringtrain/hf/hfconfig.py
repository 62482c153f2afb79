"""A Hugging Face ``config.json``, read into ringtrain's model keys and written back.

Supported: the Llama family's four causal LMs and Gemma 3's text model. They share one decoder
(``train/model.py``) and differ in switches this module sets: Qwen2 has q/k/v biases, Qwen3
per-head q/k RMSNorm, Llama optional biases, Mistral a sliding window on every layer, Qwen2 and
Qwen3 one on the layers from ``max_window_layers`` on when ``use_sliding_window`` (or those
``layer_types`` names), and Gemma 3 its own block (``hf/architectures.py``). Rotary settings are
read from both spellings in use: the top-level ``rope_theta`` + ``rope_scaling`` that published
checkpoints carry, and the ``rope_parameters`` dict transformers 5 writes (per layer type for
Gemma 3); an export writes the spelling its source used.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Mapping, Optional

from ringtrain.config import (
    ACTIVATIONS,
    FULL_ATTENTION,
    RUN_CONFIG,
    SLIDING_ATTENTION,
    JobConfig,
    ModelConfig,
    fill_model_defaults,
    validate,
    validate_rope_scaling,
)
from ringtrain.errors import ConfigError
from ringtrain.jsonfile import JsonFileError, read_json
from ringtrain.links import check_folder
from ringtrain.hf.architectures import (
    ARCHITECTURES,
    GEMMA3,
    LLAMA,
    MISTRAL,
    QWEN2,
    QWEN3,
    check_expressible,
    gemma3_defaults,
    refusal,
    scratch_architecture,
    scratch_config,
)

CONFIG_FILE = "config.json"
# ModelConfig keys that config.json decides; a job that sets one must agree with it.
SHAPE_KEYS = (
    "vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn_dim", "norm_eps",
    "qkv_bias", "o_bias", "mlp_bias", "qk_norm", "tie_embeddings",
    "norm_style", "activation", "scale_embeddings", "query_pre_attn_scalar", "final_logit_softcapping",
)
# Keys a job may change on purpose: the context-extension knobs, and the attention windows.
OVERRIDABLE_KEYS = (
    "rope_theta", "rope_scaling", "max_position_embeddings",
    "rope_local_theta", "rope_local_scaling", "sliding_window", "layer_types",
)
# transformers' defaults for keys Qwen2's and Qwen3's config.json may leave out.
QWEN_MAX_WINDOW_LAYERS = 28


def read_hf_config(folder: str | Path, key: str = "model.hf") -> dict[str, Any]:
    """``config.json`` of a model folder, or a ConfigError naming ``key`` and the file."""
    path = Path(folder)
    if not path.is_dir():
        raise ConfigError(key, f"no such model folder: {folder}")
    file = path / CONFIG_FILE
    if not file.is_file() and (path / RUN_CONFIG).is_file():
        raise ConfigError(
            key,
            f"{folder} is a ringtrain run directory, not a Hugging Face model folder: export it first "
            f"with `ringtrain export {folder} OUT_DIR` and give OUT_DIR",
        )
    if not file.is_file():
        raise ConfigError(key, f"{file} is missing (a Hugging Face model folder holds config.json and *.safetensors)")
    # Every file of the folder, not only config.json: transformers, the tokenizer and an export
    # read the others by name.
    check_folder(path, key)
    try:
        cfg = read_json(file)
    except JsonFileError as exc:
        raise ConfigError(key, f"{file} {exc}") from None
    if not isinstance(cfg, dict):
        raise ConfigError(key, f"{file} must hold a JSON object")
    return cfg


def architecture(cfg: Mapping[str, Any], where: str = CONFIG_FILE) -> str:
    archs = cfg.get("architectures") or []
    arch = archs[0] if isinstance(archs, list) and archs else None
    reason = refusal(arch)
    if reason is not None:
        raise ConfigError("model.hf", f"{where}: architecture {arch!r} is not supported: {reason}")
    if arch not in ARCHITECTURES:
        raise ConfigError("model.hf", f"{where}: architecture {arch!r} is not supported; supported: {', '.join(ARCHITECTURES)}")
    return str(arch)


def norm_style_of(cfg: Mapping[str, Any]) -> str:
    """The norm style (config's NORM_STYLES) a config.json's architecture has."""
    return "gemma" if architecture(cfg) == GEMMA3 else "llama"


def _rope_of(
    params: Mapping[str, Any], cfg: Mapping[str, Any], default_theta: float
) -> tuple[float, Optional[dict[str, Any]]]:
    """(theta, rope_scaling or None) from one rotary dict in either spelling's keys."""
    theta = params.get("rope_theta", default_theta)
    scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    if "type" in scaling and "rope_type" not in scaling:
        scaling["rope_type"] = scaling.pop("type")
    if scaling.get("rope_type", "default") == "default":
        scaling = {}
    if scaling.get("rope_type") in ("llama3", "yarn"):
        scaling.setdefault("original_max_position_embeddings", cfg.get("max_position_embeddings"))
    return float(theta), (scaling or None)


def rope_settings(cfg: Mapping[str, Any]) -> tuple[float, Optional[dict[str, Any]]]:
    """(theta, rope_scaling or None) from either spelling of a config's rotary settings; for
    Gemma 3, the full-attention layers'."""
    if architecture(cfg) == GEMMA3:
        return gemma3_rope_settings(cfg)[0]
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and params:
        return _rope_of(params, cfg, cfg.get("rope_theta", 10000.0))
    return _rope_of({**dict(cfg.get("rope_scaling") or {}), "rope_theta": cfg.get("rope_theta", 10000.0)}, cfg, 10000.0)


Rope = tuple[float, Optional[dict[str, Any]]]


def gemma3_rope_settings(cfg: Mapping[str, Any]) -> tuple[Rope, Rope]:
    """(full layers', sliding layers') rotary settings of a Gemma 3 config: ``rope_parameters`` per
    layer type, or the older ``rope_theta`` + ``rope_scaling`` (the full layers') and
    ``rope_local_base_freq``, with transformers' defaults (1M and 10K)."""
    defaults = gemma3_defaults()
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and (FULL_ATTENTION in params or SLIDING_ATTENTION in params):
        full = dict(params.get(FULL_ATTENTION) or {})
        sliding = dict(params.get(SLIDING_ATTENTION) or {})
    else:
        full = {**dict(cfg.get("rope_scaling") or {}), "rope_theta": cfg.get("rope_theta", defaults["rope_theta"])}
        sliding = {"rope_theta": cfg.get("rope_local_base_freq", defaults["rope_local_base_freq"])}
    return _rope_of(full, cfg, defaults["rope_theta"]), _rope_of(sliding, cfg, defaults["rope_local_base_freq"])


def attention_windows(cfg: Mapping[str, Any], arch: str, n_layers: int, where: str) -> tuple[Optional[int], Optional[list[str]]]:
    """(sliding_window, layer_types) as transformers reads them: Mistral windows every layer;
    Qwen2 and Qwen3 only with ``use_sliding_window``, on the layers ``layer_types`` names or else
    those from ``max_window_layers`` on; Gemma 3 on ``layer_types``' sliding layers, or else every
    layer but each ``sliding_window_pattern``-th. None for every layer full."""
    if arch == LLAMA:
        return None, None
    if arch == MISTRAL:
        return (int(cfg["sliding_window"]) if cfg.get("sliding_window") else None), None
    if arch in (QWEN2, QWEN3):
        if not cfg.get("use_sliding_window") or not cfg.get("sliding_window"):
            return None, None
        first = int(cfg.get("max_window_layers", QWEN_MAX_WINDOW_LAYERS))
        kinds = cfg.get("layer_types") or [SLIDING_ATTENTION if i >= first else FULL_ATTENTION for i in range(n_layers)]
        return int(cfg["sliding_window"]), _layer_types(kinds, n_layers, where)
    if cfg.get("use_bidirectional_attention"):
        raise ConfigError("model.hf", f"{where}: use_bidirectional_attention is set; ringtrain trains causal language models")
    window = cfg.get("sliding_window", gemma3_defaults()["sliding_window"])
    pattern = int(cfg.get("sliding_window_pattern", gemma3_defaults()["sliding_window_pattern"]))
    kinds = cfg.get("layer_types") or [FULL_ATTENTION if (i + 1) % pattern == 0 else SLIDING_ATTENTION for i in range(n_layers)]
    return (int(window) if window else None), _layer_types(kinds, n_layers, where)


def _layer_types(kinds: Any, n_layers: int, where: str) -> list[str]:
    if not isinstance(kinds, list) or len(kinds) != n_layers or any(k not in (FULL_ATTENTION, SLIDING_ATTENTION) for k in kinds):
        raise ConfigError(
            "model.hf", f"{where}: layer_types must list {FULL_ATTENTION} or {SLIDING_ATTENTION} for each of {n_layers} layers"
        )
    return list(kinds)


def model_fields(cfg: Mapping[str, Any], where: str = CONFIG_FILE) -> dict[str, Any]:
    """The ModelConfig values a config.json means, after checking it is one ringtrain can train."""
    arch = architecture(cfg, where)
    gemma = arch == GEMMA3
    act = cfg.get("hidden_activation", "gelu_pytorch_tanh") if gemma else cfg.get("hidden_act", "silu")
    if act not in ACTIVATIONS:
        raise ConfigError("model.hf", f"{where}: the activation {act!r} is not supported (supported: {', '.join(ACTIVATIONS)})")
    if cfg.get("pretraining_tp", 1) not in (None, 1):
        raise ConfigError("model.hf", f"{where}: pretraining_tp={cfg['pretraining_tp']} is not supported (use 1)")
    if gemma and cfg.get("attn_logit_softcapping") is not None:
        raise ConfigError(
            "model.hf",
            f"{where}: attn_logit_softcapping={cfg['attn_logit_softcapping']} soft-caps the attention scores, which needs an "
            "attention kernel that applies it and still returns the log-sum-exp the context-parallel merge needs; "
            "ringtrain's kernels do not",
        )
    theta, scaling = rope_settings(cfg)
    if scaling is not None:
        validate_rope_scaling(scaling, "model.hf")
    heads = int(cfg["num_attention_heads"])
    n_layers = int(cfg["num_hidden_layers"])
    attention_bias = bool(cfg.get("attention_bias", False))
    window, kinds = attention_windows(cfg, arch, n_layers, where)
    default_head_dim = gemma3_defaults()["head_dim"] if gemma else int(cfg["hidden_size"]) // heads
    fields: dict[str, Any] = {
        "vocab_size": int(cfg["vocab_size"]),
        "dim": int(cfg["hidden_size"]),
        "n_layers": n_layers,
        "n_heads": heads,
        "n_kv_heads": int(cfg.get("num_key_value_heads") or heads),
        "head_dim": int(cfg.get("head_dim") or default_head_dim),
        "ffn_dim": int(cfg["intermediate_size"]),
        "norm_eps": float(cfg.get("rms_norm_eps", 1e-6)),
        "rope_theta": theta,
        "rope_scaling": scaling,
        "qkv_bias": arch == QWEN2 or (arch != MISTRAL and attention_bias),
        "o_bias": arch in (LLAMA, QWEN3, GEMMA3) and attention_bias,
        "mlp_bias": arch == LLAMA and bool(cfg.get("mlp_bias", False)),
        "qk_norm": arch in (QWEN3, GEMMA3),
        "tie_embeddings": bool(cfg.get("tie_word_embeddings", gemma)),
        "max_position_embeddings": cfg.get("max_position_embeddings"),
        "sliding_window": window,
        "layer_types": kinds,
        "rope_local_theta": None,
        "rope_local_scaling": None,
        "norm_style": "gemma" if gemma else "llama",
        "activation": act,
        "scale_embeddings": gemma,
        "query_pre_attn_scalar": float(cfg.get("query_pre_attn_scalar", gemma3_defaults()["query_pre_attn_scalar"])) if gemma else None,
        "final_logit_softcapping": cfg.get("final_logit_softcapping") if gemma else None,
    }
    if gemma:
        fields["rope_local_theta"], fields["rope_local_scaling"] = gemma3_rope_settings(cfg)[1]
        if fields["rope_local_scaling"] is not None:
            validate_rope_scaling(fields["rope_local_scaling"], "model.hf")
    return fields


def resolve_job(job: JobConfig) -> JobConfig:
    """``job`` with its model keys read from ``model.hf``'s config.json (a copy; ``job`` is kept).

    Shape keys the job set must agree with the file; the overridable keys set in the job
    override it (that is how context is extended, and how a window is changed).
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
    for key in ("rope_scaling", "rope_local_scaling"):
        scaling = getattr(model, key)
        if scaling and scaling.get("rope_type", scaling.get("type")) == "default":
            setattr(model, key, None)  # {rope_type: default} is how a job drops the checkpoint's scaling
    resolved = dataclasses.replace(job, model=model)
    fill_model_defaults(resolved)
    validate(resolved)
    if model.layer_types and SLIDING_ATTENTION in model.layer_types and model.sliding_window is None:
        raise ConfigError("model.sliding_window", f"is unset, but model.layer_types has {SLIDING_ATTENTION} layers: give their window")
    check_expressible(architecture(cfg, where), model, resolved.layer_windows)
    return resolved


def hf_config(model: ModelConfig, source: Optional[Mapping[str, Any]], *, trained_seq_len: int, dtype: str) -> dict[str, Any]:
    """The config.json of an exported model: the source's with what training changed, or, for a
    model trained from scratch, that of the architecture that expresses it (Llama's, Mistral's
    when every layer is windowed, Gemma 3's for Gemma's block)."""
    windows = JobConfig(model=model).layer_windows
    out: dict[str, Any] = dict(source) if source else scratch_config(scratch_architecture(model, windows), model)
    arch = architecture(out)
    check_expressible(arch, model, windows)
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
    if arch == LLAMA:
        out.update(attention_bias=bool(model.qkv_bias), mlp_bias=bool(model.mlp_bias), hidden_act=model.activation or "silu")
    elif arch in (QWEN3, GEMMA3):
        out.update(attention_bias=bool(model.qkv_bias))
    _write_windows(out, arch, model, windows)
    if arch == GEMMA3:
        scalar = model.query_pre_attn_scalar
        # transformers' Gemma3TextConfig takes an int here (and its checkpoints carry one).
        out["query_pre_attn_scalar"] = int(scalar) if scalar is not None and float(scalar).is_integer() else scalar
        out["final_logit_softcapping"] = model.final_logit_softcapping
        out["hidden_activation"] = model.activation
        _write_gemma3_rope(out, model)
    else:
        _write_rope(out, float(model.rope_theta or 10000.0), dict(model.rope_scaling) if model.rope_scaling else None)
    return out


def _write_windows(out: dict[str, Any], arch: str, model: ModelConfig, windows: tuple[Optional[int], ...]) -> None:
    """The attention windows in the architecture's keys (``check_expressible`` passed)."""
    window = next((w for w in windows if w is not None), None)
    kinds = [FULL_ATTENTION if w is None else SLIDING_ATTENTION for w in windows]
    if arch == MISTRAL:
        out["sliding_window"] = window
    elif arch in (QWEN2, QWEN3):
        out["use_sliding_window"] = window is not None
        if window is None:
            if "layer_types" in out:
                out["layer_types"] = kinds
            return
        out.update(sliding_window=window, layer_types=kinds)
        leading_full = next((i for i, kind in enumerate(kinds) if kind == SLIDING_ATTENTION), len(kinds))
        if all(kind == SLIDING_ATTENTION for kind in kinds[leading_full:]):
            out["max_window_layers"] = leading_full  # what readers without layer_types go by
    elif arch == GEMMA3:
        # transformers builds Gemma 3's sliding mask whatever the layers are, and needs a window
        # for it: with every layer full, the source's (or the default) stays, unused.
        unused = out.get("sliding_window") or gemma3_defaults()["sliding_window"]
        out.update(sliding_window=window if window is not None else unused, layer_types=kinds)


def _write_rope(out: dict[str, Any], theta: float, scaling: Optional[dict[str, Any]]) -> None:
    """Rotary settings in the spelling the source used (rope_parameters when it had them)."""
    if isinstance(out.get("rope_parameters"), dict):
        out["rope_parameters"] = {"rope_type": "default", **(scaling or {}), "rope_theta": theta}
        out.pop("rope_scaling", None)
        out.pop("rope_theta", None)
    else:
        out["rope_theta"] = theta
        out["rope_scaling"] = scaling


def _write_gemma3_rope(out: dict[str, Any], model: ModelConfig) -> None:
    """Gemma 3's two rotary settings, in the spelling the source used: ``rope_parameters`` per
    layer type, or ``rope_theta`` + ``rope_scaling`` (the full layers') and
    ``rope_local_base_freq`` (the sliding layers', which that spelling cannot scale)."""
    full_theta = float(model.rope_theta or gemma3_defaults()["rope_theta"])
    local_theta = float(model.rope_local_theta if model.rope_local_theta is not None else full_theta)
    full_scaling = dict(model.rope_scaling) if model.rope_scaling else None
    local_scaling = dict(model.rope_local_scaling) if model.rope_local_scaling else None
    if isinstance(out.get("rope_parameters"), dict) or local_scaling is not None:
        out["rope_parameters"] = {
            FULL_ATTENTION: {"rope_type": "default", **(full_scaling or {}), "rope_theta": full_theta},
            SLIDING_ATTENTION: {"rope_type": "default", **(local_scaling or {}), "rope_theta": local_theta},
        }
        for key in ("rope_scaling", "rope_theta", "rope_local_base_freq"):
            out.pop(key, None)
    else:
        out.update(rope_theta=full_theta, rope_scaling=full_scaling, rope_local_base_freq=local_theta)
