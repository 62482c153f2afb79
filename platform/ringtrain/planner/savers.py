"""What each long-context memory saver does to a layout's activations, host memory and step time.

Notation as in planner/memory.py: t tokens on a rank, p bytes per activation element, h model
dim, k KV heads x d = kd, f FFN dim, a heads, V vocabulary, L layers; K MLP tiles, c loss chunk.
The savers (train/recompute.py, train/offload.py, train/loss.py):

- selective recomputation keeps, per layer, the attention's q, k, v, output and log-sum-exp,
  the attention norm's input and output and the MLP's input:
      t [ p (2h + 2kd) + 4a + 3 p h ]  (+ the Ulysses term)
  instead of ``layer_activation_bytes``; its backward recomputes one layer's norm and MLP, of
  t/K tokens at a time.
- tiled MLP: the SwiGLU keeps only its tile inputs (the norm output, kept anyway), so the
  4 p f t of w1, w3, silu and product leave the kept bytes; one tile's are live in the backward,
  and the SwiGLU backward's t p (h + 2f) working set shrinks to a tile's.
- chunked loss: at most c rows of logits exist: c V (p + 12) instead of 12 t V, plus
  one fp32 log-sum-exp per token and the fp32 weight-gradient accumulator 4 V h; nothing of
  t x V stays referenced through the backward.
- activation offload of N layers: their kept bytes go to pinned host memory; the device keeps
  L - N layers' worth at the end of the forward and at most max(L - N, min(N, 2)) layers' in
  the backward (a layer and the one prefetched ahead of it). Host memory per GPU is N layers'
  worth. The copies ride PCIe (each way once per micro batch) and overlap a layer's compute;
  what a layer's compute cannot hide is exposed.
"""

from __future__ import annotations

from dataclasses import dataclass

from ringtrain.planner.layout import Layout
from ringtrain.planner.models import ModelSpec, kv_copies
from ringtrain.planner.preference import FUSED_FALLBACK_CHUNK, TOKEN_LOSS_BYTES

# The chunk the search gives the chunked loss when it turns it on: 1,024 tokens of a 128K
# vocabulary are 1.8 GB in bf16 with the fp32 loss terms, a fixed cost whatever the context.
DEFAULT_LOSS_CHUNK = 1024


def ulysses_extra(model: ModelSpec, tokens: int, ulysses: int, act_bytes: int, kv_copies: int) -> int:
    """Ulysses keeps q, k, v head-sharded after the all-to-all and the output on both sides."""
    if ulysses <= 1:
        return 0
    return tokens * act_bytes * (model.q_dim + 2 * model.kv_dim * (kv_copies - 1))


def mlp_kept(model: ModelSpec, tokens: int, act_bytes: int, fused: bool = False) -> int:
    """The f-wide tensors the SwiGLU keeps untiled: w1, w3, silu and product outputs; the fused
    kernel keeps its two inputs and recomputes the SiLU, so w1, w3 and product outputs."""
    return tokens * (3 if fused else 4) * act_bytes * model.ffn_dim


def norm_bytes_per_element(model: ModelSpec, act_bytes: int) -> int:
    """What an RMSNorm in torch ops keeps per element, with the next op's copy of its output: its
    fp32 input, and its normalized and scaled outputs, 4 + 2p; Gemma's scales in fp32, so the
    normalized output it keeps is fp32 too, 8 + p."""
    return 8 + act_bytes if model.norm_style == "gemma" else 4 + 2 * act_bytes


def norm_kept(model: ModelSpec, tokens: int, act_bytes: int, fused: bool = False) -> int:
    """What one RMSNorm of the model dim keeps (``norm_bytes_per_element`` per element in torch
    ops); the fused kernel its input and one fp32 rstd per row, and the output, 2 p h + 4."""
    h, p = model.dim, act_bytes
    return tokens * (2 * p * h + 4 if fused else norm_bytes_per_element(model, p) * h)


def qk_norm_kept(model: ModelSpec, tokens: int, act_bytes: int, fused: bool = False) -> int:
    """What the per-head q and k norms (Qwen3, Gemma 3) keep: their inputs and one fp32 rstd per
    head and token in the fused kernel; in torch ops ``norm_bytes_per_element`` per element."""
    if not model.qk_norm:
        return 0
    width, p = model.q_dim + model.kv_dim, act_bytes
    return tokens * (p * width + 4 * (model.n_heads + model.n_kv_heads) if fused else norm_bytes_per_element(model, p) * width)


