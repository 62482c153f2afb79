"""The Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, Gemma 3) whose attention is a
pluggable context-parallel function.

One class, driven by ``ModelArgs``: the families differ only in switches (q/k/v biases for Qwen2,
per-head q/k RMSNorm for Qwen3, tied embeddings, an explicit head dim, the rope scaling type,
each layer's attention window). Gemma 3 is the same decoder with its own switches: (1 + w)
norms in fp32 on each branch's input and output, GeGLU, embeddings scaled by sqrt(dim), its own
attention scale, and sliding layers that rotate with a RoPE of their own.
Parameter names are ringtrain's own; ``ringtrain.hf.names`` maps them to Hugging Face's.

Each layer's attention is full causal or windowed (``ModelArgs.layer_windows``): a windowed
layer passes ``window=W`` to the attention function, under which query i sees key j iff
i - W < j <= i by true sequence position (transformers' ``sliding_window``). A layer passes the
keywords that differ from the default only, so a model without windows runs on any attention
function of the plain signature.

Shape legend: B batch, S local sequence (this rank's tokens), H query heads, K key/value heads,
D head dim, E model dim, V vocab.

Rotary embeddings are computed from explicit ``position_ids`` rather than from the index in
the local tensor: a context-parallel rank holds non-contiguous pieces of the sequence (zigzag),
and each token must rotate by its true position.
"""

from __future__ import annotations

import contextlib
import functools
import math
from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Optional, Protocol, Union

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from ringtrain.config import JobConfig, checkpointing_mode
from ringtrain.train import fused as ops
from ringtrain.train.attention.documents import Documents
from ringtrain.train.fused import FusedOps
from ringtrain.train.data import IGNORE_INDEX
from ringtrain.train.loss import (
    chunked_cross_entropy_sum,
    chunked_cross_entropy_tokens,
    full_cross_entropy_sum,
    logits_cross_entropy_sum,
)
from ringtrain.train.offload import ActivationOffloader
from ringtrain.train.recompute import recomputed, tiled
from ringtrain.train.rope import Rope, build_rope


class AttentionFn(Protocol):
    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        causal: bool = True,
        doc_ids: Optional[Documents] = None,
        window: Optional[int] = None,
        scale: Optional[float] = None,
    ) -> torch.Tensor: ...


@dataclass(frozen=True)
class ModelArgs:
    """Everything that decides the model's parameters and its forward pass."""

    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    norm_eps: float
    rope_theta: float
    rope_scaling: Optional[Mapping[str, Any]] = None
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    tie_embeddings: bool = False
    # Each layer's attention window (None: full causal); empty: every layer full.
    layer_windows: tuple[Optional[int], ...] = ()
    # The windowed layers' rotary settings when they differ from the full layers' (Gemma 3).
    local_rope_theta: Optional[float] = None
    local_rope_scaling: Optional[Mapping[str, Any]] = None
    norm_style: str = "llama"  # config's NORM_STYLES
    activation: str = "silu"  # config's ACTIVATIONS
    scale_embeddings: bool = False
    query_pre_attn_scalar: Optional[float] = None
    final_logit_softcapping: Optional[float] = None

    def window(self, layer: int) -> Optional[int]:
        return self.layer_windows[layer] if self.layer_windows else None

    @property
    def attention_scale(self) -> Optional[float]:
        """The scores' scale when it is not the kernels' default head_dim ** -0.5."""
        if self.query_pre_attn_scalar is None or self.query_pre_attn_scalar == self.head_dim:
            return None
        return float(self.query_pre_attn_scalar) ** -0.5

    @classmethod
    def from_job(cls, job: JobConfig) -> "ModelArgs":
        m = job.model
        return cls(
            vocab_size=job.model_int("vocab_size"),
            dim=job.model_int("dim"),
            n_layers=job.model_int("n_layers"),
            n_heads=job.model_int("n_heads"),
            n_kv_heads=job.model_int("n_kv_heads"),
            head_dim=job.head_dim,
            ffn_dim=job.ffn_dim,
            norm_eps=float(m.norm_eps if m.norm_eps is not None else 1e-5),
            rope_theta=float(m.rope_theta if m.rope_theta is not None else 10000.0),
            rope_scaling=dict(m.rope_scaling) if m.rope_scaling else None,
            qkv_bias=bool(m.qkv_bias),
            o_bias=bool(m.o_bias),
            mlp_bias=bool(m.mlp_bias),
            qk_norm=bool(m.qk_norm),
            tie_embeddings=bool(m.tie_embeddings),
            layer_windows=job.layer_windows,
            local_rope_theta=float(m.rope_local_theta) if m.rope_local_theta is not None else None,
            local_rope_scaling=dict(m.rope_local_scaling) if m.rope_local_scaling else None,
            norm_style=m.norm_style or "llama",
            activation=m.activation or "silu",
            scale_embeddings=bool(m.scale_embeddings),
            query_pre_attn_scalar=m.query_pre_attn_scalar,
            final_logit_softcapping=m.final_logit_softcapping,
        )


