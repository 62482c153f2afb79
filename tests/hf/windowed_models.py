"""Tiny random Hugging Face models whose attention is windowed, made locally (no download):
Gemma 3 (five-to-one local and global layers in miniature, each kind with its own RoPE),
Mistral (every layer windowed) and Qwen2 (windowed from ``max_window_layers`` on).

Windows are 8 to 24 tokens against sequences of 64 (shorter and longer than a context-parallel
rank's zigzag chunk, and not aligned to one), so a window off by one moves the logits. Weights
are peaky (``initializer_range`` 0.35, see tests/hf_models.py), and the norm gains are drawn too:
transformers starts Gemma's at zero, where (1 + w) and w would agree on every model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.hf_models import TINY_CONFIG

# Each model's window: shorter than the sequences tested.
WINDOWS = {"gemma3": 8, "gemma3-softcap": 8, "mistral-windowed": 24, "qwen2-windowed": 13}
MODELS = tuple(WINDOWS)


def windowed_config(name: str, **extra: Any) -> Any:
    from transformers import Gemma3TextConfig, MistralConfig, Qwen2Config

    common: dict[str, Any] = {**TINY_CONFIG, "sliding_window": WINDOWS[name]}
    if name.startswith("gemma3"):
        gemma: dict[str, Any] = dict(
            num_hidden_layers=4,
            # Two local layers, a global one, a local one: the order matters, not only the count.
            layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
            head_dim=24,  # not dim / heads
            query_pre_attn_scalar=20,  # not head_dim: the attention scale is Gemma's own
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 50000.0},
            },
            final_logit_softcapping=4.0 if name == "gemma3-softcap" else None,
        )
        return Gemma3TextConfig(**{**common, **gemma, **extra})
    if name == "mistral-windowed":
        return MistralConfig(**{**common, "num_hidden_layers": 2, **extra})
    if name == "qwen2-windowed":
        # Layer 0 full, layers 1 and 2 windowed: transformers' rule for max_window_layers.
        return Qwen2Config(**{**common, "num_hidden_layers": 3, "use_sliding_window": True, "max_window_layers": 1, **extra})
    raise ValueError(name)


def save_windowed(folder: Path, name: str, *, seed: int = 0, **extra: Any) -> Path:
    """A random ``name`` model saved with ``save_pretrained`` into ``folder``; returns it."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(windowed_config(name, **extra), dtype=torch.float32)
    with torch.no_grad():
        for param_name, p in model.named_parameters():
            if param_name.endswith("bias"):
                p.normal_(0, 0.2)
            elif "norm" in param_name:
                p.normal_(0, 0.2).add_(0.0 if name.startswith("gemma3") else 1.0)
    model.save_pretrained(folder, safe_serialization=True)
    return folder