def ffn_norms_kept(model: ModelSpec, tokens: int, act_bytes: int, fused: bool = False) -> int:
    """The FFN half's norms: the one before the MLP, and Gemma's of its output."""
    return (model.norms_per_layer // 2) * norm_kept(model, tokens, act_bytes, fused)


def selective_layer_bytes(model: ModelSpec, tokens: int, act_bytes: int, fused: bool = False) -> int:
    """What a layer keeps under selective recomputation, before the Ulysses term: the attention's
    (q/k norms included), which it does not recompute, and the norms' inputs and output (with
    Gemma's norm of the attention's output, its input too)."""
    h, q, kd, a, p = model.dim, model.q_dim, model.kv_dim, model.n_heads, act_bytes
    norm_inputs = 3 + (1 if model.norm_style == "gemma" else 0)
    return tokens * (p * (2 * q + 2 * kd) + 4 * a + norm_inputs * p * h) + qk_norm_kept(model, tokens, p, fused)


@dataclass(frozen=True)
class LayerBytes:
    """A layer's activations under a layout's savers."""

    kept: int  # kept for the backward, per layer
    recomputed: int  # live while one layer's recomputed part runs its backward
    ffn_kept: int  # of ``kept``: the FFN half, freed before the attention's backward
    ffn_work: int  # the SwiGLU backward's working set beyond what it keeps


def layer_bytes(
    model: ModelSpec, layout: Layout, tokens: int, act_bytes: int, plain: int, plain_ffn: int, fused: bool = False
) -> LayerBytes:
    """``plain``: ``layer_activation_bytes`` (no saver); ``plain_ffn``: its FFN half."""
    p, h, f, K = act_bytes, model.dim, model.ffn_dim, layout.mlp_tiles
    mlp = mlp_kept(model, tokens, p, fused)
    tile_mlp = mlp // K
    ffn_work = tokens * p * (h + 2 * f) // K
    norm_ffn = ffn_norms_kept(model, tokens, p, fused)  # the FFN norms' kept bytes
    if layout.checkpointing:
        # The recomputed layer keeps everything but the untiled MLP, which lives a tile at a time.
        recomputed = plain - mlp + tile_mlp if K > 1 else plain
        return LayerBytes(tokens * p * h, recomputed, plain_ffn - mlp + tile_mlp, ffn_work)
    if layout.selective:
        # Ulysses' head-sharded q, k, v and output are kept whole: selective recomputes neither.
        u = layout.ulysses
        kept = selective_layer_bytes(model, tokens, p, fused) + ulysses_extra(model, tokens, u, p, kv_copies(model.n_kv_heads, u))
        return LayerBytes(kept, (norm_ffn + mlp) // K, tokens * p * h, ffn_work)
    if K > 1:
        return LayerBytes(plain - mlp, tile_mlp, plain_ffn - mlp, ffn_work)
    return LayerBytes(plain, 0, plain_ffn, ffn_work)


def fused_loss_rows(tokens: int, vocab_size: int, dim: int) -> int:
    """The rows of logits liger-kernel's fused linear cross-entropy makes at a time: the tokens
    over ceil(V / h), rounded up to a power of two (so a chunk's logits weigh about what the
    hidden states do)."""
    rows = -(-tokens // -(-vocab_size // dim))
    return 1 << max(0, (rows - 1).bit_length())


def loss_bytes(
    model: ModelSpec, layout: Layout, tokens: int, act_bytes: int, fused: bool = False, per_token: bool = False
) -> tuple[int, int]:
    """(the loss's peak at the start of the backward, the logits kept through the backward).

    The model's output head computes the loss itself, so nothing holds the logits once its
    forward is done: the log-softmax keeps only its fp32 output, and its backward holds that, the
    incoming gradient and the outgoing one, 12 bytes per logit; none are kept through the
    layers' backward. ``per_token``: a preference objective's loss, each token's apart
    (planner/preference.py): ``TOKEN_LOSS_BYTES`` more per token, and chunked where the fused
    kernel would run."""
    V = model.vocab_size
    token_losses = TOKEN_LOSS_BYTES * tokens if per_token else 0
    chunk = layout.loss_chunk
    if fused and per_token and chunk <= 0:
        chunk = FUSED_FALLBACK_CHUNK
    elif fused and not per_token:
        # The fused loss makes each chunk's logits (fp32, with their gradient in the input dtype)
        # and turns them into the hidden states' gradient and the fp32 weight gradient during the
        # forward; those two are what it keeps.
        rows = min(fused_loss_rows(tokens, V, model.dim), tokens)
        return rows * V * (8 + act_bytes) + tokens * act_bytes * model.dim + 4 * V * model.dim, 0
    if chunk <= 0:
        return tokens * V * 12 + token_losses, 0
    rows = min(chunk, tokens)
    return rows * V * (act_bytes + 12) + 4 * tokens + 4 * V * model.dim + token_losses, 0


def resident_layers(model: ModelSpec, layout: Layout) -> tuple[int, int]:
    """Layers' worth of kept bytes on the device (end of forward, worst point of the backward)."""
    L, N = model.n_layers, min(layout.offload_layers, model.n_layers)
    return L - N, max(L - N, min(N, 2))


def extra_flops_per_token(model: ModelSpec, layout: Layout) -> float:
    """FLOPs per token the savers add: each recomputed MLP forward is 6 h f per layer
    (three matmuls), a recomputed chunk of logits 2 h V."""
    mlp_forward = 2.0 * 3 * model.dim * model.ffn_dim
    extra = 0.0
    if layout.selective:
        # tiles or not: selective recomputes the MLP once, tile by tile, in each recomputing layer
        extra += mlp_forward * layout.recomputed_layers(model.n_layers)
    elif layout.mlp_tiles > 1:
        extra += mlp_forward * model.n_layers  # under full checkpointing the tiles recompute inside the recompute
    if layout.loss_chunk > 0:
        extra += 2.0 * model.dim * model.vocab_size
    return extra


def offload_exposed_s(kept_layer: int, layout: Layout, layer_forward_s: float, pcie_bytes_per_s: float) -> float:
    """Seconds per micro batch the offload's copies are not hidden: each layer's copy out overlaps
    its forward, its copy back the backward (twice the forward) of the layer after it."""
    if layout.offload_layers == 0:
        return 0.0
    copy = kept_layer / pcie_bytes_per_s
    return layout.offload_layers * (max(0.0, copy - layer_forward_s) + max(0.0, copy - 2 * layer_forward_s))


def mlp_tiles_for(model: ModelSpec, local_seq: int) -> int:
    """Tiles for a local sequence: about one tile per ``dim`` tokens (ALST's rule, so a tile's
    f-wide intermediates weigh about what the f x h weights do), a power of two dividing it."""
    want = max(1, -(-local_seq // model.dim))
    tiles = 1
    while tiles < want and local_seq % (2 * tiles) == 0:
        tiles *= 2
    return tiles
