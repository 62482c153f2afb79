"""The layout search: enumerate valid layouts for N GPUs, keep those that fit, rank them by tokens/s.

A layout is valid when (the same rules ``config.validate`` and the attention code enforce):
- dp x cp = the GPU count, cp = ring x ulysses;
- dp x micro batch divides the global batch (gradient accumulation makes up the rest);
- ``seq_len`` divides by 2 x cp (the zigzag layout cuts a sequence into 2 chunks per CP rank);
- the Ulysses degree divides the query heads (KV heads are replicated when it exceeds them) and
  the GPUs of a node, so its groups of consecutive ranks never straddle nodes and their
  all-to-alls stay on NVLink; the ring may span nodes.

Each layout is tried plain, with full checkpointing, and with the long-context savers added
one after another, cheapest first (``saver_ladder``): selective recomputation, chunked loss,
tiled MLP under full checkpointing, then every layer's activations offloaded; and each of
those with ZeRO offload, cheapest first (``zero_offloads``): none, the optimizer (stages 1-3),
then the parameters too (stage 3). In a tie on speed the layout with less ZeRO offload and
fewer savers ranks first, so a saver is chosen only when it is needed to fit. ``max_seq_len`` finds, per layout, the longest sequence that fits.

A layout fits when its predicted peak is at most the device's memory less a headroom for the
CUDA context, NCCL buffers and allocator fragmentation, and its offloaded state fits in the
node's host memory. When nothing fits, ``advise`` says what would: more GPUs (the fewest that
fit), or which part of the memory is out of reach and why.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Optional

from ringtrain.config import CPLayout
from ringtrain.planner.devices import GB, Device
from ringtrain.planner.layout import Layout, Workload
from ringtrain.planner.memory import MemoryEstimate, estimate
from ringtrain.planner.savers import DEFAULT_LOSS_CHUNK, mlp_tiles_for
from ringtrain.planner.throughput import Assumptions, StepEstimate, estimate_step

ZERO_STAGES = (0, 1, 2, 3)
# The most GPUs ``advise`` looks at when searching for the fewest that fit.
MAX_GPUS = 65536
# What every length the planner reaches is divisible by, per sequence multiple: MLP tiles up to this many
# per rank divide it.
MAX_MLP_TILES = 64
# The longest sequence the planner's reach considers: 2^40 tokens.
MAX_TOKENS = 2**40


@dataclass(frozen=True)
class Cluster:
    device: Device
    gpus: int
    gpus_per_node: int = 8
    headroom: float = 0.1  # fraction of GPU memory kept free

    @property
    def usable_bytes(self) -> int:
        return int(self.device.memory_bytes * (1 - self.headroom))

    def with_gpus(self, gpus: int) -> Cluster:
        return Cluster(self.device, gpus, self.gpus_per_node, self.headroom)


@dataclass(frozen=True)
class Candidate:
    layout: Layout
    memory: MemoryEstimate
    step: StepEstimate
    fits: bool


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def saver_ladder(n_layers: int, tiles: int) -> list[dict[str, object]]:
    """The checkpointing and saver settings tried for each layout, cheapest first."""
    chunk = DEFAULT_LOSS_CHUNK
    return [
        {"checkpointing": False},
        {"checkpointing": True},
        {"checkpointing": False, "selective": True},
        {"checkpointing": False, "selective": True, "loss_chunk": chunk},
        {"checkpointing": True, "loss_chunk": chunk},
        {"checkpointing": True, "loss_chunk": chunk, "mlp_tiles": tiles},
        {"checkpointing": True, "loss_chunk": chunk, "mlp_tiles": tiles, "offload_layers": n_layers},
    ]


def zero_offloads(stage: int) -> list[tuple[bool, bool]]:
    """(offload_optimizer, offload_params) tried at a ZeRO stage, cheapest first. Parameter
    offload is tried with optimizer offload only: alone it saves P N / Z of the (P + K) N / Z
    the optimizer's offload saves more cheaply (its traffic is per step, not per gather)."""
    if stage == 0:
        return [(False, False)]
    if stage < 3:
        return [(False, False), (True, False)]
    return [(False, False), (True, False), (True, True)]


def offload_level(layout: Layout) -> int:
    """0 none, 1 optimizer, 2 optimizer and parameters: the rank of ``zero_offloads``."""
    return int(layout.offload_optimizer) + int(layout.offload_params)


