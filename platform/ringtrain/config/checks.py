"""The job config's checks: every value and every relation between values, each failure a
``ConfigError`` naming the dotted key a user has to change.

Pure: no files read, no cluster asked. Checks that need the outside world (the data path,
cluster capacity) live next to the code that touches it but raise the same error.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

from ringtrain import uris
from ringtrain.chaos import BITFLIP_TARGETS, FAULT_KINDS
from ringtrain.config.schema import (
    ACTIVATIONS,
    ATTENTION_KERNELS,
    ATTENTION_KV_EXCHANGES,
    CHAT_OVERLONG,
    CHAT_PACKINGS,
    CHECKPOINTING_MODES,
    DEVICES,
    DTYPES,
    LAYER_TYPES,
    LOSS_NORMS,
    OBJECTIVES,
    MLFLOW_URI_SCHEMES,
    NAN_POLICIES,
    NORM_STYLES,
    PACKINGS,
    REFERENCE_INITIAL,
    REFERENCE_OBJECTIVES,
    ROPE_TYPES,
    SLIDING_ATTENTION,
    SNAPSHOT_STAGINGS,
    STDLIB_CORPUS,
    STRAGGLER_POLICIES,
    WANDB_MODES,
    DataConfig,
    EvalConfig,
    JobConfig,
    checkpointing_mode,
)
from ringtrain.config.tree import leaves
from ringtrain.errors import ConfigError

# The longest save at a stop a job may ask for (a pod that runs a driver must be granted it:
# Kubernetes sends SIGKILL 30 s after SIGTERM unless terminationGracePeriodSeconds says more).
MAX_STOP_PERSIST_S = 600.0


def validate(job: JobConfig) -> None:
    """Check every value and every relation between values; raise on the first problem."""
    validate_finite(job)
    _positive(job.mesh.dp, "mesh.dp")
    _positive(job.mesh.cp, "mesh.cp")
    _one_of(job.attention.kernel, ATTENTION_KERNELS, "attention.kernel")
    _one_of(job.attention.kv_exchange, ATTENTION_KV_EXCHANGES, "attention.kv_exchange")
    _validate_cp_layout(job)

    validate_model(job)

    d = job.data
    _positive(d.seq_len, "data.seq_len")
    multiple = job.cp_layout.sequence_multiple
    if d.seq_len % multiple:
        raise ConfigError(
            "data.seq_len",
            f"{d.seq_len} is not divisible by 2 x mesh.cp = {multiple} "
            "(the zigzag layout cuts each sequence into 2 chunks per context-parallel rank)",
        )
    _one_of(d.token_dtype, ("uint8", "uint16", "uint32"), "data.token_dtype")
    if not d.path:
        raise ConfigError("data.path", "is empty; use 'stdlib' or a path to text files or a .bin token file")
    validate_data_sources(d)

    z = job.zero
    if z.stage not in (0, 1, 2, 3):
        raise ConfigError("zero.stage", f"must be 0, 1, 2 or 3 (got {z.stage})")
    if z.offload_params and z.stage != 3:
        raise ConfigError("zero.offload_params", f"parameter offload needs zero.stage=3 (got {z.stage})")
    if z.offload_optimizer and z.stage == 0:
        raise ConfigError("zero.offload_optimizer", "optimizer offload needs zero.stage >= 1")
    # DeepSpeed's own bounds: a reduce bucket holds at least one element; stage 3's sizes may be
    # 0 (nothing gathered ahead of its use, no tensor kept whole).
    _positive(z.reduce_bucket_size, "zero.reduce_bucket_size")
    for key in ("stage3_prefetch_bucket_size", "stage3_param_persistence_threshold", "stage3_max_live_parameters"):
        if getattr(z, key) < 0:
            raise ConfigError(f"zero.{key}", f"must be >= 0 elements (got {getattr(z, key)})")

    t = job.train
    _positive(t.steps, "train.steps")
    if t.stop_at_step is not None and not 1 <= t.stop_at_step <= t.steps:
        raise ConfigError("train.stop_at_step", f"must be in [1, train.steps={t.steps}] (got {t.stop_at_step})")
    _positive(t.micro_batch, "train.micro_batch")
    _positive(t.global_batch, "train.global_batch")
    if t.global_batch % (job.mesh.dp * t.micro_batch):
        raise ConfigError(
            "train.global_batch",
            f"{t.global_batch} is not divisible by mesh.dp x train.micro_batch = "
            f"{job.mesh.dp} x {t.micro_batch} = {job.mesh.dp * t.micro_batch}",
        )
    if not t.lr > 0:
        raise ConfigError("train.lr", f"must be > 0 (got {t.lr})")
    if not 0 <= t.min_lr_ratio <= 1:
        raise ConfigError("train.min_lr_ratio", f"must be in [0, 1] (got {t.min_lr_ratio})")
    if t.warmup_steps < 0:
        raise ConfigError("train.warmup_steps", f"must be >= 0 (got {t.warmup_steps})")
    if t.weight_decay < 0:
        raise ConfigError("train.weight_decay", f"must be >= 0 (got {t.weight_decay})")
    for key, beta in (("train.beta1", t.beta1), ("train.beta2", t.beta2)):
        if not 0 <= beta < 1:
            raise ConfigError(key, f"must be in [0, 1) (got {beta})")
    if t.grad_clip < 0:
        raise ConfigError("train.grad_clip", f"must be >= 0, 0 disables clipping (got {t.grad_clip})")
    _one_of(t.dtype, DTYPES, "train.dtype")
    _one_of(t.loss_norm, LOSS_NORMS, "train.loss_norm")
    _one_of(t.objective, OBJECTIVES, "train.objective")
    validate_preference(job)

    ck = job.checkpoint
    for key in ("snapshot_every", "persist_every"):
        if getattr(ck, key) < 0:
            raise ConfigError(f"checkpoint.{key}", f"must be >= 0 (got {getattr(ck, key)})")
    _positive(ck.keep_in_memory, "checkpoint.keep_in_memory")
    _one_of(ck.snapshot_staging, SNAPSHOT_STAGINGS, "checkpoint.snapshot_staging")
    _positive(ck.keep, "checkpoint.keep")
    if ck.persist_every and ck.snapshot_every and ck.persist_every % ck.snapshot_every:
        raise ConfigError(
            "checkpoint.persist_every",
            f"{ck.persist_every} is not a multiple of checkpoint.snapshot_every={ck.snapshot_every}",
        )
    if ck.uri and not (uris.is_known(ck.uri) and (uris.has_scheme(ck.uri) or ck.uri.startswith("/"))):
        raise ConfigError("checkpoint.uri", f"{ck.uri!r} must be file:///absolute/path, /absolute/path or s3://bucket/prefix")
    if not ck.resume:
        raise ConfigError("checkpoint.resume", "is empty; use none, auto or a checkpoint uri")
    if not ck.lease_s > 0:
        raise ConfigError("checkpoint.lease_s", f"must be > 0 (got {ck.lease_s})")
    if ck.max_failed_saves < 0:
        raise ConfigError("checkpoint.max_failed_saves", f"must be >= 0, 0 never stopping (got {ck.max_failed_saves})")
    if not 0 <= ck.stop_persist_timeout_s <= MAX_STOP_PERSIST_S:
        raise ConfigError(
            "checkpoint.stop_persist_timeout_s",
            f"must be within 0..{MAX_STOP_PERSIST_S:g} seconds, 0 saving nothing at a stop (got {ck.stop_persist_timeout_s})",
        )

    _validate_elastic(job)
    if job.controllers.step_timeout_s <= 0:
        raise ConfigError("controllers.step_timeout_s", f"must be > 0 (got {job.controllers.step_timeout_s})")
    for key in ("start_timeout_s", "join_timeout_s"):
        if getattr(job.controllers, key) <= 0:
            raise ConfigError(f"controllers.{key}", f"must be > 0 (got {getattr(job.controllers, key)})")
    _positive(job.telemetry.log_every, "telemetry.log_every")
    port = job.telemetry.metrics_port
    if port is not None and not (1 <= port <= 65535 and not 10002 <= port <= 19999):
        raise ConfigError("telemetry.metrics_port", f"{port} must be a port outside Ray's worker range 10002-19999")
    _one_of(job.telemetry.wandb.mode, WANDB_MODES, "telemetry.wandb.mode")
    uri = job.telemetry.mlflow.tracking_uri
    if uri and not uri.startswith(MLFLOW_URI_SCHEMES):
        raise ConfigError("telemetry.mlflow.tracking_uri", f"{uri!r} must start with one of {', '.join(MLFLOW_URI_SCHEMES)}")

    for i, fault in enumerate(job.chaos.faults):
        key = f"chaos.faults[{i}]"
        _one_of(fault.kind, FAULT_KINDS, f"{key}.kind")
        if not 0 <= fault.rank < job.world_size:
            raise ConfigError(f"{key}.rank", f"{fault.rank} is not a rank of {job.world_size} (mesh.dp x mesh.cp)")
        if not 1 <= fault.step <= job.train.steps:
            raise ConfigError(f"{key}.step", f"{fault.step} is not a step of 1..train.steps={job.train.steps}")
        if fault.seconds < 0:
            raise ConfigError(f"{key}.seconds", f"must be >= 0 (got {fault.seconds})")
        if fault.count < 1 or (fault.count > 1 and fault.kind != "slow"):
            raise ConfigError(f"{key}.count", f"must be >= 1, and above 1 only for kind slow (got {fault.count})")
        if fault.kind == "bitflip":
            _one_of(fault.target, BITFLIP_TARGETS, f"{key}.target")
            if not 0 <= fault.bit < 32:
                raise ConfigError(f"{key}.bit", f"{fault.bit} is not a bit of a 32-bit element (0..31)")

    validate_eval(job.eval)

    c = job.cluster
    _one_of(c.device, DEVICES, "cluster.device")
    if c.cpus_per_worker < 0:
        raise ConfigError("cluster.cpus_per_worker", f"must be >= 0 (got {c.cpus_per_worker})")
    if c.gpus_per_worker <= 0:
        raise ConfigError("cluster.gpus_per_worker", f"must be > 0 (got {c.gpus_per_worker})")
    if c.device == "cuda":  # device=auto: resolve_device checks it once the cluster shows its GPUs
        validate_gpus_per_worker(c.gpus_per_worker)
    if c.num_cpus is not None:
        _positive(c.num_cpus, "cluster.num_cpus")
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", job.name):
        raise ConfigError("name", f"{job.name!r} must be letters, digits, '.', '_' or '-' (it names the run directory)")


def validate_finite(job: JobConfig) -> None:
    """Every number is finite. ``train.lr=inf`` passes ``> 0`` and a NaN passes every
    comparison, so a range check alone lets them through to the optimizer."""
    for key, value in leaves(dataclasses.asdict(job)):
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(key, f"must be a finite number (got {value})")


def validate_preference(job: JobConfig) -> None:
    """The preference objective's settings: a positive, finite beta, label smoothing in [0, 0.5),
    and a rule for overlong pairs that never cuts a completion."""
    p, d = job.train.preference, job.data
    if not (math.isfinite(p.beta) and p.beta > 0):
        raise ConfigError("train.preference.beta", f"must be a finite number > 0 (got {p.beta})")
    if not 0 <= p.label_smoothing < 0.5:
        raise ConfigError("train.preference.label_smoothing", f"must be in [0, 0.5) (got {p.label_smoothing})")
    if not math.isfinite(p.gamma):
        raise ConfigError("train.preference.gamma", f"must be a finite number (got {p.gamma})")
    if not (math.isfinite(p.sft_weight) and p.sft_weight >= 0):
        raise ConfigError("train.preference.sft_weight", f"must be a finite number >= 0 (got {p.sft_weight})")
    if not p.reference.strip():
        raise ConfigError("train.preference.reference", f"is empty: give {REFERENCE_INITIAL} (the starting weights), a "
                          "Hugging Face model folder, a run directory or a checkpoint URI")
    if job.train.objective == "lm":
        return
    if job.train.objective not in REFERENCE_OBJECTIVES and p.reference != REFERENCE_INITIAL:
        raise ConfigError("train.preference.reference", f"{p.reference}, but {job.train.objective} scores against no "
                          f"reference model (only {' and '.join(REFERENCE_OBJECTIVES)} do): leave it at {REFERENCE_INITIAL}")
    if d.chat_overlong == "truncate":
        raise ConfigError("data.chat_overlong", "truncate would cut a pair's completions; a preference objective "
                          "takes drop or truncate_start (its prompt cut from the start)")


def validate_data_sources(d: DataConfig) -> None:
    """Packing and the mixture's sources: paths given, weights and upsampling factors positive."""
    _one_of(d.packing, PACKINGS, "data.packing")
    _one_of(d.chat_overlong, CHAT_OVERLONG, "data.chat_overlong")
    _one_of(d.chat_packing, CHAT_PACKINGS, "data.chat_packing")
    if d.sources and d.path != STDLIB_CORPUS:
        raise ConfigError("data.sources", f"and data.path={d.path!r} are both set; name the datasets in one of them")
    for i, s in enumerate(d.sources):
        key = f"data.sources[{i}]"
        if not s.path:
            raise ConfigError(f"{key}.path", "is empty; name a prepared dataset (a folder or s3:// prefix)")
        if not s.weight > 0:
            raise ConfigError(f"{key}.weight", f"must be > 0 (got {s.weight})")
        if not s.long_doc_upsample > 0:
            raise ConfigError(f"{key}.long_doc_upsample", f"must be > 0 (got {s.long_doc_upsample})")
        _positive(s.long_doc_tokens, f"{key}.long_doc_tokens")


