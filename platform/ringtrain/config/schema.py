"""The job config: one OmegaConf structured tree, loaded from YAML + dotlist overrides, validated once.

Every check raises ``ConfigError(key, reason)`` naming the dotted key a user has to change,
so the CLI can print one line and exit 2. Validation here is pure (no files read, no cluster
asked); checks that need the outside world (the data path, cluster capacity) live next to the
code that touches it but raise the same error.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf import errors as oc_errors

from ringtrain import uris
from ringtrain.chaos import BITFLIP_TARGETS, FAULT_KINDS, FaultSpec
from ringtrain.errors import ConfigError

# The attention names, declared once: train/attention keys its registries by them (which
# function runs each implementation, which class each block kernel is, what each kernel takes),
# and tests/unit/test_attention_names.py checks that every registry there matches these lists.
# attention.impl: the context-parallel implementations a job may name.
ATTENTION_IMPLS = ("ring", "ulysses", "hybrid")
# The implementation without context parallelism: the trainer's choice when mesh.cp is 1.
LOCAL_ATTENTION_IMPL = "local"
# attention.kernel: "auto" (the fastest block kernel that fits the inputs) or one block kernel.
AUTO_KERNEL = "auto"
ATTENTION_BLOCK_KERNELS = ("flash_attn", "sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "cpu_flash", "math")
ATTENTION_KERNELS = (AUTO_KERNEL, *ATTENTION_BLOCK_KERNELS)
DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "fp32", "bf16")
NAN_POLICIES = ("skip", "retry", "abort")
STRAGGLER_POLICIES = ("off", "report", "evict")
STDLIB_CORPUS = "stdlib"


@dataclass
class ModelConfig:
    """A Llama-family decoder: RMSNorm, RoPE, SwiGLU, grouped-query attention.

    With ``hf`` set, the shape comes from that Hugging Face folder's ``config.json`` and the
    weights from its safetensors; a shape key set here must agree with it. Without it, the keys
    left unset take the small defaults of ``MODEL_DEFAULTS``.
    """

    hf: str = ""  # a local Hugging Face model folder (Llama, Mistral, Qwen2, Qwen3)
    vocab_size: Optional[int] = None
    dim: Optional[int] = None
    n_layers: Optional[int] = None
    n_heads: Optional[int] = None
    n_kv_heads: Optional[int] = None
    head_dim: Optional[int] = None  # None: dim / n_heads
    ffn_dim: Optional[int] = None  # None: the SwiGLU default, 8/3 * dim rounded up to 32
    # Rotary embeddings: theta and Hugging Face's rope_scaling dict (rope_type default, linear,
    # llama3 or yarn, with its factor and other keys). Set either to extend a model's context.
    rope_theta: Optional[float] = None
    rope_scaling: Optional[dict[str, Any]] = None
    norm_eps: Optional[float] = None
    qkv_bias: Optional[bool] = None  # biases on the q, k and v projections (Qwen2)
    o_bias: Optional[bool] = None  # a bias on the attention output projection
    mlp_bias: Optional[bool] = None
    qk_norm: Optional[bool] = None  # RMSNorm of each head's q and k before RoPE (Qwen3)
    tie_embeddings: Optional[bool] = None  # the output projection is the embedding matrix
    # The context the model was pretrained or last trained for (config.json's
    # max_position_embeddings); an export raises it to what this job trains at.
    max_position_embeddings: Optional[int] = None
    init_std: float = 0.02
    # none | full (every layer keeps only its input) | selective (norms and the SwiGLU product
    # are recomputed, see train/recompute.py); the older true/false mean full/none.
    activation_checkpointing: str = "none"
    # The saved activations of this many layers (the first ones) go to host memory in the
    # forward and come back one layer ahead in the backward (train/offload.py).
    activation_offload_layers: int = 0
    # The SwiGLU MLP runs over this many sequence tiles, each recomputed in the backward.
    mlp_tiles: int = 1


# What an unset ModelConfig key means for a model trained from scratch.
MODEL_DEFAULTS: dict[str, Any] = {
    "vocab_size": 256,
    "dim": 128,
    "n_layers": 4,
    "n_heads": 4,
    "n_kv_heads": 2,
    "rope_theta": 10000.0,
    "norm_eps": 1e-5,
    "qkv_bias": False,
    "o_bias": False,
    "mlp_bias": False,
    "qk_norm": False,
    "tie_embeddings": False,
}
# rope_scaling types a training job can use; "dynamic" rescales by the length seen at inference.
ROPE_TYPES = ("default", "linear", "llama3", "yarn")
CHECKPOINTING_MODES = ("none", "full", "selective")
# The boolean spellings model.activation_checkpointing had before it took a mode.
_CHECKPOINTING_ALIASES = {"true": "full", "false": "none"}


def checkpointing_mode(value: "str | bool") -> str:
    """``model.activation_checkpointing`` as a mode: true/false (bool or YAML's string) map to full/none."""
    if isinstance(value, bool):
        return "full" if value else "none"
    return _CHECKPOINTING_ALIASES.get(str(value).lower(), str(value))


PACKINGS = ("concat", "doc")


@dataclass
class DataSourceConfig:
    """One prepared dataset of a mixture (``data.sources``)."""

    path: str = ""  # a prepared dataset: a folder, file:// or s3:// prefix holding manifest.json
    weight: float = 1.0  # share of the samples drawn from this source (weights are normalised)
    # Windows whose middle token lies in a long document (>= long_doc_tokens) are drawn this many times
    # as often, within this source only, so the mix across sources is unchanged (Fu et al. 2024).
    long_doc_upsample: float = 1.0
    long_doc_tokens: int = 4096


@dataclass
class DataConfig:
    # "stdlib": a byte-level corpus of the Python standard library's source, present everywhere.
    # A directory or text file: its bytes. A ``.bin`` file: memory-mapped tokens of token_dtype.
    # A folder or s3:// prefix with a manifest.json: a prepared dataset (``ringtrain prepare``).
    path: str = STDLIB_CORPUS
    seq_len: int = 2048
    token_dtype: str = "uint16"
    # Several prepared datasets mixed by weight; when set, data.path is not read.
    sources: list[DataSourceConfig] = field(default_factory=list)
    # concat: documents joined with EOS, attention crosses them. doc: attention and positions
    # restart at every document boundary (needs prepared datasets, which record the boundaries).
    packing: str = "concat"
    # Where S3 shards are cached on each node; "": $RINGTRAIN_DATA_CACHE or the temp dir.
    cache_dir: str = ""


@dataclass
class MeshConfig:
    dp: int = 1
    cp: int = 1  # the whole context-parallel degree: ring degree x ulysses degree
    ulysses: Optional[int] = None  # None: 1 for ring, cp for ulysses; hybrid must set it
    # Elasticity: the unit that comes and goes is a whole replica (one CP ring). The job shrinks
    # to no fewer than min_dp replicas when ranks are lost and grows back to max_dp (None: dp)
    # when capacity returns; the global batch never changes.
    min_dp: int = 1
    max_dp: Optional[int] = None
    # Warm spare workers (torch and DeepSpeed loaded, no state) that take a lost rank's seat.
    spares: int = 0


@dataclass
class ZeroConfig:
    stage: int = 2
    offload_optimizer: bool = False
    offload_params: bool = False


@dataclass
class AttentionConfig:
    impl: str = "ring"
    kernel: str = "auto"


@dataclass
class TrainConfig:
    steps: int = 100  # the schedule's length: warmup + cosine span these
    stop_at_step: Optional[int] = None  # end this run early (a time slice); resume continues it
    seed: int = 0
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 10
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    micro_batch: int = 1
    global_batch: int = 2  # sequences per optimizer step, whatever the dp degree
    # Data batches never to train on (batch b holds global samples [b, b + 1) x global_batch):
    # the ones controllers.on_nan=skip dropped, or any a user wants passed over.
    skip_batches: list[int] = field(default_factory=list)
    dtype: str = "auto"  # auto: bf16 on GPU, fp32 on CPU
    # Output projection and loss over chunks of this many tokens, each chunk's logits
    # recomputed in the backward (train/loss.py); 0 materialises the whole [tokens x vocab].
    loss_chunk_tokens: int = 0


@dataclass
class CheckpointConfig:
    # In-memory snapshot of every rank's state every this many steps (0: none). Taken off the
    # critical path; each lives in the worker, its node's holder and a buddy node's holder.
    snapshot_every: int = 1
    keep_in_memory: int = 2  # snapshots per rank each holder keeps
    buddy: bool = True  # also keep each snapshot on another node (when there is one)
    uri: str = ""  # durable store: file:///path or s3://bucket/prefix; "": <run_dir>/checkpoints
    persist_every: int = 50  # copy a snapshot to the durable store every this many steps (0: only at the end)
    keep: int = 3  # durable checkpoints kept
    resume: str = "none"  # none | auto (newest valid, if any) | a checkpoint or store uri


@dataclass
class ControllersConfig:
    # A step that takes longer than this fails the run instead of waiting forever.
    step_timeout_s: float = 600.0
    # How long spawning workers (process start, imports, DeepSpeed init) may take.
    start_timeout_s: float = 300.0
    # Liveness: while a step runs, every worker is pinged this often on its second concurrency
    # slot; one that has not answered for heartbeat_timeout_s is declared lost. A dead process
    # is noticed sooner, through Ray's actor-death notification.
    heartbeat_s: float = 1.0
    heartbeat_timeout_s: float = 10.0
    # Recoveries (replace, shrink, roll back) a run may make before it gives up.
    max_recoveries: int = 20
    # A non-finite loss rolls the step back; then: skip (drop that batch), retry (the same
    # batch again, for transient faults) or abort.
    on_nan: str = "skip"
    # Grow only after spare capacity for another replica has been seen this long (no flapping).
    grow_after_s: float = 10.0
    # A step that has not finished after this long is a stall: every rank's collective records
    # and stacks are collected, the culprit named, evicted and replaced.
    hang_timeout_s: float = 300.0
    # Silent-data-corruption scan: after the first step, every this many steps (0: never) and
    # after the last, each rank runs fixed-input probes (GEMM, attention, a collective),
    # compared with its golden values (its first round) and across ranks. A rank that fails is evicted (with every rank on its node when
    # sdc_evict_node) and training rolls back to the newest snapshot at or before the last
    # clean scan. sdc_cross_rank=false for ranks on different hardware or software, whose
    # digests need not agree with each other.
    sdc_every_steps: int = 100
    sdc_evict_node: bool = False
    sdc_cross_rank: bool = True
    # Stragglers (controllers.stragglers): a rank whose compute time (its step time outside the
    # step's collectives) is straggler_factor x its peers' median on straggler_steps consecutive
    # steps is named in an incident (report); with evict, a warm spare takes its seat (else the
    # job shrinks) and its slot is never reused. off: not watched (the default, as before).
    on_straggler: str = "off"
    straggler_factor: float = 1.5
    straggler_steps: int = 3
    # ZeRO-0 keeps the whole state on every rank: a rank's snapshot shard that had not reached
    # a holder when the rank died is written again by a survivor from its own copy, so a kill
    # right after a step costs no redone step (false: restore the newest step held whole).
    rebuild_from_replicas: bool = True


@dataclass
class TelemetryConfig:
    progress: bool = True  # one line per step on stdout
    log_every: int = 1
    metrics: bool = True  # Prometheus metrics through Ray's metrics agent
    tensorboard: bool = True  # event files under <run_dir>/tensorboard
    # The embedded cluster's metrics export port (None: Ray picks one). Keep it outside Ray's
    # worker port range 10002-19999; 8080 is KubeRay's convention.
    metrics_port: Optional[int] = None


@dataclass
class EvalConfig:
    """Evaluation: next-token loss by position (and optionally passkey retrieval) on held-out data.

    ``ringtrain eval`` fills these from its options; during training, every ``every`` steps
    and after the last one the Controller evaluates on ``data`` and adds the result to that
    step's metrics.jsonl record under ``"eval"`` (see ``ringtrain.evaluation.result``).
    """

    every: int = 0  # evaluate during training every this many steps (0: never)
    # What data.path takes (stdlib, text, a .bin or 1-D .npy token stream), or a 2-D .npy
    # whose rows are the sequences, scored as transformers does with labels=input_ids.
    data: str = ""
    seq_len: Optional[int] = None  # tokens per window of a stream; None: data.seq_len
    max_rows: Optional[int] = None  # sequences scored; None: every row of a 2-D .npy, 64 windows of a stream
    bucket_tokens: int = 1024  # the first position bucket's size; each next one doubles
    # Passkey retrieval: prompt lengths in tokens (empty: none), where the key hides (0: the
    # start of the filler, 1: its end) and how many keys per length and depth.
    passkey: list[int] = field(default_factory=list)
    passkey_depths: list[float] = field(default_factory=lambda: [0.0, 0.25, 0.5, 0.75, 1.0])
    passkey_trials: int = 1
    seed: int = 0  # draws the passkeys


@dataclass
class ChaosConfig:
    faults: list[FaultSpec] = field(default_factory=list)


@dataclass
class ClusterConfig:
    address: Optional[str] = None  # None: RAY_ADDRESS if set, else an embedded local cluster
    device: str = "auto"  # auto: cuda when the cluster has GPUs, else cpu
    cpus_per_worker: float = 0.5
    gpus_per_worker: float = 1.0
    num_cpus: Optional[int] = None  # logical CPUs of the embedded cluster; None: this host's cores


@dataclass
class JobConfig:
    name: str = "ringtrain"
    run_dir: str = ""  # "": runs/<name>-<timestamp>
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    zero: ZeroConfig = field(default_factory=ZeroConfig)
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    controllers: ControllersConfig = field(default_factory=ControllersConfig)
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    chaos: ChaosConfig = field(default_factory=ChaosConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    # Derived values. Properties, not fields, so they can never disagree with the fields.
    @property
    def ulysses_degree(self) -> int:
        if self.mesh.ulysses is not None:
            return self.mesh.ulysses
        return self.mesh.cp if self.attention.impl == "ulysses" else 1

    @property
    def ring_degree(self) -> int:
        return self.mesh.cp // self.ulysses_degree

    @property
    def world_size(self) -> int:
        return self.mesh.dp * self.mesh.cp

    @property
    def max_dp(self) -> int:
        return self.mesh.max_dp if self.mesh.max_dp is not None else self.mesh.dp

    @property
    def last_step(self) -> int:
        """The step this run ends at."""
        return self.train.stop_at_step or self.train.steps

    @property
    def grad_accum_steps(self) -> int:
        return self.train.global_batch // (self.mesh.dp * self.train.micro_batch)

    @property
    def ffn_dim(self) -> int:
        if self.model.ffn_dim is not None:
            return self.model.ffn_dim
        hidden = int(8 * self.model_int("dim") / 3)
        return 32 * ((hidden + 31) // 32)

    @property
    def head_dim(self) -> int:
        return self.model.head_dim or self.model_int("dim") // self.model_int("n_heads")

    def model_int(self, key: str) -> int:
        """A model shape key that must be known by now (resolved from ``model.hf`` or defaults)."""
        value = getattr(self.model, key)
        if value is None:
            raise ConfigError(f"model.{key}", "is not known: set it, or point model.hf at a model folder holding config.json")
        return int(value)


def load(path: Optional[str | Path] = None, overrides: Optional[list[str]] = None) -> JobConfig:
    """Build the job config from an optional YAML file and ``key=value`` overrides, then validate."""
    schema = OmegaConf.structured(JobConfig)
    layers: list[Any] = [schema]
    if path is not None:
        layers.append(_read_yaml(Path(path)))
    if overrides:
        _check_override_syntax(overrides)
        layers.append(_parse_dotlist(overrides))
    try:
        merged = OmegaConf.merge(*layers)
        job = OmegaConf.to_object(merged)
    except oc_errors.OmegaConfBaseException as exc:
        raise _as_config_error(exc) from None
    assert isinstance(job, JobConfig)
    job.model.activation_checkpointing = checkpointing_mode(job.model.activation_checkpointing)
    fill_model_defaults(job)
    validate(job)
    return job


def fill_model_defaults(job: JobConfig) -> None:
    """Give a from-scratch model's unset keys their defaults. A model.hf model keeps them unset
    until its config.json is read (``ringtrain.hf.resolve_job``), so that a key set here can be
    checked against the checkpoint's."""
    if job.model.hf:
        return
    for key, value in MODEL_DEFAULTS.items():
        if getattr(job.model, key) is None:
            setattr(job.model, key, value)


def to_yaml(job: JobConfig) -> str:
    """The resolved config as YAML, loadable again by :func:`load`."""
    return OmegaConf.to_yaml(OmegaConf.structured(job))


def replace(job: JobConfig, overrides: list[str]) -> JobConfig:
    """A copy of ``job`` with dotlist overrides applied and validated."""
    new = merge(job, overrides)
    validate(new)
    return new


def merge(job: JobConfig, overrides: list[str]) -> JobConfig:
    """A copy of ``job`` with dotlist overrides applied, not yet validated: for a caller that
    derives more keys from the result before validating it (``ringtrain eval`` sizes the batch
    and the sequence to the mesh the overrides ask for)."""
    base = OmegaConf.structured(job)
    _check_override_syntax(overrides)
    try:
        merged = OmegaConf.merge(base, _parse_dotlist(overrides))
        new = OmegaConf.to_object(merged)
    except oc_errors.OmegaConfBaseException as exc:
        raise _as_config_error(exc) from None
    assert isinstance(new, JobConfig)
    new.model.activation_checkpointing = checkpointing_mode(new.model.activation_checkpointing)
    fill_model_defaults(new)
    return new


def validate(job: JobConfig) -> None:
    """Check every value and every relation between values; raise on the first problem."""
    _positive(job.mesh.dp, "mesh.dp")
    _positive(job.mesh.cp, "mesh.cp")
    _one_of(job.attention.impl, ATTENTION_IMPLS, "attention.impl")
    _one_of(job.attention.kernel, ATTENTION_KERNELS, "attention.kernel")
    _validate_cp_layout(job)

    validate_model(job)

    d = job.data
    _positive(d.seq_len, "data.seq_len")
    if d.seq_len % (2 * job.mesh.cp):
        raise ConfigError(
            "data.seq_len",
            f"{d.seq_len} is not divisible by 2 x mesh.cp = {2 * job.mesh.cp} "
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

    ck = job.checkpoint
    for key in ("snapshot_every", "persist_every"):
        if getattr(ck, key) < 0:
            raise ConfigError(f"checkpoint.{key}", f"must be >= 0 (got {getattr(ck, key)})")
    _positive(ck.keep_in_memory, "checkpoint.keep_in_memory")
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

    _validate_elastic(job)
    if job.controllers.step_timeout_s <= 0:
        raise ConfigError("controllers.step_timeout_s", f"must be > 0 (got {job.controllers.step_timeout_s})")
    if job.controllers.start_timeout_s <= 0:
        raise ConfigError("controllers.start_timeout_s", f"must be > 0 (got {job.controllers.start_timeout_s})")
    _positive(job.telemetry.log_every, "telemetry.log_every")
    port = job.telemetry.metrics_port
    if port is not None and not (1 <= port <= 65535 and not 10002 <= port <= 19999):
        raise ConfigError("telemetry.metrics_port", f"{port} must be a port outside Ray's worker range 10002-19999")

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


def validate_data_sources(d: DataConfig) -> None:
    """Packing and the mixture's sources: paths given, weights and upsampling factors positive."""
    _one_of(d.packing, PACKINGS, "data.packing")
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
    if e.every and not e.data:
        raise ConfigError("eval.data", f"is empty, but eval.every={e.every}: name the data to evaluate on (as data.path takes, or a 2-D .npy)")
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
    validate_memory_savers(job)


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
    cp, impl, uly = job.mesh.cp, job.attention.impl, job.mesh.ulysses
    if uly is not None:
        _positive(uly, "mesh.ulysses")
        if cp % uly:
            raise ConfigError("mesh.ulysses", f"{uly} does not divide mesh.cp={cp} (ring degree = cp / ulysses)")
        if impl == "ring" and uly != 1:
            raise ConfigError("mesh.ulysses", f"attention.impl=ring needs mesh.ulysses=1 (got {uly}); use hybrid")
        if impl == "ulysses" and uly != cp:
            raise ConfigError("mesh.ulysses", f"attention.impl=ulysses needs mesh.ulysses=mesh.cp={cp} (got {uly})")
    if impl == "hybrid":
        if uly is None:
            raise ConfigError("mesh.ulysses", "attention.impl=hybrid needs the ulysses degree inside the ring set")
        if not 1 < uly < cp:
            raise ConfigError(
                "mesh.ulysses", f"attention.impl=hybrid needs 1 < mesh.ulysses < mesh.cp={cp} (got {uly})"
            )
    u = job.ulysses_degree
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


def _read_yaml(path: Path) -> DictConfig:
    if not path.is_file():
        raise ConfigError("config", f"no such job file: {path}")
    # Parsed with PyYAML first: OmegaConf.load would turn a bare string into a one-key mapping.
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:  # carries the line and column
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError("config", f"{path} is not valid YAML: {first_line}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError("config", f"{path} must hold a mapping of config keys at the top level")
    layer = OmegaConf.create(data)
    _check_sections(layer)
    return layer


def _check_sections(layer: DictConfig) -> None:
    """A plain value where the schema has a section (``mesh: 3``): name the section's key.

    OmegaConf reports this as a merge error without the key, so it is caught before merging.
    """
    for f in dataclasses.fields(JobConfig):
        if dataclasses.is_dataclass(f.default_factory) and f.name in layer:  # type: ignore[arg-type]
            if not isinstance(layer[f.name], DictConfig):
                raise ConfigError(f.name, f"must be a section of keys (e.g. {f.name}.<key>=...), got {layer[f.name]!r}")


def _check_override_syntax(overrides: list[str]) -> None:
    for item in overrides:
        key, sep, _ = item.partition("=")
        if not sep or not key:
            raise ConfigError(item, "overrides are key=value (for example mesh.dp=2)")


def _parse_dotlist(overrides: list[str]) -> DictConfig:
    try:
        layer = OmegaConf.from_dotlist(overrides)
    except oc_errors.OmegaConfBaseException as exc:
        raise _as_config_error(exc) from None
    _check_sections(layer)
    return layer


def _as_config_error(exc: oc_errors.OmegaConfBaseException) -> ConfigError:
    key = getattr(exc, "full_key", None) or "config"
    if isinstance(exc, oc_errors.ConfigKeyError):
        return ConfigError(key, "unknown key")
    # OmegaConf's first line says what was wrong ("Value 'abc' of type 'str' could not be
    # converted to Integer"); the lines after it repeat the key and internal type names.
    text = str(getattr(exc, "msg", "") or exc).strip()
    return ConfigError(key, text.splitlines()[0] if text else type(exc).__name__)
