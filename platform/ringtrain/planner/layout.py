"""What the planner decides and what it is told: a training layout, its precision, the workload.

A ``Layout`` is one candidate: dp replicas of a context-parallel group of ``ring x ulysses``
ranks, a ZeRO stage, activation checkpointing and offload. ``overrides`` turns it back into
the ``key=value`` arguments of ``ringtrain run``; ``SAVERS`` names its memory savers once for
``describe``, ``overrides`` and the plan's savers column.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from ringtrain.config import CPLayout, JobConfig, ZeroConfig, checkpointing_mode
from ringtrain.errors import ConfigError
from ringtrain.planner.models import ModelSpec, from_job

DTYPES = ("bf16", "fp32")


@dataclass(frozen=True)
class Precision:
    """Bytes per element of each kind of training state."""

    name: str
    param_bytes: int
    grad_bytes: int
    act_bytes: int
    optimizer_bytes: int  # K: optimizer state per parameter, master weights included


def precision(dtype: str, zero_stage: int, optimizer_bytes: Optional[int] = None) -> Precision:
    """The byte accounting of mixed-precision (bf16) or fp32 AdamW training at a ZeRO stage.

    bf16: 2-byte params and grads, K = 12 bytes of fp32 master weights, momentum and variance
    (Rajbhandari et al. 2020, "ZeRO", section 3.1). fp32: 4-byte params and grads; at stage 0 the
    optimizer updates the fp32 params in place, so K = 8 (momentum and variance); at stages 1-3
    DeepSpeed clones an fp32 master partition even when the params already are fp32, so K = 12.
    ``optimizer_bytes`` overrides K.
    """
    if dtype not in DTYPES:
        raise ConfigError("train.dtype", f"{dtype!r} is not one of {', '.join(DTYPES)}")
    if optimizer_bytes is not None and optimizer_bytes < 0:
        raise ConfigError("--optimizer-bytes", f"must be >= 0 (got {optimizer_bytes})")
    if dtype == "bf16":
        return Precision("bf16", 2, 2, 2, 12 if optimizer_bytes is None else optimizer_bytes)
    default_k = 8 if zero_stage == 0 else 12
    return Precision("fp32", 4, 4, 4, default_k if optimizer_bytes is None else optimizer_bytes)


@dataclass(frozen=True)
class Saver:
    """One memory saver as the planner names it, read off one ``Layout`` field.

    ``label`` and ``short`` are format strings that take the field's value ("{}" where the
    value belongs in the words, none where it is a flag).
    """

    field: str  # the Layout field that holds it
    label: str  # Layout.describe()'s words
    short: str  # the savers column of ``ringtrain plan --max-seq-len``
    # The ``ringtrain run`` key that Layout.overrides() gives only while the saver is on; "" where
    # an override it always lists says it (model.activation_checkpointing, zero.offload_*).
    override: str = ""
    on: Callable[[Any], bool] = bool  # from the field's value: does the layout use it?
    # A model.activation_checkpointing mode: ``short`` is the mode's name, and the savers column
    # shows exactly one mode, "none" included, as Layout.checkpointing_mode.
    recompute: bool = False

    def value(self, layout: Layout) -> Any:
        return getattr(layout, self.field)

    def describe(self, layout: Layout) -> str:
        return self.label.format(self.value(layout))

    def abbreviate(self, layout: Layout) -> str:
        return self.short.format(self.value(layout))


# In describe()'s order, which is also the savers column's.
SAVERS = (
    Saver("checkpointing", "checkpointing", "full", recompute=True),
    Saver("selective", "selective recompute", "selective", recompute=True),
    Saver("recompute_layers", "of the first {} layers only", "first {}", "model.recompute_layers", on=lambda n: n is not None),
    Saver("loss_chunk", "chunked loss ({:,} tokens)", "loss/{}", "train.loss_chunk_tokens"),
    Saver("mlp_tiles", "MLP in {} tiles", "tiles {}", "model.mlp_tiles", on=lambda tiles: tiles > 1),
    Saver("offload_layers", "{} layers' activations offloaded", "offload {}", "model.activation_offload_layers"),
    Saver("offload_optimizer", "optimizer offload", "opt offload"),
    Saver("offload_params", "parameter offload", "param offload"),
)


@dataclass(frozen=True)
class Layout:
    dp: int
    ring: int
    ulysses: int
    zero_stage: int
    checkpointing: bool
    offload_optimizer: bool = False
    offload_params: bool = False
    micro_batch: int = 1
    # The long-context savers (planner/savers.py); the defaults are none of them. ``checkpointing``
    # is full recomputation; ``selective`` recomputes the norms and the MLP only.
    selective: bool = False
    offload_layers: int = 0  # model.activation_offload_layers
    mlp_tiles: int = 1  # model.mlp_tiles
    loss_chunk: int = 0  # train.loss_chunk_tokens
    # Of the layers, the first this many recompute (by ``checkpointing`` or ``selective``) and the
    # rest keep everything; None: every layer recomputes (model.recompute_layers).
    recompute_layers: Optional[int] = None

    @property
    def cp(self) -> int:
        return self.ring * self.ulysses

    @property
    def checkpointing_mode(self) -> str:
        """``model.activation_checkpointing`` for this layout: full, selective or none."""
        return next((s.short for s in self.savers() if s.recompute), "none")

    def recomputed_layers(self, n_layers: int) -> int:
        """How many of ``n_layers`` layers recompute (none without checkpointing)."""
        if not (self.checkpointing or self.selective):
            return 0
        return n_layers if self.recompute_layers is None else min(self.recompute_layers, n_layers)

    @property
    def num_savers(self) -> int:
        """How many of the long-context savers this layout uses (full checkpointing is not one)."""
        return int(self.selective) + int(self.offload_layers > 0) + int(self.mlp_tiles > 1) + int(self.loss_chunk > 0)

    @property
    def world(self) -> int:
        return self.dp * self.cp

    @property
    def cp_layout(self) -> CPLayout:
        """The CP layout of the degrees this candidate proposes (a planned job runs it by name)."""
        return CPLayout(self.ring, self.ulysses)

    @property
    def impl(self) -> str:
        """The ``attention.impl`` that runs it."""
        return self.cp_layout.impl

    def savers(self) -> list[Saver]:
        """The savers this layout uses, in ``SAVERS`` order."""
        return [s for s in SAVERS if s.on(s.value(self))]

    def describe(self) -> str:
        """``dp 8 x cp 8 (ring 2 x ulysses 4), ZeRO-3, checkpointing, optimizer offload``"""
        parts = [f"dp {self.dp} x cp {self.cp} (ring {self.ring} x ulysses {self.ulysses})", f"ZeRO-{self.zero_stage}"]
        return ", ".join(parts + [s.describe(self) for s in self.savers()])

    def saver_column(self) -> str:
        """The plan's savers cell: the recompute mode, always, then the other savers in use."""
        return ", ".join([self.checkpointing_mode] + [s.abbreviate(self) for s in self.savers() if not s.recompute])

    def overrides(self) -> list[str]:
        """The ``ringtrain run`` arguments that select this layout, whatever the job file says."""
        return [
            f"mesh.dp={self.dp}",
            f"mesh.cp={self.cp}",
            f"mesh.ulysses={self.ulysses}",
            f"attention.impl={self.impl}",
            f"zero.stage={self.zero_stage}",
            f"zero.offload_optimizer={str(self.offload_optimizer).lower()}",
            f"zero.offload_params={str(self.offload_params).lower()}",
            f"model.activation_checkpointing={self.checkpointing_mode}",
        ] + self._saver_overrides()

    def _saver_overrides(self) -> list[str]:
        # By key, not in SAVERS order: the order ``ringtrain run`` lines have always been printed in.
        on = sorted((s for s in self.savers() if s.override), key=lambda s: s.override)
        return [f"{s.override}={s.value(self)}" for s in on]


