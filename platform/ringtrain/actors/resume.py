"""Where a run's durable checkpoints go, what they must match, which one a resume loads, and the
run's claim to write there (the store's writer lease, and no other run's steps under resume: none)."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any, Callable, Optional

from ringtrain.checkpoint import CheckpointStore, LoadedCheckpoint, open_store
from ringtrain.checkpoint.layout import CHECKPOINT_FORMAT, split_checkpoint_uri
from ringtrain.checkpoint.lease import STORE_KEY, Holder, WriterLease
from ringtrain.checkpoint.s3_access import check_reachable
from ringtrain.checkpoint.sources import store_of_run
from ringtrain.config import MODEL_DEFAULTS, JobConfig
from ringtrain.errors import ConfigError, RingtrainError
from ringtrain.hf.hfconfig import read_hf_config

log = logging.getLogger(__name__)

FORMAT = CHECKPOINT_FORMAT
# Model fields that change the shape of the state; activation checkpointing does not.
_SHAPE_FIELDS = (
    "vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn_dim",
    "qkv_bias", "o_bias", "mlp_bias", "qk_norm", "tie_embeddings",
    "norm_style", "activation", "scale_embeddings",
)
# The block's style keys (Gemma's), added after the first checkpoints: a meta without one was
# written by a Llama-style block.
_STYLES = ("norm_style", "activation", "scale_embeddings")
# Switches added after the first checkpoints were written: a meta without one was written by a
# model that did not have the feature.
_SWITCHES = ("qkv_bias", "o_bias", "mlp_bias", "qk_norm", "tie_embeddings")


def store_uri(job: JobConfig, run_dir: Path) -> str:
    """The store the run being started writes to and resumes from (its folder by its real path)."""
    return store_of_run(job.checkpoint.uri, run_dir.resolve())


def open_job_store(uri: str, job: JobConfig, key: str = "checkpoint.uri") -> CheckpointStore:
    """The store at ``uri``; ConfigError naming ``key`` when it cannot be used: a bad URI, or an
    S3 store whose credentials, endpoint or bucket fail (checked here, before any cluster)."""
    try:
        store = open_store(uri, keep=job.checkpoint.keep)
    except ValueError as exc:
        raise ConfigError(key, str(exc)) from None
    check_reachable(uri, key)
    return store


def checkpoint_meta(job: JobConfig) -> dict[str, Any]:
    """What a checkpoint records about the job that wrote it (the dp it was taken at is informative
    only: fragments load at any dp).

    ``job`` is resolved (``ringtrain.hf.resolve_job``). Besides the shape a resume checks, the
    meta carries what ``ringtrain export`` needs to write a Hugging Face folder without the job:
    the whole model section, the sequence length trained, and the source model's config.json
    and folder (its tokenizer is copied from there).
    """
    return {
        "format": FORMAT,
        "job": job.name,
        "model": model_shape(job),
        "model_config": model_section(job),
        "hf_config": read_hf_config(job.model.hf) if job.model.hf else None,
        "hf_source": str(Path(job.model.hf).resolve()) if job.model.hf else None,
        "dp": job.topology.dp,
        "cp": job.topology.cp,
        "zero_stage": job.zero.stage,
        "seq_len": job.data.seq_len,
        "global_batch": job.train.global_batch,
    }


def model_section(job: JobConfig) -> dict[str, Any]:
    """``job.model`` as plain data, with the dims a from-scratch job derives filled in."""
    section = dataclasses.asdict(job.model)
    section.update(ffn_dim=job.ffn_dim, head_dim=job.head_dim)
    if job.model.hf:
        section["hf"] = str(Path(job.model.hf).resolve())
    return section


def model_shape(job: JobConfig) -> dict[str, Any]:
    fields = dataclasses.asdict(job.model)
    shape = {k: fields[k] for k in _SHAPE_FIELDS}
    shape.update(ffn_dim=job.ffn_dim, head_dim=job.head_dim)
    for key in _SWITCHES:
        shape[key] = bool(shape[key])
    for key in _STYLES:
        shape[key] = MODEL_DEFAULTS[key] if shape[key] is None else shape[key]
    return shape


def _with_old_defaults(shape: Any) -> dict[str, Any]:
    """A checkpoint's model shape with the keys older checkpoints lack set to what they meant
    then: no switches, and a head dim of dim / n_heads."""
    out = dict(shape) if isinstance(shape, dict) else {}
    for key in _SWITCHES:
        out.setdefault(key, False)
    for key in _STYLES:
        out.setdefault(key, MODEL_DEFAULTS[key])
    dim, heads = out.get("dim"), out.get("n_heads")
    if "head_dim" not in out and isinstance(dim, int) and isinstance(heads, int) and heads > 0:
        out["head_dim"] = dim // heads
    return out


def incompatibility(job: JobConfig) -> Callable[[Any], Optional[str]]:
    """A check for ``latest_valid``: why a checkpoint's meta cannot be loaded into ``job``."""
    expected = model_shape(job)

    def check(meta: Any) -> Optional[str]:
        if meta.get("format") != FORMAT:
            return f"format {meta.get('format')!r}, expected {FORMAT!r}"
        theirs = _with_old_defaults(meta.get("model", {}))
        diffs = [f"model.{k}={theirs.get(k)} (this job: {v})" for k, v in expected.items() if theirs.get(k) != v]
        return "incompatible model: " + ", ".join(diffs) if diffs else None

    return check


