"""Step time and tokens/s of a layout: compute from FLOPs at an assumed MFU, plus exposed communication.

FLOPs per token, with N_mm the parameters in matrix multiplies (all but the embedding table and
norm gains) and S the sequence length: 6 N_mm for the dense part (2 forward, 4 backward; Kaplan
et al. 2020, "Scaling Laws for Neural Language Models", section 2.1) plus attention's score and
value products, 4 h S per token and layer in the forward without a mask (Narayanan et al. 2021,
"Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", section 5.1),
half of that under the causal mask, three times over for forward and backward:

    model FLOPs per token     6 N_mm + 6 L h S
    executed, checkpointing   8 N_mm + 8 L h S   (the forward runs twice)

A windowed layer's queries attend to sum over p of min(p + 1, W) keys instead of S^2 / 2
(``planner/windows.py``): its attention term is 12 h x that / S, about 12 h W when W << S. These
are the FLOPs the model needs, which the MFU counts; a windowed kernel that computes whole tiles
at the band's edge executes a little more.

A rank's compute per micro batch is t x executed FLOPs / (peak x mfu): ``mfu`` is the fraction of
the device's dense bf16 peak the kernels reach on what they execute (0.45 by default, a typical
large-model training figure). Communication (``comm``) runs at ``link_efficiency`` of the link's
nominal per-direction bandwidth: NVLink inside a node, InfiniBand across nodes. Ring transfers
overlap the block computations (async P2P), so a layer exposes max(0, ring time - attention
time); Ulysses all-to-alls block; ZeRO collectives block (DeepSpeed's overlap_comm is off for
stages 1-2 by default) except stage 3's parameter all-gathers, which its prefetching overlaps
with compute. Optimizer offload adds the PCIe transfer (gradients down, parameters up, once per
step, at the step boundary where nothing overlaps it) and a host Adam step bound by host memory
bandwidth (ZeRO-Offload's CPU optimizer step; Ren et al. 2021, section 4). Parameter offload
(ZeRO-Infinity, Rajbhandari et al. 2021, section 5) fetches the rank's partition of each layer
over PCIe before every all-gather (forward, backward and recomputation); DeepSpeed prefetches
it ahead of the layer, so it overlaps the micro batch's compute. It shares the PCIe link with
activation offload: a micro batch exposes at least what the link's total bytes take beyond the
compute, and at least the activation copies' per-layer exposure. ringtrain's engine asks DeepSpeed for torch's own AdamW (``torch_adam``), on
the host too; its single-tensor update moves 80 bytes per fp32 parameter (weight decay 8,
momentum lerp 12, variance mul and addcmul 20, denominator sqrt, div and add 24, addcdiv 16),
and DeepSpeed then reads the fp32 weight (4) to write the P-byte copy it uploads.

The reported MFU is model FLOPs (no recomputation) per second over the job's peak.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ringtrain.planner.comm import Traffic, traffic
from ringtrain.planner.devices import Device
from ringtrain.planner.layout import Layout, Workload
from ringtrain.planner.memory import activations
from ringtrain.planner.models import ModelSpec
from ringtrain.planner.savers import extra_flops_per_token, offload_exposed_s
from ringtrain.planner.windows import attended_keys

HOST_ADAM_BYTES = 80 + 4  # per parameter, plus the P bytes of the copy uploaded (see module doc)


@dataclass(frozen=True)
class Assumptions:
    mfu: float = 0.45  # achieved fraction of peak FLOP/s on the FLOPs executed
    link_efficiency: float = 0.8  # achieved fraction of nominal NVLink / InfiniBand / PCIe bandwidth
    host_memory_efficiency: float = 0.5  # achieved fraction of host memory bandwidth in CPU Adam
    gpus_per_node: int = 8


def layer_attention_flops(model: ModelSpec, seq_len: int, window: Optional[int]) -> float:
    """Forward and backward FLOPs per token of one layer's score and value products: 12 q x the
    keys a query attends to (q = n_heads x head_dim), 6 q S for a full causal layer."""
    return 12.0 * model.q_dim * attended_keys(seq_len, window)


def attention_flops_per_token(model: ModelSpec, seq_len: int) -> float:
    """Every layer's attention FLOPs per token, windowed layers counted as windowed."""
    full = model.num_full_layers * layer_attention_flops(model, seq_len, None)
    return full + model.num_windowed_layers * layer_attention_flops(model, seq_len, model.window)


def flops_per_token(model: ModelSpec, seq_len: int, *, checkpointing: bool) -> tuple[float, float]:
    """(model, executed) FLOPs per token: 6 N_mm + the layers' attention (6 L q S without
    windows), and 8/6 of it with checkpointing."""
    model_flops = 6.0 * model.num_matmul_params + attention_flops_per_token(model, seq_len)
    return model_flops, model_flops * (8 / 6 if checkpointing else 1.0)


