"""Bytes each GPU sends per training step: ring K/V exchange, Ulysses all-to-all, ZeRO collectives.

Notation as in ``memory``: t tokens on a rank per micro batch, L layers, h model dim, k d the
KV width, p bytes per activation element, R ring and U Ulysses degree, c = U / gcd(k, U) KV
copies, N parameters, P / G bytes per parameter / gradient, Z = dp x cp ranks in ZeRO's group.

Ring attention (``train/attention/exchanges/ring.py``), per layer and micro batch: the forward passes the
rank's K/V block R - 1 times, 2 t k d c p bytes each (the ring of a hybrid runs on the Ulysses
all-to-all's output: U t tokens of k c / U KV heads); the backward passes K/V R - 1 times again
and the fp32 dK/dV accumulators R times, 2 t k d c 4 bytes each. Checkpointing recomputes the
forward, so its K/V pass happens twice. A windowed layer whose window leaves some ranks' K/V
unseen by others (``planner/windows.py``) sends its K/V once to each of its readers and, in the
backward, the fp32 dK/dV of each block it read back to its owner: the busiest rank's readers x
2 t k d c p and sources x 2 t k d c 4 bytes.

Ulysses (``train/attention/ulysses.py``), per layer and micro batch: four all-to-alls (q/k/v in,
output back; output gradient in, q/k/v gradients back), each rank keeping 1/U of what it holds:
2 (U - 1)/U t p (2h + 2 k d c) bytes sent, plus the forward's half again with checkpointing.

ZeRO, per micro batch and per optimizer step, with the bandwidth-optimal ring collectives
(Patarasuk and Yuan 2009; NCCL's ring algorithm): an all-reduce of M bytes sends 2 (Z-1)/Z M per
rank, a reduce-scatter or an all-gather (Z-1)/Z M. DeepSpeed (Rajbhandari et al. 2020, section 7):
    stage 0: all-reduce the gradients once per step                    2 (Z-1)/Z G N
    stage 1: reduce-scatter the gradients once per step, all-gather
             the updated parameters                                     (Z-1)/Z (G + P) N
    stage 2: reduce-scatter the gradients every micro batch (Z-1)/Z G N, all-gather the
             parameters once per step                                   (Z-1)/Z P N
    stage 3: every micro batch, all-gather the parameters for the forward and again for the
             backward (and for the recomputation with checkpointing), reduce-scatter the
             gradients                                    per micro batch (Z-1)/Z ((2|3) P + G) N
Optimizer offload adds PCIe traffic per step: the fp32 gradient partition down, 4 N / Z, and
the updated parameters up, P N / Z (Ren et al. 2021, "ZeRO-Offload", section 4.1). With
parameter offload too (stage 3; Rajbhandari et al. 2021, "ZeRO-Infinity", section 5) the updated
parameters stay in host memory instead, and every all-gather of a micro batch first fetches the
rank's partition over PCIe: (2|3) P N / Z per micro batch, as many gathers as above.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ringtrain.planner.layout import Layout, Precision
from ringtrain.planner.memory import OFFLOAD_GRAD_BYTES
from ringtrain.planner.models import ModelSpec, kv_copies
from ringtrain.planner.windows import window_ranks

DKV_BYTES = 4  # the ring's dK/dV accumulators travel in fp32


@dataclass(frozen=True)
class Traffic:
    """Bytes one GPU sends; the attention parts per layer and micro batch, ZeRO per step."""

    ring_forward: int  # per full layer, per micro batch, forward (and recomputation)
    ring_backward: int  # per full layer, per micro batch
    ulysses: int  # per layer, per micro batch, all passes
    zero_per_micro: int  # per micro batch
    zero_per_step: int  # once per optimizer step
    zero_gather_per_micro: int  # the part of zero_per_micro that stage 3 can prefetch
    pcie_per_step: int  # optimizer offload
    pcie_fetch_per_micro: int = 0  # parameter offload: the partition fetched for every gather
    windowed_ring_forward: int = 0  # per windowed layer, per micro batch, as ring_forward
    windowed_ring_backward: int = 0

    def ring_per_micro(self, model: ModelSpec) -> int:
        """Bytes the ring attention of every layer sends per micro batch."""
        full = model.num_full_layers * (self.ring_forward + self.ring_backward)
        return full + model.num_windowed_layers * (self.windowed_ring_forward + self.windowed_ring_backward)


def ring_bytes(
    model: ModelSpec, layout: Layout, tokens: int, act_bytes: int, seq_len: int = 0, window: Optional[int] = None
) -> tuple[int, int]:
    """(forward, backward) bytes a rank sends per layer and micro batch in ring attention, for a
    layer of ``window`` (None: full) over ``seq_len`` tokens."""
    if layout.ring == 1:
        return 0, 0
    c = kv_copies(model.n_kv_heads, layout.ulysses)
    kv = 2 * tokens * model.kv_dim * c * act_bytes
    dkv = 2 * tokens * model.kv_dim * c * DKV_BYTES
    passes = 2 if layout.checkpointing else 1
    R = layout.ring
    ranks = window_ranks(R, seq_len, window)
    if ranks is not None:
        return passes * ranks.readers * kv, ranks.sources * dkv
    return passes * (R - 1) * kv, (R - 1) * kv + R * dkv


def ulysses_bytes(model: ModelSpec, layout: Layout, tokens: int, act_bytes: int) -> int:
    """Bytes a rank sends per layer and micro batch in Ulysses' all-to-alls."""
    U = layout.ulysses
    if U == 1:
        return 0
    c = kv_copies(model.n_kv_heads, U)
    qkv = tokens * act_bytes * (model.q_dim + 2 * model.kv_dim * c)
    out = tokens * act_bytes * model.q_dim
    forward = (qkv + out) * (U - 1) // U
    return (3 if layout.checkpointing else 2) * forward