# Opens the store at a URI, a ConfigError naming the key when it cannot be used (open_job_store).
StoreOpener = Callable[[str, str], CheckpointStore]


def open_checkpoints(
    job: JobConfig, run_dir: Path, say: Callable[[str], None]
) -> tuple[Optional[LoadedCheckpoint], Optional[CheckpointStore]]:
    """Before any cluster: the checkpoint the run resumes (``find_resume_point``; None from step
    0) and the store it writes (None when it takes no snapshots). A store the resume reads and
    the run writes, as under ``checkpoint.resume=auto``, is opened and checked once."""
    opened: dict[str, CheckpointStore] = {}

    def open_once(uri: str, key: str) -> CheckpointStore:
        if uri not in opened:
            opened[uri] = open_job_store(uri, job, key)
        return opened[uri]

    resume_from = find_resume_point(job, run_dir, say, open_once)
    store = open_once(store_uri(job, run_dir), "checkpoint.uri") if job.checkpoint.snapshot_every else None
    return resume_from, store


def find_resume_point(
    job: JobConfig, run_dir: Path, say: Callable[[str], None], open_with: Optional[StoreOpener] = None
) -> Optional[LoadedCheckpoint]:
    """The checkpoint ``checkpoint.resume`` asks for, or None to start from step 0; its store is
    opened by ``open_with`` (``open_job_store`` by default).

    ``auto`` starts fresh only when the store holds no checkpoint at all; a store whose every
    checkpoint is damaged or incompatible, or an explicit uri with nothing valid, is an error:
    a resume never silently becomes a fresh start.
    """
    mode = job.checkpoint.resume
    if mode == "none":
        return None
    uri = store_uri(job, run_dir) if mode == "auto" else mode
    check = incompatibility(job)
    store_at, step = split_checkpoint_uri(uri)
    key = "checkpoint.resume"
    store = open_with(store_at, key) if open_with is not None else open_job_store(store_at, job, key)
    if step is not None:
        try:
            loaded = store.load(step, verify=True, eager=True)
        except RingtrainError as exc:
            raise ConfigError("checkpoint.resume", f"cannot load {uri}: {exc}") from None
        reason = check(loaded.meta)
        if reason:
            raise ConfigError("checkpoint.resume", f"{uri}: {reason}")
        return loaded
    loaded = store.latest_valid(check)
    for skipped in store.skipped:
        say(f"skipping checkpoint {skipped.uri}: {skipped.reason}")
    if loaded is not None:
        return loaded
    # Committed checkpoints only: a save that died before its manifest is not a checkpoint.
    if mode == "auto" and not store.list():
        say(f"checkpoint.resume=auto: no checkpoint in {uri} yet, starting from step 0")
        return None
    raise ConfigError("checkpoint.resume", f"no valid checkpoint in {uri}" + ("" if store.skipped else " (it is empty)"))


def check_no_other_steps(job: JobConfig, store: CheckpointStore) -> None:
    """Under ``checkpoint.resume=none`` this run starts at step 0: a store that already holds
    committed checkpoints holds another run's, which this run would replace step by step and
    whose older steps its retention would delete."""
    if job.checkpoint.resume != "none":
        return
    found = store.list()
    if found:
        steps = ", ".join(str(ref.step) for ref in found[:5]) + (", ..." if len(found) > 5 else "")
        raise ConfigError(
            STORE_KEY,
            f"{store.uri} holds another run's checkpoints (steps {steps}), which checkpoint.resume=none would replace "
            "and delete: resume that run (checkpoint.resume=auto), or give this run another checkpoint.uri",
        )


def store_claim(job: JobConfig, store: Optional[CheckpointStore], run_dir: Path) -> Optional[WriterLease]:
    """This run's claim to write ``store``, checked before any cluster starts without writing a
    byte: LeaseHeld when another run holds the store's writer lease, ConfigError when the store
    holds another run's steps. Returns the lease to take (``take_store``) once the run starts;
    None without a store (no snapshots taken)."""
    if store is None:
        return None
    lease = WriterLease(store.backend, Holder.this_process(job.name, str(run_dir.resolve())), job.checkpoint.lease_s)
    lease.check_free()
    check_no_other_steps(job, store)
    return lease


def take_store(job: JobConfig, store: CheckpointStore, lease: WriterLease) -> None:
    """Acquire the lease and renew it from now on (``lease.stop()`` releases it); the store is
    checked again under it, for a run that wrote there since ``store_claim`` looked."""
    lease.acquire()
    lease.start()
    try:
        check_no_other_steps(job, store)
    except BaseException:
        lease.stop()
        raise