def validate_gpus_per_worker(gpus: float) -> None:
    """On CUDA every worker binds one whole device of its own (the first of the GPUs Ray
    assigns it): a fraction would let Ray put two ranks on one GPU, which NCCL refuses."""
    if not (float(gpus).is_integer() and gpus >= 1):
        raise ConfigError(
            "cluster.gpus_per_worker", f"must be a whole number >= 1 on CUDA, one device per worker (got {gpus:g})"
        )


def validate_eval(e: EvalConfig) -> None:
    """The eval section's values; whether ``eval.data`` exists is checked where it is read."""
    if e.every < 0:
        raise ConfigError("eval.every", f"must be >= 0, 0 turns evaluation off (got {e.every})")
    if e.every and not e.data and not e.tasks:
        raise ConfigError("eval.data", f"is empty, but eval.every={e.every}: name the data to evaluate on (as data.path takes, or a 2-D .npy), or eval.tasks")
    if e.limit is not None:
        _positive(e.limit, "eval.limit")
    if e.num_fewshot is not None and e.num_fewshot < 0:
        raise ConfigError("eval.num_fewshot", f"must be >= 0 (got {e.num_fewshot})")
    for key in ("seq_len", "max_rows"):
        if getattr(e, key) is not None:
            _positive(getattr(e, key), f"eval.{key}")
    _positive(e.bucket_tokens, "eval.bucket_tokens")
    for i, length in enumerate(e.passkey):
        _positive(length, f"eval.passkey[{i}]")
    if e.passkey and not e.passkey_depths:
        raise ConfigError("eval.passkey_depths", "is empty; list where the key hides, e.g. [0, 0.5, 1]")
    for i, depth in enumerate(e.passkey_depths):
        if not 0 <= depth <= 1:
            raise ConfigError(f"eval.passkey_depths[{i}]", f"must be in [0, 1] (got {depth})")
    _positive(e.passkey_trials, "eval.passkey_trials")


