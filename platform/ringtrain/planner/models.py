"""Model shapes the planner reasons about: named presets and the model of a job config.

A ``ModelSpec`` is the Llama-style decoder of ``ringtrain.train.model`` reduced to its sizes:
an input embedding and an output projection (one matrix when tied), per layer two RMSNorm gains
(four with Gemma's norms on each branch's output too), grouped-query attention (``wq``, ``wk``,
``wv``, ``wo`` without biases; the heads' width ``n_heads x head_dim`` need not be the model dim,
as in Qwen3) and a gated feed-forward (``w1``, ``w3``, ``w2``), then a final RMSNorm. Parameter
counts follow from those shapes. ``num_windowed_layers`` of the layers attend through a sliding
window of ``window`` tokens (``planner/windows.py``), the others to every earlier token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from ringtrain.config import JobConfig
from ringtrain.errors import ConfigError


@dataclass(frozen=True)
class ModelSpec:
    name: str
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    explicit_head_dim: Optional[int] = None  # model.head_dim when set; else dim / n_heads
    tie_embeddings: bool = False
    qk_norm: bool = False  # Qwen3's RMSNorm of each head's query and key (one head_dim gain each)
    window: Optional[int] = None  # the windowed layers' window, in tokens
    num_windowed_layers: int = 0
    norm_style: str = "llama"  # config's NORM_STYLES: "gemma" norms each branch's output too
    local_rope: bool = False  # the windowed layers rotate by a RoPE of their own (Gemma 3)

    @property
    def num_full_layers(self) -> int:
        return self.n_layers - self.num_windowed_layers

    @property
    def every_layer_windowed(self) -> bool:
        return self.num_windowed_layers == self.n_layers

    @property
    def norms_per_layer(self) -> int:
        return 4 if self.norm_style == "gemma" else 2

    @property
    def head_dim(self) -> int:
        return self.explicit_head_dim or self.dim // self.n_heads

    @property
    def q_dim(self) -> int:
        """The width of the queries and of the attention's output, n_heads x head_dim."""
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    def layer_tensors(self) -> tuple[int, ...]:
        """Element counts of one block's parameters, in the model's order."""
        h, q, kv, f = self.dim, self.q_dim, self.kv_dim, self.ffn_dim
        qk_norms = (self.head_dim, self.head_dim) if self.qk_norm else ()
        out_norms = (h,) * (self.norms_per_layer - 2)
        return (h, h * q, h * kv, h * kv, q * h, *qk_norms, h, h * f, h * f, f * h, *out_norms)

    def tensors(self) -> tuple[int, ...]:
        """Element counts of every parameter tensor: embedding, blocks, final norm, output (none
        of its own when tied to the embedding)."""
        embed = self.vocab_size * self.dim
        output = () if self.tie_embeddings else (embed,)
        return (embed, *self.layer_tensors() * self.n_layers, self.dim, *output)

    @property
    def num_params(self) -> int:
        return sum(self.tensors())

    @property
    def num_matmul_params(self) -> int:
        """Parameters that take part in matrix multiplies: all but the embedding table and norm gains.

        The input embedding is a lookup, not a product, so it costs no FLOPs (Kaplan et al. 2020,
        "Scaling Laws for Neural Language Models", section 2.1, count N without embeddings).
        """
        norms = (self.norms_per_layer * self.n_layers + 1) * self.dim + (2 * self.n_layers * self.head_dim if self.qk_norm else 0)
        # Tied, the one matrix is the output projection's too: it multiplies.
        lookup = 0 if self.tie_embeddings else self.vocab_size * self.dim
        return self.num_params - lookup - norms


# Shapes from Meta's released params.json of each model, also in Dubey et al. 2024,
# "The Llama 3 Herd of Models", Table 3 (layers, model dim, FFN dim, heads, KV heads, vocabulary).
PRESETS: dict[str, ModelSpec] = {
    "llama3-8b": ModelSpec("llama3-8b", 128256, 4096, 32, 32, 8, 14336),
    "llama3-70b": ModelSpec("llama3-70b", 128256, 8192, 80, 64, 8, 28672),
    "llama3-405b": ModelSpec("llama3-405b", 128256, 16384, 126, 128, 8, 53248),
}


def _gemma3(name: str, vocab: int, dim: int, n_layers: int, heads: int, kv_heads: int, head_dim: int, ffn: int, window: int) -> ModelSpec:
    # Every sixth layer global, the others windowed (sliding_window_pattern 6).
    return ModelSpec(name, vocab, dim, n_layers, heads, kv_heads, ffn, explicit_head_dim=head_dim, tie_embeddings=True,
                     qk_norm=True, window=window, num_windowed_layers=n_layers - n_layers // 6, norm_style="gemma",
                     local_rope=True)


# Gemma 3's text models, from the config.json of each released checkpoint (google/gemma-3-*-pt;
# the 4B, 12B and 27B ones' text_config); their embedding and other parameter counts are those of
# Gemma Team 2025, "Gemma 3 Technical Report", Table 1.
PRESETS.update({
    "gemma3-1b": _gemma3("gemma3-1b", 262144, 1152, 26, 4, 1, 256, 6912, 512),
    "gemma3-4b": _gemma3("gemma3-4b", 262208, 2560, 34, 8, 4, 256, 10240, 1024),
    "gemma3-12b": _gemma3("gemma3-12b", 262208, 3840, 48, 16, 8, 256, 15360, 1024),
    "gemma3-27b": _gemma3("gemma3-27b", 262208, 5376, 62, 32, 16, 128, 21504, 1024),
})


def kv_copies(n_kv_heads: int, ulysses: int) -> int:
    """How many times Ulysses replicates each KV head so every rank holds whole KV heads."""
    return ulysses // math.gcd(n_kv_heads, ulysses)


def preset(name: str) -> ModelSpec:
    """The named preset, or a ConfigError naming ``--model`` and the choices."""
    key = name.lower()
    if key not in PRESETS:
        raise ConfigError("--model", f"{name!r} is not one of {', '.join(PRESETS)} (or give a job file)")
    return PRESETS[key]


def from_job(job: JobConfig) -> ModelSpec:
    m = job.model
    windows = [w for w in job.layer_windows if w is not None]
    return ModelSpec(
        job.name,
        m.vocab_size,
        m.dim,
        m.n_layers,
        m.n_heads,
        m.n_kv_heads,
        job.ffn_dim,
        explicit_head_dim=job.head_dim,
        tie_embeddings=bool(m.tie_embeddings),
        qk_norm=bool(m.qk_norm),
        window=windows[0] if windows else None,
        num_windowed_layers=len(windows),
        norm_style=m.norm_style or "llama",
        local_rope=m.rope_local_theta is not None and bool(windows),
    )