def zero_bytes(num_params: int, layout: Layout, prec: Precision) -> tuple[int, int, int]:
    """(per micro batch, per step, prefetchable per micro batch) bytes a rank sends for ZeRO."""
    Z = layout.world
    if Z == 1:
        return 0, 0, 0
    grads, params = prec.grad_bytes * num_params, prec.param_bytes * num_params

    def share(nbytes: int) -> int:
        return nbytes * (Z - 1) // Z

    stage = layout.zero_stage
    if stage == 0:
        return 0, 2 * share(grads), 0
    if stage == 1:
        return 0, share(grads) + share(params), 0
    if stage == 2:
        return share(grads), share(params), 0
    gathers = (3 if layout.checkpointing else 2) * share(params)
    return gathers + share(grads), 0, gathers


def traffic(model: ModelSpec, layout: Layout, seq_len: int, prec: Precision) -> Traffic:
    tokens = layout.micro_batch * seq_len // layout.cp
    ring_fwd, ring_bwd = ring_bytes(model, layout, tokens, prec.act_bytes)
    windowed_fwd, windowed_bwd = ring_bytes(model, layout, tokens, prec.act_bytes, seq_len, model.window)
    per_micro, per_step, gather = zero_bytes(model.num_params, layout, prec)
    partition = -(-model.num_params // layout.world)
    pcie = 0
    if layout.offload_optimizer:
        pcie = OFFLOAD_GRAD_BYTES * partition + (0 if layout.offload_params else prec.param_bytes * partition)
    passes = 3 if layout.checkpointing else 2
    fetch = passes * prec.param_bytes * partition if layout.offload_params and layout.zero_stage == 3 else 0
    return Traffic(
        ring_forward=ring_fwd,
        ring_backward=ring_bwd,
        ulysses=ulysses_bytes(model, layout, tokens, prec.act_bytes),
        zero_per_micro=per_micro,
        zero_per_step=per_step,
        zero_gather_per_micro=gather,
        pcie_per_step=pcie,
        pcie_fetch_per_micro=fetch,
        windowed_ring_forward=windowed_fwd if model.num_windowed_layers else 0,
        windowed_ring_backward=windowed_bwd if model.num_windowed_layers else 0,
    )
