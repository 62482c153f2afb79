"""What ``train.preference.reference`` names, checked before any cluster: DPO's and IPO's
reference model, its weights for the workers and its identity for the table's key.

``initial`` is the run's own starting weights (its ``model.hf``, or the seeded initialisation of
a model trained from scratch); anything else is a SOURCE as ``ringtrain eval`` reads one (a
Hugging Face model folder, a run directory, a checkpoint URI: ``eval_source``). The reference
is scored in the model's place (no second model is held), so it must be the model's shape and
vocabulary, and speak its tokenizer: else exit 2 naming the key.

An identity says which weights a table was taken from: a folder by its path and its weight
files' sizes and modification times (hashing gigabytes of weights would cost more than the
pass), a checkpoint by its URI, step and shards' checksums, a seeded start by its seed, scale
and shape.

A checkpoint's weights are not held on the driver (``CheckpointWeights``): they are read from
its store each time they are handed to the workers, which a run whose table its store already
holds never does.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Optional

from ringtrain.checkpoint import open_store
from ringtrain.checkpoint.layout import split_checkpoint_uri
from ringtrain.commands.eval_source import EvalSource, resolve_source
from ringtrain.config import REFERENCE_INITIAL, REFERENCE_OBJECTIVES, JobConfig
from ringtrain.errors import ConfigError, RingtrainError
from ringtrain.train.reference_input import REFERENCE_KEY, ReferenceWeights

# The files of a model folder whose change makes another model.
_WEIGHT_FILES = ("*.safetensors", "*.safetensors.index.json", "config.json")


@dataclasses.dataclass(frozen=True)
class CheckpointWeights(ReferenceWeights):
    """A checkpoint's weights, read from its store (every rank's shards, checked against the
    manifest) only as they leave the driver, pickled for the workers (``ray.put``), and again
    each time: ``shards`` stays empty here, and a worker is handed a plain ``ReferenceWeights``
    of the shards. The checkpoint's shards must still be those it had when it was resolved."""

    checkpoint: str = ""  # the checkpoint's URI, ``<store>/step-<n>``
    checksums: tuple[str, ...] = ()  # its shards' checksums, sorted (the identity's)

    def read(self) -> ReferenceWeights:
        """The weights themselves; RingtrainError when the checkpoint changed since."""
        store_uri, step = split_checkpoint_uri(self.checkpoint)
        assert step is not None, self.checkpoint
        loaded = open_store(store_uri).load(step)
        if sorted(entry.checksum for entry in loaded.manifest.shards.values()) != list(self.checksums):
            raise RingtrainError(f"{REFERENCE_KEY}: {self.checkpoint} holds other shards than when the run began")
        return ReferenceWeights(self.where, shards=tuple(loaded.shards[name] for name in sorted(loaded.shards)))

    def __reduce__(self) -> tuple[Any, ...]:
        weights = self.read()
        return (ReferenceWeights, (weights.where, weights.folder, weights.shards))


@dataclasses.dataclass(frozen=True)
class ResolvedReference:
    identity: dict[str, Any]
    weights: Optional[ReferenceWeights]  # None: the starting weights


def resolve_reference(job: JobConfig) -> Optional[ResolvedReference]:
    """The job's reference (``job`` resolved against its ``model.hf``), None when its objective
    needs none; ConfigError naming the key when it cannot stand in for the model."""
    if job.train.objective not in REFERENCE_OBJECTIVES:
        return None
    text = job.train.preference.reference
    if text == REFERENCE_INITIAL:
        return ResolvedReference(initial_identity(job), None)
    try:
        source = resolve_source(text, eager=False)  # the shards are read only where a world needs them
    except ConfigError as exc:
        raise ConfigError(REFERENCE_KEY, exc.reason) from None
    check_fits(job, source, text)
    if source.checkpoint is None:
        folder = source.tokenizer_folder
        return ResolvedReference({"folder": folder_identity(folder)}, ReferenceWeights(source.where, folder=folder))
    loaded = source.checkpoint
    checksums = sorted(entry.checksum for entry in loaded.manifest.shards.values())
    identity = {"checkpoint": loaded.uri, "step": loaded.step, "shards": checksums}
    return ResolvedReference(identity, CheckpointWeights(source.where, checkpoint=loaded.uri, checksums=tuple(checksums)))


def initial_identity(job: JobConfig) -> dict[str, Any]:
    """The starting weights of ``job``: its ``model.hf`` folder, or its seeded initialisation."""
    from ringtrain.actors.resume import model_shape

    if job.model.hf:
        return {"initial": folder_identity(job.model.hf)}
    return {"initial": {"seed": job.train.seed, "init_std": job.model.init_std, "model": model_shape(job)}}


def folder_identity(folder: str) -> dict[str, Any]:
    """A model folder's path and its weight files' names, sizes and modification times."""
    root = Path(folder).resolve()
    files = sorted({p for pattern in _WEIGHT_FILES for p in root.glob(pattern) if p.is_file()})
    return {"path": str(root), "files": [[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in files]}


def check_fits(job: JobConfig, source: EvalSource, text: str) -> None:
    """ConfigError naming the key when ``source``'s model is not ``job``'s shape and vocabulary,
    or was trained on another tokenizer."""
    from ringtrain.actors.resume import model_shape
    from ringtrain.hf import resolve_job

    try:
        theirs = model_shape(resolve_job(source.job))
    except ConfigError as exc:
        raise ConfigError(REFERENCE_KEY, f"{text}: {exc.reason}") from None
    mine = model_shape(job)
    if theirs["vocab_size"] != mine["vocab_size"]:
        raise ConfigError(REFERENCE_KEY, f"{text} has a vocabulary of {theirs['vocab_size']} tokens, the model "
                          f"{mine['vocab_size']}: a reference scores the model's own token ids")
    diffs = [f"{k}={theirs.get(k)} (the model's: {v})" for k, v in mine.items() if theirs.get(k) != v]
    if diffs:
        raise ConfigError(REFERENCE_KEY, f"{text} is another architecture ({', '.join(diffs)}): the reference is "
                          "scored in the model's place, so it must have the model's shape")
    # A bare model folder says nothing of its tokens without a tokenizer.json; a run's data does.
    ref_tok = _tokenizer(source.job, source.tokenizer_folder, trained=source.checkpoint is not None)
    model_tok = _tokenizer(job, job.model.hf, trained=True)
    if ref_tok is not None and model_tok is not None and ref_tok.sha256 != model_tok.sha256:
        raise ConfigError(REFERENCE_KEY, f"{text} speaks another tokenizer: {ref_tok.where} (sha256 "
                          f"{ref_tok.sha256[:12]}), not {model_tok.where} (sha256 {model_tok.sha256[:12]})")
    if source.checkpoint is None:
        from ringtrain.hf.weights import check_pretrained

        check_pretrained(job, folder=source.tokenizer_folder, key=REFERENCE_KEY)


def _tokenizer(job: JobConfig, folder: str, *, trained: bool) -> Any:
    """A model's tokenizer identity: its folder's tokenizer.json, else (``trained``) that of the
    data it trains or trained on; None when neither says."""
    from ringtrain.train.dataset_tokenizer import folder_tokenizer, trained_tokenizer
    from ringtrain.train.mixture import source_specs

    found = folder_tokenizer(folder, REFERENCE_KEY)
    return found if found is not None or not trained else trained_tokenizer(source_specs(job)[0].path)