@dataclass(frozen=True)
class Workload:
    """The model and what one training step feeds it; independent of the layout."""

    model: ModelSpec
    seq_len: int
    dtype: str = "bf16"
    flash: bool = True  # a fused attention kernel (no score matrix in memory)
    optimizer_bytes: Optional[int] = None
    global_batch: int = 1  # sequences per optimizer step, as train.global_batch
    # Fused kernels (train.fused_ops on a GPU, train/fused.py): RMSNorm, SwiGLU and the loss keep
    # less for the backward than the eager ops (planner/savers.py says how much).
    fused: bool = False
    # train.objective: lm, or a preference objective whose rows hold pairs (planner/preference.py).
    objective: str = "lm"
    # The job's zero section, for its buffer sizes (planner/memory.py's zero_buffers); the stage
    # and offload are the layout's. Without a job, ZeroConfig's defaults.
    zero: ZeroConfig = field(default_factory=ZeroConfig)

    @property
    def global_batch_tokens(self) -> int:
        return self.global_batch * self.seq_len

    def precision(self, zero_stage: int) -> Precision:
        return precision(self.dtype, zero_stage, self.optimizer_bytes)


def resolve_dtype(job: JobConfig, device_type: str) -> str:
    """The training dtype ringtrain picks: ``train.dtype``, or for "auto" bf16 on GPUs, fp32 on CPU."""
    if job.train.dtype != "auto":
        return job.train.dtype
    return "fp32" if device_type == "cpu" else "bf16"


def layout_of(job: JobConfig) -> Layout:
    """The layout a job config asks for."""
    cp = job.cp_layout
    return Layout(
        dp=job.mesh.dp,
        ring=cp.ring,
        ulysses=cp.ulysses,
        zero_stage=job.zero.stage,
        checkpointing=checkpointing_mode(job.model.activation_checkpointing) == "full",
        offload_optimizer=job.zero.offload_optimizer,
        offload_params=job.zero.offload_params,
        micro_batch=job.train.micro_batch,
        selective=checkpointing_mode(job.model.activation_checkpointing) == "selective",
        offload_layers=job.model.activation_offload_layers,
        mlp_tiles=job.model.mlp_tiles,
        loss_chunk=job.train.loss_chunk_tokens,
        recompute_layers=job.model.recompute_layers,
    )


def workload_of(job: JobConfig, device_type: str, *, optimizer_bytes: Optional[int] = None) -> Workload:
    """The workload of a job config on ``device_type`` ("cpu", "cuda" or a GPU type)."""
    return Workload(
        model=from_job(job),
        seq_len=job.data.seq_len,
        dtype=resolve_dtype(job, device_type),
        # Every kernel but "math" is fused (flash-attn, SDPA flash/cuDNN/efficient, torch's CPU flash).
        flash=job.attention.kernel != "math",
        optimizer_bytes=optimizer_bytes,
        global_batch=job.train.global_batch,
        fused=bool(job.train.fused_ops) and device_type != "cpu",
        objective=job.train.objective,
        zero=job.zero,
    )