def validate_model(job: JobConfig) -> None:
    """The model's shape and rotary settings; keys still unset (a model.hf model not yet read)
    are checked once they are known."""
    m = job.model
    for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn_dim", "max_position_embeddings"):
        if getattr(m, name) is not None:
            _positive(getattr(m, name), f"model.{name}")
    if m.dim is not None and m.n_heads is not None and m.head_dim is None and m.dim % m.n_heads:
        raise ConfigError("model.n_heads", f"model.dim={m.dim} is not divisible by model.n_heads={m.n_heads}")
    if m.dim is not None and m.n_heads is not None and job.head_dim % 2:
        raise ConfigError("model.n_heads", f"head dim {job.head_dim} must be even for rotary embeddings")
    if m.n_heads is not None and m.n_kv_heads is not None and m.n_heads % m.n_kv_heads:
        raise ConfigError(
            "model.n_kv_heads", f"model.n_heads={m.n_heads} is not divisible by model.n_kv_heads={m.n_kv_heads}"
        )
    if m.rope_theta is not None and m.rope_theta <= 0:
        raise ConfigError("model.rope_theta", f"must be > 0 (got {m.rope_theta})")
    if m.norm_eps is not None and m.norm_eps <= 0:
        raise ConfigError("model.norm_eps", f"must be > 0 (got {m.norm_eps})")
    if m.rope_scaling is not None:
        validate_rope_scaling(dict(m.rope_scaling), "model.rope_scaling")
    validate_block(job)
    validate_attention_windows(job)
    validate_memory_savers(job)


