"""EvalSource: what ``ringtrain eval`` scores, from the SOURCE a user names.

Three kinds: a Hugging Face model folder (``config.json``: the model and its weights), a run
directory (``config.yaml`` gives the model, its newest durable checkpoint the weights), or a
checkpoint URI (``file://`` or ``s3://``, a store or one ``step-N`` in it, or a local folder of
either). A checkpoint carries only the model's shape, so the config beside it is used when the
store sits in a run directory; elsewhere the model keys not in the checkpoint take their
defaults, and ``model.*`` overrides set the rest.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Optional

from ringtrain import config, uris
from ringtrain.checkpoint import LoadedCheckpoint
from ringtrain.checkpoint.layout import split_checkpoint_uri
from ringtrain.checkpoint.sources import NoCheckpoint, open_source
from ringtrain.config import JobConfig
from ringtrain.errors import ConfigError

KEY = "SOURCE"
# Checkpoint meta (actors.resume.checkpoint_meta) -> the model keys it records.
_META_MODEL_KEYS = ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim")


@dataclass(frozen=True)
class EvalSource:
    kind: str  # "hf", "run" or "checkpoint"
    job: JobConfig  # the model's job; model.hf is set only when the weights come from it
    tokenizer_folder: str  # a Hugging Face folder whose tokenizer.json to use, or ""
    checkpoint: Optional[LoadedCheckpoint] = None
    where: str = ""  # what is evaluated, for the user

    def shards(self) -> list[bytes]:
        """The checkpoint's shards in name order (every rank's, as a restore reads them)."""
        assert self.checkpoint is not None
        return [self.checkpoint.shards[name] for name in sorted(self.checkpoint.shards)]


def resolve_source(text: str) -> EvalSource:
    """The model behind SOURCE; a ConfigError naming SOURCE when there is none."""
    if text.startswith(uris.SCHEMES):
        return _from_checkpoint(text)
    path = Path(text)
    if not path.exists():
        raise ConfigError(KEY, f"no such run directory, checkpoint or model folder: {text}")
    if (path / "config.json").is_file():
        return _from_hf(path)
    if (path / config.RUN_CONFIG).is_file():
        return _from_run(path)
    if path.is_dir():
        return _from_checkpoint(path.resolve().as_uri())
    raise ConfigError(KEY, f"{text} is a file; give a run directory, a checkpoint or a Hugging Face model folder")


def _from_hf(folder: Path) -> EvalSource:
    job = config.load(None, [f"model.hf={folder.resolve()}"])
    return EvalSource("hf", job, str(folder.resolve()), where=f"Hugging Face model {folder}")


def _from_run(run_dir: Path) -> EvalSource:
    from ringtrain.actors.resume import incompatibility

    job = config.load(run_dir / config.RUN_CONFIG)
    try:
        found = open_source(str(run_dir.absolute()), key=KEY, accept=incompatibility(job), eager=True)
    except NoCheckpoint as exc:
        raise ConfigError(
            KEY,
            f"{run_dir} has no valid durable checkpoint in {exc.store_uri} "
            f"({exc.detail}; checkpoint.persist_every writes them)",
        ) from None
    loaded = found.checkpoint
    return _with_checkpoint("run", job, loaded, f"run {run_dir}, step {loaded.step}")


def _from_checkpoint(uri: str) -> EvalSource:
    from ringtrain.actors.resume import incompatibility

    loaded = open_source(uri, key=KEY, eager=True).checkpoint
    job = _job_beside(split_checkpoint_uri(uri)[0]) or _job_of_meta(loaded.meta)
    reason = incompatibility(job)(loaded.meta)
    if reason:
        raise ConfigError(KEY, f"{uri}: {reason}")
    return _with_checkpoint("checkpoint", job, loaded, f"checkpoint {loaded.uri}")


def _with_checkpoint(kind: str, job: JobConfig, loaded: LoadedCheckpoint, where: str) -> EvalSource:
    # The checkpoint holds the weights: a model.hf folder the run started from is not read again
    # (its tokenizer still is).
    weights_from_checkpoint = replace(job, model=replace(job.model, hf=""))
    return EvalSource(kind, weights_from_checkpoint, job.model.hf, loaded, where)


def _job_beside(store_uri: str) -> Optional[JobConfig]:
    """The run's config when the store is a run directory's ``checkpoints`` folder."""
    if not store_uri.startswith("file://"):
        return None
    config_file = Path(store_uri.removeprefix("file://")).parent / config.RUN_CONFIG
    return config.load(config_file) if config_file.is_file() else None


def _job_of_meta(meta: Any) -> JobConfig:
    """The job a bare checkpoint was trained with, as far as its meta says: the whole model
    section (rope scaling and all) when it recorded one, else the shape of older checkpoints."""
    section = meta.get("model_config") if hasattr(meta, "get") else None
    model = section if isinstance(section, dict) else (meta.get("model", {}) if hasattr(meta, "get") else {})
    keys = [k for k in model if k != "hf"] if isinstance(section, dict) else _META_MODEL_KEYS
    overrides = [f"model.{k}={_dotlist_value(model[k])}" for k in keys if model.get(k) is not None]
    return config.load(None, overrides)


def _dotlist_value(value: Any) -> str:
    # A dict (rope_scaling) in flow style, which an override reads back as a mapping.
    return json.dumps(value) if isinstance(value, dict) else str(value)