@dataclass(frozen=True)
class MemorySavers:
    """How the forward trades compute and transfers for activation memory (none by default)."""

    checkpointing: str = "none"  # none | full | selective (train/recompute.py)
    recompute_layers: Optional[int] = None  # the first N layers recompute, the rest do not; None: all
    offload_layers: int = 0  # the first N layers' saved activations wait in host memory
    mlp_tiles: int = 1  # SwiGLU over this many sequence tiles, each recomputed
    loss_chunk_tokens: int = 0  # output projection and loss over chunks of this many tokens

    def layer_checkpointing(self, index: int) -> str:
        """The checkpointing mode layer ``index`` runs: the first ``recompute_layers`` recompute."""
        if self.recompute_layers is None or index < self.recompute_layers:
            return self.checkpointing
        return "none"

    @classmethod
    def from_job(cls, job: JobConfig) -> "MemorySavers":
        m = job.model
        return cls(
            checkpointing=checkpointing_mode(m.activation_checkpointing),
            recompute_layers=m.recompute_layers,
            offload_layers=m.activation_offload_layers,
            mlp_tiles=m.mlp_tiles,
            loss_chunk_tokens=job.train.loss_chunk_tokens,
        )


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, fused: FusedOps = FusedOps(), style: str = "llama") -> None:
        super().__init__()
        self.eps = eps
        self.style = style
        # A Gemma gain is stored as w in (1 + w): zero is the identity, as one is Llama's.
        self.weight = nn.Parameter(torch.zeros(dim) if style == "gemma" else torch.ones(dim))
        self.fused = fused

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps, self.fused, self.style)


class Attention(nn.Module):
    def __init__(
        self, args: ModelArgs, attention_fn: AttentionFn, fused: FusedOps = FusedOps(), window: Optional[int] = None
    ) -> None:
        super().__init__()
        self.n_heads = args.n_heads
        self.n_kv_heads = args.n_kv_heads
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=args.qkv_bias)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=args.qkv_bias)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=args.qkv_bias)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=args.o_bias)
        # Qwen3 and Gemma 3 normalise each head's query and key over the head dim, before the rotation.
        self.q_norm = RMSNorm(args.head_dim, args.norm_eps, fused, args.norm_style) if args.qk_norm else None
        self.k_norm = RMSNorm(args.head_dim, args.norm_eps, fused, args.norm_style) if args.qk_norm else None
        self.attention_fn = attention_fn
        self.fused = fused
        self.window = window
        # Only what differs from the attention function's defaults (see the module docstring).
        self.attention_options: dict[str, Any] = {}
        if window is not None:
            self.attention_options["window"] = window
        if args.attention_scale is not None:
            self.attention_options["scale"] = args.attention_scale

    def forward(
        self, x_BSE: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, docs: Optional[Documents] = None
    ) -> torch.Tensor:
        B, S, _ = x_BSE.shape
        q_BSX, k_BSX, v_BSX = ops.projections(x_BSE, (self.wq, self.wk, self.wv), self.fused)
        q_BSHD = q_BSX.unflatten(-1, (self.n_heads, self.head_dim))
        k_BSKD = k_BSX.unflatten(-1, (self.n_kv_heads, self.head_dim))
        v_BSKD = v_BSX.unflatten(-1, (self.n_kv_heads, self.head_dim))
        if self.q_norm is not None and self.k_norm is not None:
            q_BSHD, k_BSKD = self.q_norm(q_BSHD), self.k_norm(k_BSKD)
        q_BSHD, k_BSKD = ops.apply_rotary(q_BSHD, k_BSKD, cos, sin, self.fused)
        out_BSHD = self.attention_fn(q_BSHD, k_BSKD, v_BSKD, causal=True, doc_ids=docs, **self.attention_options)
        return self.wo(out_BSHD.reshape(B, S, -1))