def validate_block(job: JobConfig) -> None:
    """The block's variant keys: norm style, activation, attention scale, soft-capping, and the
    windowed layers' own rotary settings."""
    m = job.model
    if m.norm_style is not None:
        _one_of(m.norm_style, NORM_STYLES, "model.norm_style")
    if m.activation is not None:
        _one_of(m.activation, ACTIVATIONS, "model.activation")
    for key in ("query_pre_attn_scalar", "final_logit_softcapping", "rope_local_theta"):
        value = getattr(m, key)
        if value is not None and not value > 0:
            raise ConfigError(f"model.{key}", f"must be > 0, or null for none (got {value})")
    if m.rope_local_scaling is not None:
        validate_rope_scaling(dict(m.rope_local_scaling), "model.rope_local_scaling")
    if m.final_logit_softcapping is not None and job.train.loss_chunk_tokens > 0:
        raise ConfigError(
            "train.loss_chunk_tokens",
            f"the chunked loss does not soft-cap its logits (model.final_logit_softcapping={m.final_logit_softcapping}); set it to 0",
        )


def validate_attention_windows(job: JobConfig) -> None:
    """model.sliding_window and model.layer_types; the count of layer types is checked once
    model.n_layers is known, the window of sliding layers once model.hf is read."""
    m = job.model
    if m.sliding_window is not None and m.sliding_window < 0:
        raise ConfigError("model.sliding_window", f"must be >= 1, or 0 for no window (got {m.sliding_window})")
    if m.layer_types is None:
        return
    for i, kind in enumerate(m.layer_types):
        _one_of(kind, LAYER_TYPES, f"model.layer_types[{i}]")
    if m.n_layers is not None and len(m.layer_types) != m.n_layers:
        raise ConfigError("model.layer_types", f"has {len(m.layer_types)} entries, one per layer of model.n_layers={m.n_layers}")
    if not m.hf and SLIDING_ATTENTION in m.layer_types and m.sliding_window is None:
        raise ConfigError("model.sliding_window", f"is unset, but model.layer_types has {SLIDING_ATTENTION} layers: give their window")


