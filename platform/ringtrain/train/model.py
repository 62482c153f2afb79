"""A Llama-style decoder whose attention is a pluggable context-parallel function.

Shape legend: B batch, S local sequence (this rank's tokens), H query heads, K key/value heads,
D head dim, E model dim, V vocab.

Rotary embeddings are computed from explicit ``position_ids`` rather than from the index in
the local tensor: a context-parallel rank holds non-contiguous pieces of the sequence (zigzag),
and each token must rotate by its true position.
"""

from __future__ import annotations

from typing import Optional, Protocol

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


class AttentionFn(Protocol):
    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        causal: bool = True,
        doc_ids: Optional[torch.Tensor] = None,
    ) -> torch.Tensor: ...


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_fp32 = x.float()
        normed = x_fp32 * torch.rsqrt(x_fp32.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def rotary_cos_sin(position_ids_BS: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of shape [B, S, 1, D/2], in fp32 so long positions keep their precision."""
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, device=position_ids_BS.device, dtype=torch.float32) / head_dim)
    angles = position_ids_BS.float()[..., None] * inv_freq
    return angles.cos()[:, :, None, :], angles.sin()[:, :, None, :]


def apply_rotary(x_BSHD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # The half-split convention (rotate the first half against the second), as in Llama's HF port.
    x1, x2 = x_BSHD.float().chunk(2, dim=-1)
    rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return rotated.type_as(x_BSHD)


class Attention(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, attention_fn: AttentionFn) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.n_kv_heads = n_kv_heads
        self.head_dim = dim // n_heads
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)
        self.attention_fn = attention_fn

    def forward(self, x_BSE: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, S, _ = x_BSE.shape
        q_BSHD = self.wq(x_BSE).view(B, S, self.n_heads, self.head_dim)
        k_BSKD = self.wk(x_BSE).view(B, S, self.n_kv_heads, self.head_dim)
        v_BSKD = self.wv(x_BSE).view(B, S, self.n_kv_heads, self.head_dim)
        q_BSHD, k_BSKD = apply_rotary(q_BSHD, cos, sin), apply_rotary(k_BSKD, cos, sin)
        out_BSHD = self.attention_fn(q_BSHD, k_BSKD, v_BSKD, causal=True)
        return self.wo(out_BSHD.reshape(B, S, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, ffn_dim: int, eps: float, attention_fn: AttentionFn):
        super().__init__()
        self.attention_norm = RMSNorm(dim, eps)
        self.attention = Attention(dim, n_heads, n_kv_heads, attention_fn)
        self.ffn_norm = RMSNorm(dim, eps)
        self.feed_forward = FeedForward(dim, ffn_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    def __init__(
        self,
        *,
        vocab_size: int,
        dim: int,
        n_layers: int,
        n_heads: int,
        n_kv_heads: int,
        ffn_dim: int,
        rope_theta: float,
        norm_eps: float,
        init_std: float,
        attention_fn: AttentionFn,
        activation_checkpointing: bool = False,
    ) -> None:
        super().__init__()
        self.head_dim = dim // n_heads
        self.rope_theta = rope_theta
        self.activation_checkpointing = activation_checkpointing
        self.tok_embeddings = nn.Embedding(vocab_size, dim)
        self.layers = nn.ModuleList(
            Block(dim, n_heads, n_kv_heads, ffn_dim, norm_eps, attention_fn) for _ in range(n_layers)
        )
        self.norm = RMSNorm(dim, norm_eps)
        self.output = nn.Linear(dim, vocab_size, bias=False)
        self._init_weights(init_std, n_layers)

    def _init_weights(self, std: float, n_layers: int) -> None:
        for name, p in self.named_parameters():
            if p.dim() < 2:
                continue  # norm weights stay at one
            # Residual-branch outputs are scaled down with depth so the residual stream's
            # variance does not grow with the number of layers (GPT-2, section 2.3).
            is_residual_out = name.endswith(("wo.weight", "w2.weight"))
            nn.init.normal_(p, mean=0.0, std=std / (2 * n_layers) ** 0.5 if is_residual_out else std)

    def forward(self, input_ids_BS: torch.Tensor, position_ids_BS: torch.Tensor) -> torch.Tensor:
        cos, sin = rotary_cos_sin(position_ids_BS, self.head_dim, self.rope_theta)
        h_BSE = self.tok_embeddings(input_ids_BS)
        for layer in self.layers:
            if self.activation_checkpointing and self.training:
                h_BSE = checkpoint(layer, h_BSE, cos, sin, use_reentrant=False)
            else:
                h_BSE = layer(h_BSE, cos, sin)
        return self.output(self.norm(h_BSE))


def num_params(model: nn.Module) -> int:
    """Parameter count; under ZeRO-3 a parameter's local tensor is empty and ``ds_numel`` holds it."""
    return sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
