"""The job config's schema: every section and key with its default, the name lists the keys
take their values from, and the values derived from them (``JobConfig``'s properties)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from ringtrain.chaos import FaultSpec
from ringtrain.errors import ConfigError
from ringtrain.topology import ATTENTION_IMPLS, LOCAL_ATTENTION_IMPL, CPLayout, Topology, cp_layout

# The schema's public names, which ``ringtrain.config`` shows as its own: what it defines, and
# the attention names it takes from topology.py.
__all__ = [
    "ACTIVATIONS",
    "ATTENTION_BLOCK_KERNELS",
    "ATTENTION_IMPLS",
    "ATTENTION_KERNELS",
    "ATTENTION_KV_EXCHANGES",
    "AUTO_KERNEL",
    "AttentionConfig",
    "CHAT_OVERLONG",
    "CHAT_PACKINGS",
    "CHECKPOINTING_MODES",
    "CPLayout",
    "ChaosConfig",
    "CheckpointConfig",
    "ClusterConfig",
    "ControllersConfig",
    "DEVICES",
    "DTYPES",
    "DataConfig",
    "DataSourceConfig",
    "EvalConfig",
    "FULL_ATTENTION",
    "JobConfig",
    "KV_EXCHANGES",
    "LAYER_TYPES",
    "LOCAL_ATTENTION_IMPL",
    "LOSS_NORMS",
    "MODEL_DEFAULTS",
    "MLFLOW_URI_SCHEMES",
    "MeshConfig",
    "MlflowConfig",
    "ModelConfig",
    "NAN_POLICIES",
    "NORM_STYLES",
    "OBJECTIVES",
    "PACKINGS",
    "PREFERENCE_OBJECTIVES",
    "PreferenceConfig",
    "REFERENCE_INITIAL",
    "REFERENCE_OBJECTIVES",
    "ROPE_TYPES",
    "SLIDING_ATTENTION",
    "SNAPSHOT_STAGINGS",
    "STDLIB_CORPUS",
    "STRAGGLER_POLICIES",
    "TelemetryConfig",
    "TrainConfig",
    "WANDB_MODES",
    "WandbConfig",
    "ZeroConfig",
    "checkpointing_mode",
]

# The attention names, declared once: train/attention keys its registries by them (which
# function runs each implementation, which class each block kernel is, what each kernel takes),
# and tests/unit/test_attention_names.py checks that every registry there matches these lists.
# attention.impl's names (ATTENTION_IMPLS) and what a CP group of one rank runs
# (LOCAL_ATTENTION_IMPL) are declared with the CP layout they name, in topology.py.


# attention.kernel: "auto" (the fastest block kernel that fits the inputs) or one block kernel.
AUTO_KERNEL = "auto"


ATTENTION_BLOCK_KERNELS = ("flash_attn", "sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "cpu_flash", "math")
ATTENTION_KERNELS = (AUTO_KERNEL, *ATTENTION_BLOCK_KERNELS)


# attention.kv_exchange: how a ring's ranks see each other's K/V: passed around the ring block by
# block ("ring"), or all gathered at once ("allgather", for short blocks on rings of four ranks or
# more); "auto" picks by the ring's size and the length of a rank's block
# (train/attention/call.py, choose_exchange). The one list of the names a job may ask for.
KV_EXCHANGES = ("ring", "allgather")
ATTENTION_KV_EXCHANGES = ("auto", *KV_EXCHANGES)
DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "fp32", "bf16")
NAN_POLICIES = ("skip", "retry", "abort")
STRAGGLER_POLICIES = ("off", "report", "evict")
STDLIB_CORPUS = "stdlib"


@dataclass
class ModelConfig:
    """A Llama-family decoder: RMSNorm, RoPE, a gated MLP, grouped-query attention, each layer
    full causal or windowed; Gemma 3's block is the same with the switches below set.

    With ``hf`` set, the shape comes from that Hugging Face folder's ``config.json`` and the
    weights from its safetensors; a shape key set here must agree with it. Without it, the keys
    left unset take the small defaults of ``MODEL_DEFAULTS``.
    """

    hf: str = ""  # a local Hugging Face model folder (Llama, Mistral, Qwen2, Qwen3, Gemma 3 text)
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
    # Attention windows: a layer of layer_types' "sliding_attention" sees the sliding_window most
    # recent tokens, itself included; a "full_attention" one every earlier token. Without
    # layer_types every layer slides (Mistral); without a window (or 0) every layer is full.
    # Both come from config.json with model.hf, and a job may override either.
    sliding_window: Optional[int] = None
    layer_types: Optional[list[str]] = None  # one of LAYER_TYPES per layer
    # The sliding layers' own rotary settings (Gemma 3's local base); unset, they rotate as the
    # full layers do. rope_theta and rope_scaling are then the full layers', which a context
    # extension scales while the windowed layers keep theirs.
    rope_local_theta: Optional[float] = None
    rope_local_scaling: Optional[dict[str, Any]] = None
    # Gemma's block: "gemma" norms scale by (1 + w) in fp32 and norm each branch's output too
    # (four norms per layer); "llama" norms scale by w after rounding.
    norm_style: Optional[str] = None  # NORM_STYLES
    activation: Optional[str] = None  # the gated MLP's: ACTIVATIONS (silu: SwiGLU, gelu_pytorch_tanh: GeGLU)
    scale_embeddings: Optional[bool] = None  # embeddings times sqrt(dim), in their dtype (Gemma)
    # Attention scores scaled by query_pre_attn_scalar ** -0.5 (Gemma); unset: head_dim ** -0.5.
    query_pre_attn_scalar: Optional[float] = None
    # Logits soft-capped to cap x tanh(logits / cap) (Gemma's final_logit_softcapping); unset: none.
    final_logit_softcapping: Optional[float] = None
    init_std: float = 0.02
    # none | full (every layer keeps only its input) | selective (norms and the SwiGLU product
    # are recomputed, see train/recompute.py) | auto (the least recomputation whose activations
    # fit the device's memory by the planner's memory model; none on a CPU); the older
    # true/false mean full/none.
    activation_checkpointing: str = "auto"
    # Of the layers, the first this many recompute by activation_checkpointing's mode and the
    # rest keep everything (null: every layer recomputes). ``auto`` sets it where recomputing
    # every layer would leave memory unused.
    recompute_layers: Optional[int] = None
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
    "norm_style": "llama",
    "activation": "silu",
    "scale_embeddings": False,
}


# model.layer_types: transformers' names of a layer's attention, windowed or full causal.
SLIDING_ATTENTION = "sliding_attention"
FULL_ATTENTION = "full_attention"
LAYER_TYPES = (FULL_ATTENTION, SLIDING_ATTENTION)


# model.norm_style and model.activation: the block's variants (train/model.py, train/fused.py).
NORM_STYLES = ("llama", "gemma")
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


# rope_scaling types a training job can use; "dynamic" rescales by the length seen at inference.
ROPE_TYPES = ("default", "linear", "llama3", "yarn")


CHECKPOINTING_MODES = ("none", "full", "selective", "auto")


# The boolean spellings model.activation_checkpointing had before it took a mode.
_CHECKPOINTING_ALIASES = {"true": "full", "false": "none"}


def checkpointing_mode(value: "str | bool") -> str:
    """``model.activation_checkpointing`` as a mode: true/false (bool or YAML's string) map to full/none."""
    if isinstance(value, bool):
        return "full" if value else "none"
    return _CHECKPOINTING_ALIASES.get(str(value).lower(), str(value))


PACKINGS = ("concat", "doc")
# A chat conversation longer than seq_len: dropped, cut to its first seq_len tokens, or cut to its
# last (long-document QA, whose answer comes last).
CHAT_OVERLONG = ("drop", "truncate", "truncate_start")
# How whole conversations fill rows: next-fit (a row closes when the next one does not fit) or
# first-fit decreasing within seeded windows of conversations (train/conversations.py).
CHAT_PACKINGS = ("next_fit", "first_fit")
# What a step minimises: lm, the next-token loss; or a preference objective over pairs of a
# preference dataset (train/preference.py).
PREFERENCE_OBJECTIVES = ("dpo", "ipo", "simpo", "orpo")
# The preference objectives scored against a reference model's log-probs, and the reference that
# is the run's own starting weights.
REFERENCE_OBJECTIVES = ("dpo", "ipo")
REFERENCE_INITIAL = "initial"
OBJECTIVES = ("lm", *PREFERENCE_OBJECTIVES)
# token: the mean over every trained token of the global batch; sequence: each conversation's
# token mean, averaged over the global batch's conversations (LongAlign, Bai et al. 2024).
LOSS_NORMS = ("token", "sequence")
SNAPSHOT_STAGINGS = ("auto", "none")


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
    # CHAT_OVERLONG: a chat dataset's conversation longer than seq_len (counted either way).
    chat_overlong: str = "drop"
    # CHAT_PACKINGS: how a chat dataset's conversations (or a preference dataset's pairs) fill the rows.
    chat_packing: str = "next_fit"
    # A preference pair's prompt laid out once, both completions continuing it (its forward and
    # backward run once); false: prompt + chosen and prompt + rejected as two documents.
    prefix_sharing: bool = True
    # Where S3 shards are cached on each node; "": $RINGTRAIN_DATA_CACHE, else a private folder
    # of the user's own under the temp dir (ringtrain.cachedir).
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
    # ZeRO's buffer sizes, under DeepSpeed's own key names, in elements (not bytes); the defaults
    # are DeepSpeed 0.19's. The engine writes them into DeepSpeed's config (train/engine.py) and
    # the planner counts them (planner/memory.py), so a plan holds the buffers the run allocates.
    # Stages 1-3: gradients are reduced in buckets of this many elements. A larger bucket sends
    # fewer, larger collectives (a fast network keeps busy) for a larger resident buffer.
    reduce_bucket_size: int = 500_000_000
    # Stage 3: parameter elements gathered ahead of their use. More hides the all-gathers behind
    # compute, at the memory of the parameters gathered early; 0 gathers none ahead.
    stage3_prefetch_bucket_size: int = 50_000_000
    # Stage 3: a tensor of at most this many elements is kept whole on every rank. Higher saves
    # the many small gathers of norms and biases, at the memory of their copies on every rank.
    stage3_param_persistence_threshold: int = 100_000
    # Stage 3: at most this many gathered parameter elements live at once (the module in use is
    # gathered whole whatever the cap). Lower saves memory, at the cost of fewer gathers started
    # ahead of their use.
    stage3_max_live_parameters: int = 1_000_000_000


@dataclass
class AttentionConfig:
    impl: str = "ring"
    kernel: str = "auto"
    kv_exchange: str = "auto"  # ATTENTION_KV_EXCHANGES


@dataclass
class PreferenceConfig:
    """The preference objectives' settings (train/preference.py has their definitions)."""

    beta: float = 0.1  # DPO's and IPO's beta (IPO's tau), SimPO's beta, ORPO's lambda
    gamma: float = 0.5  # SimPO's target reward margin
    label_smoothing: float = 0.0  # conservative DPO's (and SimPO's) label noise, in [0, 0.5)
    sft_weight: float = 0.0  # times the chosen completion's mean token NLL, added (RPO)
    # DPO's and IPO's reference model: REFERENCE_INITIAL (the starting weights), or a Hugging Face
    # model folder, a run directory or a checkpoint URI of the same model's shape and tokenizer.
    # Its completion log-probs are taken once, on the job's mesh, and kept in the checkpoint store.
    reference: str = "initial"


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
    # recomputed in the backward (train/loss.py); 0 materialises the whole [tokens x vocab],
    # except where fused_ops runs the fused linear cross-entropy, which never does.
    loss_chunk_tokens: int = 0
    # Fused kernels where they run (train/fused.py): on CUDA with liger-kernel installed, RMSNorm,
    # RoPE, SwiGLU and the linear cross-entropy as Triton kernels, and AdamW's fused step;
    # everywhere but ZeRO-3, q/k/v and the SwiGLU's two input projections as one GEMM each.
    # false: the eager reference path.
    fused_ops: bool = True
    # LOSS_NORMS: how a step's token losses are averaged (sequence needs a chat dataset).
    loss_norm: str = "token"
    # OBJECTIVES: lm, or a preference objective, which trains on a preference dataset's pairs.
    objective: str = "lm"
    preference: PreferenceConfig = field(default_factory=PreferenceConfig)


@dataclass
class CheckpointConfig:
    # In-memory snapshot of every rank's state every this many steps (0: none). Taken off the
    # critical path; each lives in the worker, its node's holder and a buddy node's holder.
    snapshot_every: int = 1
    keep_in_memory: int = 2  # snapshots per rank each holder keeps (a worker: this + 2 host buffers of its state on a GPU's side stream, + 1 where a thread copies)
    # SNAPSHOT_STAGINGS, on a GPU: auto copies each snapshot into a device buffer first where the
    # device has room for it beside a step's peak, judged at the first snapshot after a step
    # (this rank's share of the fp32 state: 12 bytes a parameter over the ZeRO ranks), so the
    # next optimizer step waits milliseconds for it and the copy into host memory has until the
    # next snapshot; none always copies from the live state, and the next optimizer step waits
    # for the whole copy.
    snapshot_staging: str = "auto"
    buddy: bool = True  # also keep each snapshot on another node (when there is one)
    uri: str = ""  # durable store: file:///path or s3://bucket/prefix; "": <run_dir>/checkpoints
    persist_every: int = 50  # copy a snapshot to the durable store every this many steps (0: only at the end)
    keep: int = 3  # durable checkpoints kept
    resume: str = "none"  # none | auto (newest valid, if any) | a checkpoint or store uri
    # One run writes a store at a time: it holds the store's writer lease, renewed every third of
    # this term; a run killed without releasing it blocks the store this long at most.
    lease_s: float = 60.0
    # On SIGINT or SIGTERM the newest in-memory snapshot is written to the store within this many
    # seconds (0: not at all), well inside the 30 s Kubernetes grants a pod between SIGTERM and SIGKILL.
    stop_persist_timeout_s: float = 20.0
    # Durable saves that may fail in a row (the store refusing, or unreachable after retries)
    # before the run stops, its newest durable checkpoint kept; 0: train on without them.
    max_failed_saves: int = 3


@dataclass
class ControllersConfig:
    # A step that takes longer than this fails the run instead of waiting forever.
    step_timeout_s: float = 600.0
    # How long spawning workers (process start, imports, DeepSpeed init) may take.
    start_timeout_s: float = 300.0
    # How long forming a world's process groups in a join (rendezvous and connections) may take:
    # a peer that dies meanwhile holds the others no longer than this (gloo retries a connect to
    # a dead peer's address until its timeout). Once formed, collectives get step_timeout_s.
    join_timeout_s: float = 30.0
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
    # Stragglers (policies.stragglers): a rank whose compute time (its step time outside the
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


WANDB_MODES = ("online", "offline")
# Where an MLflow client can log: a tracking server, or a local database or folder.
MLFLOW_URI_SCHEMES = ("http://", "https://", "sqlite:///", "file:", "databricks")


@dataclass
class MlflowConfig:
    """An MLflow tracking server the driver logs the run to; off while ``tracking_uri`` is empty."""

    tracking_uri: str = ""  # e.g. http://mlflow.internal:5000; credentials from MLFLOW_TRACKING_* env
    experiment: str = "ringtrain"
    run_name: str = ""  # empty: the job's name
    tags: dict[str, str] = field(default_factory=dict)


@dataclass
class WandbConfig:
    """A Weights & Biases project the driver logs the run to; off while ``project`` is empty."""

    project: str = ""
    entity: str = ""  # empty: the API key's default entity
    mode: str = "online"  # online | offline (files under <run_dir>/wandb, `wandb sync` later)
    group: str = ""
    tags: list[str] = field(default_factory=list)


@dataclass
class TelemetryConfig:
    progress: bool = True  # one line per step on stdout
    log_every: int = 1
    metrics: bool = True  # Prometheus metrics through Ray's metrics agent
    tensorboard: bool = True  # event files under <run_dir>/tensorboard
    # The embedded cluster's metrics export port (None: Ray picks one). Keep it outside Ray's
    # worker port range 10002-19999; 8080 is KubeRay's convention.
    metrics_port: Optional[int] = None
    # Experiment trackers, fed by the driver from its metrics stream (telemetry/trackers.py).
    mlflow: MlflowConfig = field(default_factory=MlflowConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)


@dataclass
class EvalConfig:
    """Evaluation: next-token loss by position (and optionally passkey retrieval) on held-out data,
    and lm-evaluation-harness tasks.

    ``ringtrain eval`` fills these from its options; during training, every ``every`` steps
    and after the last one the Controller evaluates on ``data`` and ``tasks`` and adds the result
    to that step's metrics.jsonl record under ``"eval"`` (see ``ringtrain.evaluation.result``).
    """

    every: int = 0  # evaluate during training every this many steps (0: never)
    # What data.path takes (stdlib, text, a .bin or 1-D .npy token stream), or a 2-D .npy
    # whose rows are the sequences, scored as transformers does with labels=input_ids.
    data: str = ""
    seq_len: Optional[int] = None  # tokens per window of a stream; None: data.seq_len
    # Sequences scored; None: every row of a 2-D .npy, every conversation of a chat dataset that
    # fits, 64 windows of a stream.
    max_rows: Optional[int] = None
    bucket_tokens: int = 1024  # the first position bucket's size; each next one doubles
    # Passkey retrieval: prompt lengths in tokens (empty: none), where the key hides (0: the
    # start of the filler, 1: its end) and how many keys per length and depth.
    passkey: list[int] = field(default_factory=list)
    passkey_depths: list[float] = field(default_factory=lambda: [0.0, 0.25, 0.5, 0.75, 1.0])
    passkey_trials: int = 1
    seed: int = 0  # draws the passkeys
    # lm-evaluation-harness tasks, groups or tags (the eval extra), run with the workers as the
    # model; include_path: a folder of local task YAML files; limit: examples per task at most;
    # num_fewshot: shots in each prompt (None: each task's own).
    tasks: list[str] = field(default_factory=list)
    include_path: str = ""
    limit: Optional[int] = None
    num_fewshot: Optional[int] = None


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
    def cp_layout(self) -> CPLayout:
        """Which context parallelism the job runs (``topology.cp_layout``); raises ConfigError
        where attention.impl and the mesh disagree."""
        return cp_layout(self.attention.impl, self.mesh.cp, self.mesh.ulysses, self.attention.kv_exchange)

    @property
    def ulysses_degree(self) -> int:
        return self.cp_layout.ulysses

    @property
    def topology(self) -> Topology:
        """The job's dp x cp grid at its configured dp (a resize builds its own)."""
        layout = self.cp_layout
        return Topology(self.mesh.dp, layout.cp, layout.ulysses)

    @property
    def ring_degree(self) -> int:
        return self.cp_layout.ring

    @property
    def world_size(self) -> int:
        return self.topology.world_size

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

    @property
    def layer_windows(self) -> tuple[Optional[int], ...]:
        """Each layer's attention window in tokens, None where the layer attends to every earlier
        token: ``model.sliding_window`` on the layers ``model.layer_types`` calls sliding (every
        layer when it is unset), none without a window."""
        n_layers, window = self.model_int("n_layers"), self.model.sliding_window
        if not window:
            return (None,) * n_layers
        kinds = self.model.layer_types or [SLIDING_ATTENTION] * n_layers
        return tuple(window if kind == SLIDING_ATTENTION else None for kind in kinds)

    def model_int(self, key: str) -> int:
        """A model shape key that must be known by now (resolved from ``model.hf`` or defaults)."""
        value = getattr(self.model, key)
        if value is None:
            raise ConfigError(f"model.{key}", "is not known: set it, or point model.hf at a model folder holding config.json")
        return int(value)