def validate_memory_savers(job: JobConfig) -> None:
    """The long-context memory savers and their relations to the model and the mesh; the
    checks that need n_layers run once it is known (for model.hf, after config.json is read)."""
    m, t = job.model, job.train
    _one_of(checkpointing_mode(m.activation_checkpointing), CHECKPOINTING_MODES, "model.activation_checkpointing")
    if m.activation_offload_layers < 0:
        raise ConfigError("model.activation_offload_layers", f"must be >= 0, 0 turns offload off (got {m.activation_offload_layers})")
    if m.n_layers is not None and m.activation_offload_layers > m.n_layers:
        raise ConfigError(
            "model.activation_offload_layers",
            f"{m.activation_offload_layers} is more than the model's model.n_layers={m.n_layers}",
        )
    if m.recompute_layers is not None:
        if m.recompute_layers < 0:
            raise ConfigError("model.recompute_layers", f"must be >= 0, or null for every layer (got {m.recompute_layers})")
        if m.activation_offload_layers:
            raise ConfigError(
                "model.recompute_layers",
                "is for jobs without activation offload: set model.activation_offload_layers=0, or leave it null",
            )
        if m.n_layers is not None and m.recompute_layers > m.n_layers:
            raise ConfigError(
                "model.recompute_layers",
                f"{m.recompute_layers} is more than the model's model.n_layers={m.n_layers}",
            )
    _positive(m.mlp_tiles, "model.mlp_tiles")
    local_seq = job.data.seq_len // job.mesh.cp if job.mesh.cp >= 1 else job.data.seq_len
    if local_seq % m.mlp_tiles:
        raise ConfigError(
            "model.mlp_tiles",
            f"{m.mlp_tiles} does not divide the local sequence data.seq_len / mesh.cp = {local_seq}",
        )
    if t.loss_chunk_tokens < 0:
        raise ConfigError("train.loss_chunk_tokens", f"must be >= 1, or 0 to turn chunking off (got {t.loss_chunk_tokens})")