class FeedForward(nn.Module):
    """A gated MLP: ``w2(act(w1 x) * w3 x)``, SwiGLU with silu, GeGLU with gelu_pytorch_tanh."""

    def __init__(
        self, dim: int, hidden: int, bias: bool = False, fused: FusedOps = FusedOps(), activation: str = "silu"
    ) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=bias)
        self.w3 = nn.Linear(dim, hidden, bias=bias)
        self.w2 = nn.Linear(hidden, dim, bias=bias)
        self.fused = fused
        self.gated = ops.GATED_ACTIVATIONS[activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = ops.projections(x, (self.w1, self.w3), self.fused)
        return self.w2(self.gated(gate, up, self.fused))


class Block(nn.Module):
    def __init__(
        self,
        args: ModelArgs,
        attention_fn: AttentionFn,
        savers: MemorySavers = MemorySavers(),
        fused: FusedOps = FusedOps(),
        checkpointing: Optional[str] = None,
        window: Optional[int] = None,
    ):
        """``checkpointing``: this layer's mode (``MemorySavers.layer_checkpointing``); None:
        ``savers.checkpointing``. ``window``: this layer's attention window; None: full causal."""
        super().__init__()
        style = args.norm_style
        self.attention_norm = RMSNorm(args.dim, args.norm_eps, fused, style)
        self.attention = Attention(args, attention_fn, fused, window)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps, fused, style)
        self.feed_forward = FeedForward(args.dim, args.ffn_dim, args.mlp_bias, fused, args.activation)
        # Gemma norms each branch's output before it joins the residual stream too.
        sandwich = style == "gemma"
        self.attention_out_norm = RMSNorm(args.dim, args.norm_eps, fused, style) if sandwich else None
        self.ffn_out_norm = RMSNorm(args.dim, args.norm_eps, fused, style) if sandwich else None
        self.checkpointing = savers.checkpointing if checkpointing is None else checkpointing
        self.selective = self.checkpointing == "selective"
        self.mlp_tiles = savers.mlp_tiles

    def _attention_norm(self, x: torch.Tensor) -> torch.Tensor:
        return recomputed(self.attention_norm, x) if self.selective else self.attention_norm(x)

    def _attention_out(self, out: torch.Tensor) -> torch.Tensor:
        if self.attention_out_norm is None:
            return out
        return recomputed(self.attention_out_norm, out) if self.selective else self.attention_out_norm(out)

    def _ffn(self, x: torch.Tensor) -> torch.Tensor:
        """The gated MLP, and Gemma's norm of its output: position-wise, so it can run in tiles."""
        out = self.feed_forward(x)
        return out if self.ffn_out_norm is None else self.ffn_out_norm(out)

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        """ffn_norm then the MLP; selective recomputes both, tiles recompute the MLP per tile."""
        if self.selective:
            return tiled(lambda y: self._ffn(self.ffn_norm(y)), x, self.mlp_tiles)
        if self.mlp_tiles > 1:
            return tiled(self._ffn, self.ffn_norm(x), self.mlp_tiles)
        return self._ffn(self.ffn_norm(x))

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, docs: Optional[Documents] = None
    ) -> torch.Tensor:
        x = x + self._attention_out(self.attention(self._attention_norm(x), cos, sin, docs))
        return x + self._mlp(x)


# Tokens per chunk of a weighted loss where the fused kernel would otherwise run (it takes no
# per-token weights): the chunked loss's memory stays bounded as the fused one's does.
WEIGHTED_CHUNK_TOKENS = 4096


