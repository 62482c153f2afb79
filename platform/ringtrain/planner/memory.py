"""Per-GPU memory of one training layout: model states by ZeRO stage, ZeRO buffers, activations.

Notation: N parameters; Z = dp x cp ranks in the ZeRO group (ringtrain reduces gradients over
all dp x cp ranks); P, G bytes per parameter / gradient element; K optimizer bytes per
parameter; t = micro_batch x seq_len / cp tokens on one rank; b micro batch; s = seq_len / cp;
h model dim, a heads, k KV heads, d = h / a, f FFN dim, V vocabulary, L layers; p bytes per
activation element (2 bf16, 4 fp32); U the Ulysses degree.

Model states (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion
Parameter Models", section 5.1 and Figure 1):

    stage 0: (P + G + K) N          stage 2: P N + (G + K) N / Z
    stage 1: (P + G) N + K N / Z    stage 3: (P + G + K) N / Z

ZeRO offload (Ren et al. 2021, "ZeRO-Offload: Democratizing Billion-Scale Model Training",
section 4.1; Rajbhandari et al. 2021, "ZeRO-Infinity: Breaking the GPU Memory Wall for Extreme
Scale Deep Learning", section 5). Optimizer offload moves K N / Z (fp32 master, momentum,
variance) and DeepSpeed's fp32 gradient partition, 4 N / Z, to host memory; at stages 2 and 3
the reduced gradients go straight there as each bucket is reduced (ZeRO-Offload's gradient
offload; DeepSpeed's stage-3 ``grad_partitions_flat_buffer`` lives on the offload device), so
the GPU keeps no gradient partition, only the reduce bucket; at stage 1 the gradients stay on
the GPU until the step's reduction. Parameter offload (stage 3) moves the P N / Z parameter
partition to host memory; the gathered working set of the layers in flight (the ZeRO-3 buffer
below: the persistent small tensors, the largest module plus the prefetch) stays on the GPU.

ZeRO buffers, at the job's sizes (its ``zero`` section, which the engine writes into DeepSpeed's
config; the defaults are DeepSpeed 0.19's): stages 1-3 stage gradients in a contiguous reduce
bucket (``reduce_bucket_size``, 5e8 elements) of G bytes; stage 3 also keeps every tensor of at
most ``stage3_param_persistence_threshold`` (1e5) elements whole on every rank and gathers the
others a module at a time, the largest one plus a prefetch of ``stage3_prefetch_bucket_size``
(5e7) elements, at most ``stage3_max_live_parameters`` (1e9) live. At the end of the backward,
after the activations are freed, up to a bucket of gradient elements (stage 0's all-reduce
bucket, 5e8, or the reduce bucket) are flattened for reduction: that transient competes with the
activations for the peak rather than adding to it.

Activations, counted as in Korthikanti et al. 2022, "Reducing Activation Recomputation in
Large Transformer Models", section 4.1 (every tensor autograd keeps for the backward), adapted
to ringtrain's Llama block: no dropout; RMSNorm in torch ops keeps its fp32 input and its
normalized and scaled outputs; RoPE keeps only cos/sin; GQA makes k and v k*d wide; SwiGLU keeps
the w1, w3, silu and product outputs; the attention keeps q, k, v, its output and an fp32
log-sum-exp, never the a*s^2 softmax:

    per layer  t [ (8 + 4p) h + p (2h + 2kd) + 4a + 4pf ]
    Ulysses    + t p (h + 2kd (c - 1))   when U > 1: q, k, v are kept head-sharded after the
               all-to-all, each KV head replicated c = U / gcd(k, U) times so every rank holds
               whole KV heads, and the output is kept on both sides of the inverse all-to-all
    once       final norm t (4 + 2p) h, rotary tables 4 t d (per RoPE), and at the start of the backward
               the loss: 12 t V for the logits' fp32 log-softmax, its gradient and the logits'
               fp32 gradient (the output head computes the loss, so the logits themselves are
               freed at the end of the forward)

For comparison, Korthikanti's GPT layer keeps s b h (34 + 5 a s / h) bytes with 16-bit
activations; the 5 a s / h term is the softmax an unfused attention keeps. ringtrain's unfused
kernel (``math``) recomputes the scores in its backward instead, so without flash attention the
scores are a transient of one block while one layer runs its backward: five fp32 matrices of
b (a/U) (U s)^2 elements, 20 b a U s^2 bytes.

Activation checkpointing (``model.activation_checkpointing``: every layer) keeps each layer's
input, t p h, and recomputes one layer at a time during the backward.

The activation peak is the larger of
    loss:           kept layers + final norm + rotary + loss
    layer backward: kept layers + (with checkpointing) one recomputed layer + the last layer's backward
                    working set: its SwiGLU backward's t p (h + 2f) (incoming gradient, two
                    f-wide gradients), or its attention backward's t [(4 + 2p) h + (16 + 6p) k d c]
                    (fp32 dq and dK/dV accumulators, K/V in flight, block gradients; plus the
                    scores when unfused) less the FFN half t [(4 + 2p) h + 4pf] freed by then
and the peak per GPU is model states + ZeRO buffers + max(activation peak, reduction transient).
Gradients count as resident at the peak, as they are from the second micro batch of gradient
accumulation on; a step of a single micro batch peaks up to the gradient bytes lower.

The long-context savers (selective recomputation, tiled MLP, chunked loss, activation offload)
change the kept layers, the recomputed layer, the SwiGLU working set and the loss terms above as
planner/savers.py says; offloaded layers' kept bytes count as host memory.

A preference objective (``planner/preference.py``) keeps each token's loss apart, 8 bytes a
token with its gradient, and never runs the fused loss (chunked in its place); DPO and IPO take a
reference pass before step 1, forward only under ``torch.no_grad``, whose peak
(``reference_activations``) is one layer's or the loss's forward working set over the same model
states: the larger of it and the step's is the peak (the step's, in every layout seen).

Windowed layers (``planner/windows.py``). The fused kernels keep the same q, k, v, output and
log-sum-exp whatever the window, so a windowed layer keeps what a full one does, except where
its K/V go straight to the ranks that read them: it keeps the s blocks it received,
s x 2 t k d c p, for its backward, whose working set holds the fp32 dK/dV of its own block, of
the s it read and of the r readers' returning ones, (1 + s + r) 8 t k d c, in place of the
ring's accumulators. The unfused kernel computes a windowed block tile by tile, on a grid of
about the window: when every layer is windowed its largest block is a tile, not s^2. Gemma's
block has four norms per layer (two in each half), each keeping its fp32 normalized output
too, (8 + p) h per token.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from ringtrain.config import ZeroConfig
from ringtrain.planner.layout import Layout, Precision, Workload
from ringtrain.planner.models import ModelSpec, kv_copies
from ringtrain.planner.preference import FUSED_FALLBACK_CHUNK, TOKEN_LOSS_BYTES, keeps_token_losses, needs_reference
from ringtrain.planner.savers import (
    ffn_norms_kept,
    layer_bytes,
    loss_bytes,
    mlp_kept,
    norm_bytes_per_element,
    norm_kept,
    qk_norm_kept,
    resident_layers,
    ulysses_extra,
)
from ringtrain.planner.windows import score_side, window_ranks

# DeepSpeed keeps the gradient partition of an offloaded optimizer in fp32 on the host.
OFFLOAD_GRAD_BYTES = 4

# Stage 0 all-reduces gradients in buckets of this many elements. No config key sets it: it is
# DeepSpeed's engine constant ``MEMORY_OPT_ALLREDUCE_SIZE``, which tests/unit/test_zero_sizes.py
# holds this to.
ALLREDUCE_BUCKET = 500_000_000

# Bytes per element of the unfused kernel's block working set: it computes in fp32 and its
# backward holds the scores, probabilities, their gradient, (dP - delta) and dS at once.
SCORE_MATRICES_BYTES = 5 * 4


@dataclass(frozen=True)
class ModelStates:
    params: int
    grads: int
    optimizer: int
    host: int  # offloaded to CPU memory, not on the GPU

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer


def model_states(
    num_params: int,
    zero_stage: int,
    zero_degree: int,
    prec: Precision,
    *,
    offload_optimizer: bool = False,
    offload_params: bool = False,
) -> ModelStates:
    """Per-GPU parameter, gradient and optimizer bytes at ``zero_stage`` over ``zero_degree`` ranks."""
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0-3, got {zero_stage}")
    n, z = num_params, zero_degree
    part = -(-n // z)  # DeepSpeed pads the flat buffer to equal partitions
    params = prec.param_bytes * (part if zero_stage == 3 else n)
    grads = prec.grad_bytes * (part if zero_stage >= 2 else n)
    optimizer = prec.optimizer_bytes * (n if zero_stage == 0 else part)
    host = 0
    if offload_optimizer:
        host += optimizer + OFFLOAD_GRAD_BYTES * part
        optimizer = 0
        if zero_stage >= 2:
            grads = 0  # reduced bucket by bucket into the host partition (module doc)
    if offload_params and zero_stage == 3:
        host += params
        params = 0
    return ModelStates(params, grads, optimizer, host)


@dataclass(frozen=True)
class ZeroBuffers:
    reduce_bucket: int  # gradient staging of stages 1-3
    stage3_params: int  # stage 3: persistent small tensors and the gathered working set
    reduce_transient: int  # gradients flattened at the end of the backward

    @property
    def resident(self) -> int:
        return self.reduce_bucket + self.stage3_params


def zero_buffers(
    model: Optional[ModelSpec], num_params: int, zero_stage: int, prec: Precision, sizes: ZeroConfig
) -> ZeroBuffers:
    """DeepSpeed's buffers at ``zero_stage`` and a job's ``sizes`` (its zero section); without a
    model (only a count) no tensor is persistent."""
    bucket = sizes.reduce_bucket_size * prec.grad_bytes if zero_stage >= 1 else 0
    if zero_stage == 0:
        transient = min(num_params, ALLREDUCE_BUCKET) * prec.grad_bytes
    elif zero_stage in (1, 2):
        # Gradients wait in param.grad until their bucket is reduced: at most one bucket's worth.
        transient = min(num_params, sizes.reduce_bucket_size) * prec.grad_bytes
    else:
        transient = 0
    stage3 = 0
    if zero_stage == 3:
        tensors = model.tensors() if model is not None else ()
        threshold = sizes.stage3_param_persistence_threshold
        persistent = sum(n for n in tensors if n <= threshold)
        partitioned = [n for n in tensors if n > threshold]
        if model is None:
            partitioned_total, largest = num_params, 0
        else:
            partitioned_total, largest = sum(partitioned), max(partitioned, default=0)
        gathered = min(
            partitioned_total, largest + sizes.stage3_prefetch_bucket_size, max(sizes.stage3_max_live_parameters, largest)
        )
        stage3 = prec.param_bytes * (persistent + gathered)
    return ZeroBuffers(bucket, stage3, transient)



def layer_activation_bytes(model: ModelSpec, tokens: int, ulysses: int, act_bytes: int, fused: bool = False) -> int:
    """Bytes one layer keeps for its backward on a rank holding ``tokens`` tokens (see module doc;
    ``fused``: with the fused kernels' norms and SwiGLU, planner/savers.py)."""
    q, kd, a, p = model.q_dim, model.kv_dim, model.n_heads, act_bytes
    attention = tokens * (p * (2 * q + 2 * kd) + 4 * a) + qk_norm_kept(model, tokens, p, fused)
    norms = model.norms_per_layer * norm_kept(model, tokens, p, fused)
    return attention + norms + mlp_kept(model, tokens, p, fused) + ulysses_extra(
        model, tokens, ulysses, p, kv_copies(model.n_kv_heads, ulysses)
    )


def score_bytes(model: ModelSpec, layout: Layout, seq_len: int) -> int:
    """The unfused kernel's working set for its largest (diagonal) block: 20 b a U s^2 bytes, a
    tile's when every layer is windowed (see the module doc)."""
    side = score_side(layout.ulysses * (seq_len // layout.cp), model.window, model.every_layer_windowed)
    return SCORE_MATRICES_BYTES * layout.micro_batch * model.n_heads * side * side // layout.ulysses


@dataclass(frozen=True)
class WindowedExchange:
    """A windowed layer's bytes where its K/V go straight to their readers (see the module doc)."""

    kept: int  # the K/V blocks received, kept for the backward
    backward_work: int  # the attention backward's dK/dV buffers, in place of the ring's accumulators


def windowed_exchange(model: ModelSpec, layout: Layout, seq_len: int, act_bytes: int) -> WindowedExchange:
    """One windowed layer's received K/V and backward buffers on the busiest rank; none where the
    ring passes its K/V as for a full layer."""
    ranks = window_ranks(layout.ring, seq_len, model.window) if model.num_windowed_layers else None
    if ranks is None:
        return WindowedExchange(0, 0)
    t = layout.micro_batch * seq_len // layout.cp
    block = t * model.kv_dim * kv_copies(model.n_kv_heads, layout.ulysses)
    return WindowedExchange(2 * ranks.sources * block * act_bytes, 8 * (1 + ranks.sources + ranks.readers) * block)


def attention_work(model: ModelSpec, layout: Layout, seq_len: int, act_bytes: int, *, flash: bool) -> int:
    """The attention backward's working set on one rank (see the module doc): fp32 dq and dK/dV
    accumulators, K/V in flight and block gradients, or a windowed layer's dK/dV buffers; plus
    the scores of the largest block when unfused."""
    t, h, p = layout.micro_batch * seq_len // layout.cp, model.dim, act_bytes
    c = kv_copies(model.n_kv_heads, layout.ulysses)
    work = t * ((4 + 2 * p) * h + (16 + 6 * p) * model.kv_dim * c)
    work = max(work, t * (4 + 2 * p) * h + windowed_exchange(model, layout, seq_len, p).backward_work)
    return work + (0 if flash else score_bytes(model, layout, seq_len))


def rotary_bytes(model: ModelSpec, tokens: int) -> int:
    """cos and sin in fp32 for ``tokens`` tokens, per RoPE."""
    return 4 * tokens * model.head_dim * (2 if model.local_rope else 1)


def reference_activations(
    model: ModelSpec, layout: Layout, seq_len: int, act_bytes: int, *, flash: bool, fused: bool = False
) -> int:
    """The reference pass's activation peak on one rank (planner/preference.py): a forward of one
    row under ``torch.no_grad``, which keeps nothing for a backward. The largest of its three
    phases, over the rotary tables:

        attention  the residual, the norm's working set, q, k, v (and Ulysses' copies, a
                   windowed layer's received K/V) and the attention's working set, bounded by
                   its backward's
        MLP        the residual and the attention's output, the norm's working set and the
                   SwiGLU's f-wide intermediates (a tile's, with tiles)
        loss       the final hidden states and the loss's forward: the logits, their fp32 copy
                   and log-softmax (a chunk's, where the loss is chunked), and the fp32 token
                   losses and log-sum-exps
    """
    t, h, p = seq_len // layout.cp, model.dim, act_bytes  # one row, whatever the micro batch
    row = dataclasses.replace(layout, micro_batch=1)
    c = kv_copies(model.n_kv_heads, layout.ulysses)
    norm = norm_kept(model, t, p, fused)
    received = windowed_exchange(model, row, seq_len, p).kept if model.num_windowed_layers else 0
    attention = (t * p * h + norm + t * p * (model.q_dim + 2 * model.kv_dim) + ulysses_extra(model, t, layout.ulysses, p, c)
                 + received + attention_work(model, row, seq_len, p, flash=flash))  # fmt: skip
    mlp = 2 * t * p * h + norm + mlp_kept(model, t, p, fused) // layout.mlp_tiles
    fp32_copy = 4 if p < 4 else 0  # the logits' .float(), a copy only when they are not fp32 already
    chunk = layout.loss_chunk or (FUSED_FALLBACK_CHUNK if fused else 0)
    rows = min(chunk, t) if chunk > 0 else t
    loss = t * p * h + rows * model.vocab_size * (p + fp32_copy + 4) + 8 * t
    return rotary_bytes(model, t) + max(attention, mlp, loss)


@dataclass(frozen=True)
class Activations:
    kept: int  # what every layer keeps (its input only, with checkpointing)
    loss: int  # logits, log-softmax and their gradients at the start of the backward
    loss_peak: int
    backward_peak: int
    host: int = 0  # offloaded layers' kept bytes, in pinned host memory
    received_kv: int = 0  # of ``kept``: the K/V windowed layers received from their neighbours

    @property
    def peak(self) -> int:
        return max(self.loss_peak, self.backward_peak)


def activations(
    model: ModelSpec, layout: Layout, seq_len: int, act_bytes: int, *, flash: bool, fused: bool = False,
    per_token: bool = False,
) -> Activations:
    """Activation bytes on one rank at the two candidate peaks (see module doc); ``per_token``:
    a preference objective's loss (planner/preference.py)."""
    t = layout.micro_batch * seq_len // layout.cp
    h, p = model.dim, act_bytes
    layer = layer_activation_bytes(model, t, layout.ulysses, p, fused)
    ffn_half = ffn_norms_kept(model, t, p, fused) + mlp_kept(model, t, p, fused)
    saved = layer_bytes(model, layout, t, p, layer, ffn_half, fused)
    on_device_forward, on_device_backward = resident_layers(model, layout)
    exchange = windowed_exchange(model, layout, seq_len, p)
    windowed_share = model.num_windowed_layers / model.n_layers

    def exchanged(layers: int) -> int:
        """The received K/V that ``layers`` layers keep: a fully recomputed layer keeps none."""
        return 0 if layout.checkpointing else round(layers * windowed_share) * exchange.kept

    received_kv = exchanged(on_device_forward)
    kept = on_device_forward * saved.kept + received_kv
    rotary = rotary_bytes(model, t)
    loss, logits_kept = loss_bytes(model, layout, t, p, fused, per_token)
    # The layers that do not recompute (the last ones) keep everything.
    recomputing = layout.recomputed_layers(model.n_layers)
    keeping = model.n_layers - recomputing if recomputing else 0
    plain = layer_bytes(model, dataclasses.replace(layout, checkpointing=False, selective=False), t, p, layer, ffn_half, fused)
    if keeping:
        received_kv = round(keeping * windowed_share) * exchange.kept
        kept = recomputing * saved.kept + keeping * plain.kept + received_kv
    loss_peak = kept + t * norm_bytes_per_element(model, p) * h + rotary + loss

    # One layer's backward, the last layer's first (the loss inside the model's output head
    # leaves no logits referenced by then). The
    # SwiGLU backward holds the incoming gradient and two f-wide gradients beyond what the layer
    # keeps; by the time the attention's backward runs, the layer's FFN half has been freed.
    attention = attention_work(model, layout, seq_len, p, flash=flash)
    # The one recomputed layer, when windowed, holds the K/V it received again.
    recomputed = saved.recomputed + (exchange.kept if layout.checkpointing and model.num_windowed_layers else 0)
    base = on_device_backward * saved.kept + exchanged(on_device_backward) + recomputed + rotary + logits_kept
    backward_peak = base + max(saved.ffn_work, attention - saved.ffn_kept)
    if keeping:
        # The keeping layers run their backward first, with every layer's bytes still held; the
        # recomputing ones after them, once the others' are freed.
        last_first = kept + rotary + logits_kept + max(plain.ffn_work, attention - plain.ffn_kept)
        backward_peak = max(last_first, recomputing * saved.kept + recomputed + rotary + logits_kept
                            + max(saved.ffn_work, attention - saved.ffn_kept))
    # The offloaded layers all save the one pair of rotary tables: train/offload.py keeps one host
    # copy of a storage however many layers save it.
    offloaded = model.n_layers - on_device_forward
    host = offloaded * saved.kept + exchanged(offloaded) + (rotary if on_device_forward < model.n_layers else 0)
    return Activations(kept, loss, loss_peak, backward_peak, host=host, received_kv=received_kv)


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per GPU; ``host`` is per GPU too (multiply by GPUs per node for a node's share)."""

    params: int
    grads: int
    optimizer: int
    zero_buffers: int
    activations: int  # the part of the peak that is not model state or ZeRO buffer
    host: int
    kept_by_layers: int = 0  # of the activations: what the layers keep for the backward
    logits_and_loss: int = 0  # of the activations at the loss peak: the full-vocabulary logits
    received_kv: int = 0  # of kept_by_layers: the K/V windowed layers received (module doc)
    token_losses: int = 0  # of logits_and_loss: a preference objective's per-token losses
    reference_pass: int = 0  # DPO's and IPO's reference pass: its activation peak (0: none taken)

    @property
    def model_states(self) -> int:
        return self.params + self.grads + self.optimizer

    @property
    def total(self) -> int:
        return self.model_states + self.zero_buffers + self.activations


def estimate(workload: Workload, layout: Layout) -> MemoryEstimate:
    """Peak bytes per GPU of ``workload`` trained with ``layout``."""
    model, prec = workload.model, workload.precision(layout.zero_stage)
    states = model_states(
        model.num_params,
        layout.zero_stage,
        layout.world,
        prec,
        offload_optimizer=layout.offload_optimizer,
        offload_params=layout.offload_params,
    )
    buffers = zero_buffers(model, model.num_params, layout.zero_stage, prec, workload.zero)
    per_token = keeps_token_losses(workload.objective)
    acts = activations(model, layout, workload.seq_len, prec.act_bytes, flash=workload.flash, fused=workload.fused,
                       per_token=per_token)  # fmt: skip
    reference = 0
    if needs_reference(workload.objective):
        reference = reference_activations(model, layout, workload.seq_len, prec.act_bytes, flash=workload.flash,
                                          fused=workload.fused)  # fmt: skip
    return MemoryEstimate(
        params=states.params,
        grads=states.grads,
        optimizer=states.optimizer,
        zero_buffers=buffers.resident,
        # The reference pass runs on the same model states and buffers before step 1.
        activations=max(acts.peak, buffers.reduce_transient, reference),
        host=states.host + acts.host,
        kept_by_layers=acts.kept,
        logits_and_loss=acts.loss,
        received_kv=acts.received_kv,
        token_losses=TOKEN_LOSS_BYTES * layout.micro_batch * workload.seq_len // layout.cp if per_token else 0,
        reference_pass=reference,
    )


def states_estimate(num_params: int, layout: Layout, prec: Precision) -> MemoryEstimate:
    """Model states and ZeRO buffers only, for a model known by its parameter count (and no job:
    the ZeRO buffers at ZeroConfig's default sizes)."""
    states = model_states(
        num_params,
        layout.zero_stage,
        layout.world,
        prec,
        offload_optimizer=layout.offload_optimizer,
        offload_params=layout.offload_params,
    )
    buffers = zero_buffers(None, num_params, layout.zero_stage, prec, ZeroConfig())
    # No activations to share the peak with: the end-of-backward transient adds to the buffers.
    return MemoryEstimate(
        params=states.params,
        grads=states.grads,
        optimizer=states.optimizer,
        zero_buffers=buffers.resident + buffers.reduce_transient,
        activations=0,
        host=states.host,
    )