# Keys each rope_scaling type needs, beyond rope_type itself.
_ROPE_REQUIRED = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings"),
}


def validate_rope_scaling(scaling: dict[str, Any], key: str) -> None:
    """Hugging Face's rope_scaling schema (``type`` is the older spelling of ``rope_type``)."""
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "dynamic":
        raise ConfigError(
            key, "rope_type 'dynamic' rescales by the length seen at inference time and cannot be trained; "
            "use linear, llama3 or yarn with the context you train at"
        )
    if rope_type not in ROPE_TYPES:
        raise ConfigError(key, f"rope_type {rope_type!r} is not one of {', '.join(ROPE_TYPES)}")
    missing = [k for k in _ROPE_REQUIRED[rope_type] if scaling.get(k) is None]
    if missing:
        raise ConfigError(key, f"rope_type {rope_type!r} needs {', '.join(missing)}")
    factor = scaling.get("factor")
    if factor is not None and (not isinstance(factor, (int, float)) or factor < 1):
        raise ConfigError(f"{key}.factor", f"must be a number >= 1 (got {factor!r})")
    partial = scaling.get("partial_rotary_factor", 1.0)
    if partial != 1.0:
        raise ConfigError(f"{key}.partial_rotary_factor", f"partial rotary embeddings are not supported (got {partial})")


def _validate_elastic(job: JobConfig) -> None:
    m, c = job.mesh, job.controllers
    _positive(m.min_dp, "mesh.min_dp")
    if m.min_dp > m.dp:
        raise ConfigError("mesh.min_dp", f"{m.min_dp} is larger than mesh.dp={m.dp}")
    if m.max_dp is not None and m.max_dp < m.dp:
        raise ConfigError("mesh.max_dp", f"{m.max_dp} is smaller than mesh.dp={m.dp}")
    if m.spares < 0:
        raise ConfigError("mesh.spares", f"must be >= 0 (got {m.spares})")
    for key in ("heartbeat_s", "heartbeat_timeout_s", "hang_timeout_s"):
        if getattr(c, key) <= 0:
            raise ConfigError(f"controllers.{key}", f"must be > 0 (got {getattr(c, key)})")
    if c.heartbeat_timeout_s < c.heartbeat_s:
        raise ConfigError(
            "controllers.heartbeat_timeout_s", f"{c.heartbeat_timeout_s} is shorter than controllers.heartbeat_s={c.heartbeat_s}"
        )
    if c.max_recoveries < 0:
        raise ConfigError("controllers.max_recoveries", f"must be >= 0 (got {c.max_recoveries})")
    _one_of(c.on_nan, NAN_POLICIES, "controllers.on_nan")
    if c.grow_after_s < 0:
        raise ConfigError("controllers.grow_after_s", f"must be >= 0 (got {c.grow_after_s})")
    if c.sdc_every_steps < 0:
        raise ConfigError("controllers.sdc_every_steps", f"must be >= 0 (got {c.sdc_every_steps}); 0 turns scans off")
    _one_of(c.on_straggler, STRAGGLER_POLICIES, "controllers.on_straggler")
    if not c.straggler_factor > 1:
        raise ConfigError("controllers.straggler_factor", f"must be > 1 (got {c.straggler_factor}): a slowdown against the median rank")
    if c.straggler_steps < 1:
        raise ConfigError("controllers.straggler_steps", f"must be >= 1 (got {c.straggler_steps})")


def _validate_cp_layout(job: JobConfig) -> None:
    """The job's CP layout can be built (``topology.cp_layout`` checks attention.impl against
    mesh.cp and mesh.ulysses), and the model's heads split over its Ulysses groups."""
    u = job.cp_layout.ulysses
    if job.model.n_heads is not None and job.model.n_heads % u:
        raise ConfigError(
            "mesh.ulysses", f"model.n_heads={job.model.n_heads} is not divisible by the ulysses degree {u}"
        )


def _positive(value: int | float, key: str) -> None:
    if not value >= 1:
        raise ConfigError(key, f"must be >= 1 (got {value})")


def _one_of(value: str, allowed: tuple[str, ...], key: str) -> None:
    if value not in allowed:
        raise ConfigError(key, f"{value!r} is not one of {', '.join(allowed)}")