def micro_batches(workload: Workload, layout: Layout) -> int:
    """Micro batches per optimizer step on each replica (gradient accumulation absorbs dp)."""
    return max(1, workload.global_batch // (layout.dp * layout.micro_batch))


@dataclass(frozen=True)
class StepEstimate:
    micro_batches: int
    tokens_per_step: int
    compute_s: float  # per optimizer step, as are the exposed communication times below
    ring_s: float
    ulysses_s: float
    zero_s: float
    offload_s: float
    traffic: Traffic
    mfu: float  # model FLOPs achieved over peak

    @property
    def step_s(self) -> float:
        return self.compute_s + self.ring_s + self.ulysses_s + self.zero_s + self.offload_s

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step_s


def estimate_step(workload: Workload, layout: Layout, device: Device, assume: Assumptions) -> StepEstimate:
    """Time of one optimizer step of ``workload`` with ``layout`` on ``device`` GPUs."""
    model, seq = workload.model, workload.seq_len
    prec = workload.precision(layout.zero_stage)
    accum = micro_batches(workload, layout)
    tokens = layout.micro_batch * seq // layout.cp
    model_flops, executed_flops = flops_per_token(model, seq, checkpointing=layout.checkpointing)
    if layout.checkpointing:
        # Only the recomputing layers run their forward twice.
        recomputing = layout.recomputed_layers(model.n_layers) / model.n_layers
        executed_flops = model_flops * (1 + (2 / 6) * recomputing)
    executed_flops += extra_flops_per_token(model, layout)
    flop_rate = device.peak_flops * assume.mfu
    compute = tokens * executed_flops / flop_rate

    def link(within_node: bool) -> float:
        return (device.nvlink_bw if within_node else device.network_bw) * assume.link_efficiency

    per_node = assume.gpus_per_node
    net = traffic(model, layout, seq, prec)

    # Attention's share of a layer's compute is what a layer's ring transfers can hide behind.
    recompute = 8 / 6 if layout.checkpointing else 1.0

    def attention_s(window: Optional[int]) -> float:
        return tokens * layer_attention_flops(model, seq, window) * recompute / flop_rate

    # A CP group sits on one node when whole groups tile a node; otherwise its slowest hop is InfiniBand.
    ring_bw = link(per_node % layout.cp == 0)
    full_layer = (net.ring_forward + net.ring_backward) / ring_bw
    windowed_layer = (net.windowed_ring_forward + net.windowed_ring_backward) / ring_bw
    ring = model.num_full_layers * max(0.0, full_layer - attention_s(None)) + model.num_windowed_layers * max(
        0.0, windowed_layer - attention_s(model.window)
    )

    ulysses = model.n_layers * net.ulysses / link(True)

    zero_bw = link(layout.world <= per_node)
    exposed_micro = net.zero_per_micro - net.zero_gather_per_micro
    exposed_gather = max(0.0, net.zero_gather_per_micro / zero_bw - compute)
    zero_micro = exposed_micro / zero_bw + exposed_gather

    offload = 0.0
    if layout.offload_optimizer:
        partition = -(-model.num_params // layout.world)
        gpus_on_node = min(layout.world, per_node)
        host_bytes = gpus_on_node * partition * (HOST_ADAM_BYTES + prec.param_bytes)
        offload = net.pcie_per_step / (device.pcie_bw * assume.link_efficiency) + host_bytes / (
            device.host_memory_bw * assume.host_memory_efficiency
        )

    pcie_bw = device.pcie_bw * assume.link_efficiency
    activation_exposed, link_s = 0.0, net.pcie_fetch_per_micro / pcie_bw
    if layout.offload_layers:
        kept_layer = activations(model, layout, seq, prec.act_bytes, flash=workload.flash, fused=workload.fused).host // layout.offload_layers
        layer_forward = tokens * model_flops / 3 / model.n_layers / flop_rate
        activation_exposed = offload_exposed_s(kept_layer, layout, layer_forward, pcie_bw)
        link_s += 2 * layout.offload_layers * kept_layer / pcie_bw
    offload += accum * max(activation_exposed, link_s - compute)

    tokens_per_step = accum * layout.dp * layout.micro_batch * seq
    zero = accum * zero_micro + net.zero_per_step / zero_bw
    step_s = accum * (compute + ring + ulysses) + zero + offload
    return StepEstimate(
        micro_batches=accum,
        tokens_per_step=tokens_per_step,
        compute_s=accum * compute,
        ring_s=accum * ring,
        ulysses_s=accum * ulysses,
        zero_s=zero,
        offload_s=offload,
        traffic=net,
        mfu=tokens_per_step * model_flops / step_s / (layout.world * device.peak_flops),
    )
