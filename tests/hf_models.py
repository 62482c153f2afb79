"""Tiny random Hugging Face models of each supported architecture, made locally (no download).

Weights are drawn with a large ``initializer_range`` so the model's predictions depend visibly
on positions and scaling: at the default 0.02 a tiny model predicts nearly uniformly and a
wrong rotary frequency would move the loss by less than the tolerance.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import torch

ARCHS = ("llama", "mistral", "qwen2", "qwen3")
VOCAB = 96


# The tiny shape and token ids every test model has (tests/hf/windowed_models.py's too); each
# architecture adds its own keys.
TINY_CONFIG: dict[str, Any] = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=32,
    rms_norm_eps=1e-6,
    initializer_range=0.35,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


def hf_config(arch: str, *, rope: Optional[dict[str, Any]] = None, tie: bool = False, **extra: Any) -> Any:
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    common: dict[str, Any] = {**TINY_CONFIG, "num_hidden_layers": 2, "tie_word_embeddings": tie, **extra}
    if rope is not None:
        common["rope_parameters"] = rope
    if arch == "llama":
        return LlamaConfig(**common)
    if arch == "mistral":
        return MistralConfig(sliding_window=None, **common)
    if arch == "qwen2":
        return Qwen2Config(**common)
    if arch == "qwen3":
        return Qwen3Config(head_dim=24, **common)  # an explicit head dim that is not dim / heads
    raise ValueError(arch)


def save_model(folder: Path, arch: str, *, seed: int = 0, dtype: torch.dtype = torch.float32, **kwargs: Any) -> Path:
    """A random ``arch`` model saved with ``save_pretrained`` into ``folder``; returns it."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config(arch, **kwargs), dtype=dtype)
    with torch.no_grad():  # biases start at zero; make them matter
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.2)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def hf_logits(folder: Path, ids: torch.Tensor) -> tuple[torch.Tensor, float]:
    """transformers' own logits and loss (labels = input_ids) for ``ids`` [N, L], in fp32."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    with torch.no_grad():
        out = model(input_ids=ids, labels=ids)
    return out.logits, float(out.loss)


def tokens(n: int, length: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (n, length), generator=g)


def greedy_reference(folder: Path, prompts: list[list[int]], new: int) -> list[list[int]]:
    """transformers' greedy continuation of each prompt alone (no padding), fp32, no EOS stop."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    model.generation_config.eos_token_id = None
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            gen = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                                 do_sample=False, pad_token_id=0)
            out.append(gen[0, len(p):].tolist())
    return out