class OutputHead(nn.Linear):
    """The output projection; given labels, it returns the summed loss instead of the logits, so
    the fused and chunked losses read the weight inside this module's call (where ZeRO-3
    gathers it). The loss is liger's fused one where it runs (train/fused.py), else chunked when
    ``loss_chunk_tokens`` is set, else over the whole logits. ``softcap`` caps the logits to
    ``softcap * tanh(logits / softcap)`` (config refuses it with the chunked loss)."""

    def __init__(
        self,
        dim: int,
        vocab_size: int,
        loss_chunk_tokens: int = 0,
        fused: FusedOps = FusedOps(),
        softcap: Optional[float] = None,
    ) -> None:
        super().__init__(dim, vocab_size, bias=False)
        self.loss_chunk_tokens = loss_chunk_tokens
        self.fused = fused
        self.softcap = softcap

    def _capped(self, logits: torch.Tensor) -> torch.Tensor:
        if self.softcap is None:
            return logits
        return torch.tanh(logits / self.softcap) * self.softcap

    def forward(
        self, x: torch.Tensor, labels: Optional[torch.Tensor] = None, weights: Optional[torch.Tensor] = None,
        per_token: bool = False,
    ) -> torch.Tensor:
        if labels is None:
            return self._capped(super().forward(x))
        x_TE, labels_T = x.flatten(0, -2), labels.flatten()
        if per_token:
            return self._token_losses(x_TE, labels_T)
        weights_T = None if weights is None else weights.flatten()
        if weights_T is None:
            fused_loss = ops.cross_entropy_sum(x_TE, self.weight, labels_T, self.fused, self.softcap)
            if fused_loss is not None:
                return fused_loss
        if self.softcap is not None:
            logits_TV = self._capped(F.linear(x_TE, self.weight))
            return logits_cross_entropy_sum(logits_TV, labels_T, weights_T)
        # Weighted, where the fused kernel would have run: chunked (it takes no per-token weights),
        # so the whole logits still never exist.
        fused_here = weights_T is not None and ops.kernels_run(self.fused, x.device.type)
        chunk = self.loss_chunk_tokens or (WEIGHTED_CHUNK_TOKENS if fused_here else 0)
        if chunk > 0:
            return chunked_cross_entropy_sum(x_TE, self.weight, labels_T, chunk, weights_T)
        return full_cross_entropy_sum(x_TE, self.weight, labels_T, weights_T)

    def _token_losses(self, x_TE: torch.Tensor, labels_T: torch.Tensor) -> torch.Tensor:
        """Each token's fp32 loss [T] (0 where unlabelled): chunked where the loss is (or where
        the fused kernel would run: it keeps no token's loss apart), else over the whole logits."""
        if self.softcap is not None:
            logits_TV = self._capped(F.linear(x_TE, self.weight)).float()
            return F.cross_entropy(logits_TV, labels_T, ignore_index=IGNORE_INDEX, reduction="none")
        chunk = self.loss_chunk_tokens or (WEIGHTED_CHUNK_TOKENS if ops.kernels_run(self.fused, x_TE.device.type) else 0)
        if chunk > 0:
            return chunked_cross_entropy_tokens(x_TE, self.weight, labels_T, chunk)
        return F.cross_entropy(F.linear(x_TE, self.weight).float(), labels_T, ignore_index=IGNORE_INDEX, reduction="none")