def layouts(
    workload: Workload, cluster: Cluster, *, micro_batch: int = 1, savers: bool = True
) -> Iterator[Layout]:
    """Every valid layout of ``cluster.gpus`` GPUs, each ZeRO stage, with and without checkpointing,
    optimizer offload and (``savers``) the long-context savers."""
    heads = workload.model.n_heads
    for cp in divisors(cluster.gpus):
        if workload.seq_len % CPLayout.sequence_multiple_of(cp):
            continue
        if workload.global_batch % (cluster.gpus // cp * micro_batch):
            continue
        local_seq = micro_batch * workload.seq_len // cp
        # A tiled rung tiles at least in two, so it is never the untiled rung again.
        tiles = max(2, mlp_tiles_for(workload.model, local_seq)) if local_seq % 2 == 0 else 1
        ladder = saver_ladder(workload.model.n_layers, tiles)
        for ulysses in divisors(cp):
            if heads % ulysses or cluster.gpus_per_node % ulysses:
                continue
            for stage in ZERO_STAGES:
                for rung in ladder if savers else ladder[:2]:
                    for optimizer, params in zero_offloads(stage):
                        yield Layout(
                            dp=cluster.gpus // cp,
                            ring=cp // ulysses,
                            ulysses=ulysses,
                            zero_stage=stage,
                            offload_optimizer=optimizer,
                            offload_params=params,
                            micro_batch=micro_batch,
                            **rung,  # type: ignore[arg-type]
                        )


def fits(memory: MemoryEstimate, cluster: Cluster) -> bool:
    host_per_node = memory.host * min(cluster.gpus, cluster.gpus_per_node)
    return memory.total <= cluster.usable_bytes and host_per_node <= cluster.device.host_memory_bytes


def evaluate(workload: Workload, layout: Layout, cluster: Cluster, assume: Assumptions) -> Candidate:
    memory = estimate(workload, layout)
    step = estimate_step(workload, layout, cluster.device, assume)
    return Candidate(layout, memory, step, fits(memory, cluster))


# Throughputs within this factor of each other rank as a tie: the estimate is not finer than that.
TIE = 1.01


def rank_key(c: Candidate) -> tuple[bool, int, int, int, int]:
    """Fitting first, then faster (to within ``TIE``), then less ZeRO offload, then fewer savers,
    then less memory."""
    speed_class = math.floor(math.log(c.step.tokens_per_s) / math.log(TIE))
    return (not c.fits, -speed_class, offload_level(c.layout), c.layout.num_savers, c.memory.total)


def search(
    workload: Workload, cluster: Cluster, assume: Assumptions, *, micro_batch: int = 1, savers: bool = True
) -> list[Candidate]:
    """Every valid layout evaluated, best first (see ``rank_key``)."""
    found = [
        evaluate(workload, layout, cluster, assume)
        for layout in layouts(workload, cluster, micro_batch=micro_batch, savers=savers)
    ]
    return sorted(found, key=rank_key)


def cluster_sizes(gpus_per_node: int) -> list[int]:
    """GPU counts one can rent: powers of two below a node, 1-16 nodes, then doubling node counts."""
    below = {2**k for k in range(17) if 2**k < gpus_per_node}
    nodes = {gpus_per_node * n for n in range(1, 17)}
    doubling = {gpus_per_node * 2**k for k in range(5, 17)}
    return sorted(n for n in below | nodes | doubling if n <= MAX_GPUS)


def fewest_gpus(
    workload: Workload, cluster: Cluster, assume: Assumptions, *, micro_batch: int = 1, savers: bool = True
) -> Optional[Candidate]:
    """The best layout on the smallest of ``cluster_sizes`` that has a fitting layout, if any does."""
    for gpus in cluster_sizes(cluster.gpus_per_node):
        ranked = search(workload, cluster.with_gpus(gpus), assume, micro_batch=micro_batch, savers=savers)
        if ranked and ranked[0].fits:
            return ranked[0]
    return None


@dataclass(frozen=True)
class Reach:
    """The longest sequence one layout fits, with its estimate there."""

    candidate: Candidate
    max_seq_len: int


def _with_seq(workload: Workload, seq_len: int) -> Workload:
    return dataclasses.replace(workload, seq_len=seq_len)


def unit_of(layout: Layout) -> int:
    """The step between lengths the planner reaches for ``layout``: its CP layout's sequence
    multiple times ``MAX_MLP_TILES``, so MLP tiles up to that many per rank divide every length."""
    return layout.cp_layout.sequence_multiple * MAX_MLP_TILES


def at_length(workload: Workload, layout: Layout, seq_len: int, cluster: Cluster, assume: Assumptions) -> Candidate:
    """``layout`` evaluated at ``seq_len``, its MLP tiles (when tiled) re-chosen for the local sequence."""
    if layout.mlp_tiles > 1:
        local = layout.micro_batch * seq_len // layout.cp
        layout = dataclasses.replace(layout, mlp_tiles=mlp_tiles_for(workload.model, local))
    return evaluate(_with_seq(workload, seq_len), layout, cluster, assume)


def recipe_reach(workload: Workload, layout: Layout, cluster: Cluster, assume: Assumptions) -> Optional[Reach]:
    """The longest multiple of ``unit_of(layout)`` that ``layout`` (one fixed recipe) fits, or None
    where not even one unit does. The estimate grows with the sequence, so doubling then bisecting
    finds it."""
    unit = unit_of(layout)

    def fits(units: int) -> bool:
        return at_length(workload, layout, unit * units, cluster, assume).fits

    if not fits(1):
        return None
    low, high = 1, 2
    while fits(high) and high < MAX_TOKENS // unit:
        low, high = high, high * 2
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    return Reach(at_length(workload, layout, unit * low, cluster, assume), unit * low)


def max_seq_len(workload: Workload, cluster: Cluster, assume: Assumptions, *, micro_batch: int = 1) -> list[Reach]:
    """Per layout (each saver rung of ``saver_ladder``), the longest sequence that fits, longest
    first. Sequences are multiples of ``unit_of`` the layout; the memory estimate grows with the
    sequence, so a bisection finds the longest (``recipe_reach``)."""
    # A length every CP degree of the cluster's GPUs shards, so every layout is searched.
    probe = _with_seq(workload, CPLayout.sequence_multiple_of(cluster.gpus) * MAX_MLP_TILES)
    bases = layouts(probe, cluster, micro_batch=micro_batch)
    found = [reach for reach in (recipe_reach(workload, base, cluster, assume) for base in bases) if reach is not None]
    return sorted(
        found,
        key=lambda r: (-r.max_seq_len, offload_level(r.candidate.layout), r.candidate.layout.num_savers, r.candidate.memory.total),
    )


def smallest(candidates: list[Candidate]) -> Optional[Candidate]:
    return min(candidates, key=lambda c: c.memory.total, default=None)


def advise(
    workload: Workload, cluster: Cluster, assume: Assumptions, candidates: list[Candidate], *, micro_batch: int = 1
) -> list[str]:
    """One line per reason nothing fits and what would, for a search that found no fitting layout."""
    usable = cluster.usable_bytes / GB
    if not candidates:
        return [
            f"no valid layout of {cluster.gpus} GPUs: for some cp dividing {cluster.gpus}, data.seq_len="
            f"{workload.seq_len} must divide by 2 x cp and train.global_batch={workload.global_batch} by dp x "
            f"micro batch, and the Ulysses degree must divide {workload.model.n_heads} heads"
        ]
    lines = []
    low = smallest(candidates)
    assert low is not None
    mem = low.memory
    lines.append(
        f"the leanest layout ({low.layout.describe()}) needs {mem.total / GB:.1f} GB per GPU, "
        f"{usable:.1f} GB usable: model states {mem.model_states / GB:.1f} GB, ZeRO buffers "
        f"{mem.zero_buffers / GB:.1f} GB, activations {mem.activations / GB:.1f} GB"
        + (f" (full-vocabulary logits and loss {mem.logits_and_loss / GB:.1f} GB)" if mem.logits_and_loss else "")
    )
    more = fewest_gpus(workload, cluster, assume, micro_batch=micro_batch)
    if more is None:
        lines.append(f"no layout fits on up to {MAX_GPUS} GPUs: shorten data.seq_len or choose a larger --gpu-type")
    else:
        # Divisibility (sequence, heads, global batch) can leave a count with no fitting layout
        # although a smaller one has one.
        world = more.layout.world
        lines.append(
            f"{'needs at least' if world > cluster.gpus else 'fits on fewer:'} {world} GPUs (--gpus {world}): best "
            f"there {more.layout.describe()}, {more.memory.total / GB:.1f} GB per GPU, "
            f"{more.step.tokens_per_s:,.0f} tokens/s"
        )
    if mem.activations > cluster.usable_bytes:
        lines.append(
            f"activations alone exceed a GPU even with checkpointing and the longest CP ring of {cluster.gpus} GPUs: "
            "more GPUs for a longer ring, a shorter data.seq_len, or a GPU with more memory"
        )
    return lines