class Transformer(nn.Module):
    def __init__(
        self,
        args: ModelArgs,
        *,
        attention_fn: AttentionFn,
        init_std: Optional[float] = 0.02,
        activation_checkpointing: "bool | str" = False,
        savers: Optional[MemorySavers] = None,
        fused: FusedOps = FusedOps(),
    ) -> None:
        """``init_std=None`` skips the random initialisation: the weights are loaded next.
        ``activation_checkpointing`` (a mode, or the older bool) is ignored when ``savers`` is given.
        ``fused``: the fused ops to run (train/fused.py); the default is the eager reference."""
        super().__init__()
        self.args = args
        self.fused = fused
        self.rope: Rope = build_rope(args.head_dim, args.rope_theta, args.rope_scaling)
        # The windowed layers' own RoPE (Gemma 3's local base); None: they rotate as the others.
        self.local_rope: Optional[Rope] = None
        if args.local_rope_theta is not None:
            self.local_rope = build_rope(args.head_dim, args.local_rope_theta, args.local_rope_scaling)
        self.savers = savers or MemorySavers(checkpointing=checkpointing_mode(activation_checkpointing))
        # Built on the first forward, on the device the activations are on.
        self.offloader: Optional[ActivationOffloader] = None
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(
            Block(args, attention_fn, self.savers, fused, self.savers.layer_checkpointing(i), args.window(i))
            for i in range(args.n_layers)
        )
        self.norm = RMSNorm(args.dim, args.norm_eps, fused, args.norm_style)
        self.output = OutputHead(
            args.dim, args.vocab_size, self.savers.loss_chunk_tokens, fused, args.final_logit_softcapping
        )
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        if init_std is not None:
            self._init_weights(init_std, args.n_layers)

    def _init_weights(self, std: float, n_layers: int) -> None:
        for name, p in self.named_parameters():
            if len(full_shape(p)) < 2:
                if name.endswith(".bias"):
                    nn.init.zeros_(p)
                continue  # norm gains stay as built, the identity
            # Residual-branch outputs are scaled down with depth so the residual stream's
            # variance does not grow with the number of layers (GPT-2, section 2.3).
            is_residual_out = name.endswith(("wo.weight", "w2.weight"))
            nn.init.normal_(p, mean=0.0, std=std / (2 * n_layers) ** 0.5 if is_residual_out else std)

    def hidden(
        self,
        input_ids_BS: torch.Tensor,
        position_ids_BS: torch.Tensor,
        doc_ids_BS: Optional[Union[torch.Tensor, Documents]] = None,
    ) -> torch.Tensor:
        """The final normed hidden states [B, S, E], before the output projection; ``doc_ids_BS``
        (packed documents) confines attention to each token's document."""
        full_rotation = self.rope.cos_sin(position_ids_BS)
        window_rotation = full_rotation if self.local_rope is None else self.local_rope.cos_sin(position_ids_BS)
        # Once per forward: the ids' host copy and their gathers across the CP groups serve
        # every layer (and the recomputation of any).
        docs = Documents.of(doc_ids_BS)
        h_BSE = self.embed(input_ids_BS)
        for i, layer in enumerate(self.layers):
            cos, sin = full_rotation if layer.attention.window is None else window_rotation
            with self._offload(i, h_BSE.device):
                if layer.checkpointing == "full" and self.training:
                    h_BSE = checkpoint(layer, h_BSE, cos, sin, docs, use_reentrant=False)
                else:
                    h_BSE = layer(h_BSE, cos, sin, docs)
        return self.norm(h_BSE)

    def embed(self, input_ids_BS: torch.Tensor) -> torch.Tensor:
        """The token embeddings, times sqrt(dim) for Gemma: the factor rounded to the embedding's
        dtype first (55.4256 is 55.5 in bf16 at dim 3072), as transformers computes it."""
        h_BSE = self.tok_embeddings(input_ids_BS)
        if not self.args.scale_embeddings:
            return h_BSE
        return h_BSE * _embedding_scale(self.args.dim, h_BSE.dtype)

    def _offload(self, index: int, device: torch.device) -> contextlib.AbstractContextManager[None]:
        if index >= self.savers.offload_layers or not self.training:
            return contextlib.nullcontext()
        if self.offloader is None or self.offloader.device != device:
            self.offloader = ActivationOffloader(self.savers.offload_layers, device)
        return self.offloader.layer(index)

    def forward(
        self,
        input_ids_BS: torch.Tensor,
        position_ids_BS: torch.Tensor,
        labels_BS: Optional[torch.Tensor] = None,
        *,
        doc_ids_BS: Optional[Union[torch.Tensor, Documents]] = None,
        weights_BS: Optional[torch.Tensor] = None,
        per_token: bool = False,
    ) -> torch.Tensor:
        """The logits [B, S, V]; with labels, the fp32 sum of the loss over labelled tokens
        (chunked when ``savers.loss_chunk_tokens`` is set), never the whole logits; with
        ``weights_BS`` too, each token's loss weighted (train/loss.py); with ``per_token``, each
        token's loss apart ([B S], 0 where unlabelled), for an objective of per-sequence sums."""
        if labels_BS is None:
            return self.output(self.hidden(input_ids_BS, position_ids_BS, doc_ids_BS))
        if per_token:
            return self.output(self.hidden(input_ids_BS, position_ids_BS, doc_ids_BS), labels_BS, per_token=True)
        if weights_BS is None:
            return self.output(self.hidden(input_ids_BS, position_ids_BS, doc_ids_BS), labels_BS)
        return self.output(self.hidden(input_ids_BS, position_ids_BS, doc_ids_BS), labels_BS, weights_BS)


@contextlib.contextmanager
def skip_parameter_init() -> Iterator[None]:
    """Build modules without drawing their initial weights (``torch.nn.init``'s in-place fills
    become no-ops): for a model whose weights are loaded next. Besides the time, this keeps a
    tensor's pages untouched until something writes them, so a full tensor that ZeRO-3's
    ``zero.Init`` partitions right away never becomes resident on the host."""
    saved = {name: getattr(nn.init, name) for name in _INIT_FUNCTIONS}
    for name in _INIT_FUNCTIONS:
        setattr(nn.init, name, _keep)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(nn.init, name, fn)


# The fills torch's layers draw their default weights with (Linear, Embedding reset_parameters).
_INIT_FUNCTIONS = ("uniform_", "normal_", "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_", "xavier_normal_", "trunc_normal_", "zeros_", "ones_")


def _keep(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    return tensor


@functools.lru_cache(maxsize=None)
def _embedding_scale(dim: int, dtype: torch.dtype) -> float:
    return float(torch.tensor(dim**0.5, dtype=torch.float32).to(dtype))


def full_shape(p: torch.Tensor) -> torch.Size:
    """A parameter's whole shape. Under ZeRO-3 a parameter made inside DeepSpeed's ``zero.Init``
    (a pretrained model's) is an empty placeholder of shape (0,) on every rank, its partition
    elsewhere, and ``ds_shape`` holds the shape it stands for: every rule that reads a
    parameter's shape, size or rank reads this, never ``p.shape``."""
    return getattr(p, "ds_shape", p.shape)


def num_params(model: nn.Module) -> int:
    """Parameter count, whole parameters (see ``full_shape``)."""
    return sum(math.prod(full_shape(p)) for p in model.parameters())
