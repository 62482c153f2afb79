"""EvalSource: what ``ringtrain eval`` scores, from the SOURCE a user names.

Three kinds: a Hugging Face model folder (``config.json``: the model and its weights), a run
directory (``config.yaml`` gives the model, its newest durable checkpoint the weights), or a
checkpoint URI (``file://`` or ``s3://``, a store or one ``step-N`` in it, or a local folder of
either). A checkpoint carries only the model's shape, so the config beside it is used when the
store sits in a run directory; elsewhere the model keys not in the checkpoint take their
defaults, and ``model.*`` overrides set the rest.

These files may be someone else's (a shared run folder, a store from elsewhere), so what they
say is the model and nothing more: a run's ``config.yaml`` never chooses the cluster
(``config.load_saved`` drops its ``cluster`` section), and a checkpoint's meta gives only keys
of the model section, as values, never as override text.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Optional

from ringtrain import config, uris
from ringtrain.checkpoint import LoadedCheckpoint
from ringtrain.checkpoint.layout import parse_step_dir, split_checkpoint_uri
from ringtrain.checkpoint.sources import NoCheckpoint, open_source
from ringtrain.config import JobConfig
from ringtrain.errors import ConfigError

KEY = "SOURCE"
ACCEPTS = (
    "eval takes a run directory (config.yaml), a checkpoint store or one of its step-N folders, "
    "a file:// or s3:// checkpoint URI, or a Hugging Face model folder (config.json)"
)
# Checkpoint meta (actors.resume.checkpoint_meta) -> the model keys it records: its model_config
# section may give any key of the model section but hf (the weights are the checkpoint's, and a
# folder named there is not read); the shape older checkpoints recorded, these.
_META_MODEL_FIELDS = tuple(f.name for f in dataclasses.fields(config.ModelConfig) if f.name != "hf")
_META_SHAPE_KEYS = ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim")


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


def resolve_source(text: str, *, eager: bool = True) -> EvalSource:
    """The model behind SOURCE; a ConfigError naming SOURCE when there is none. ``eager``: a
    checkpoint's shards are read and checked now (a store's newest damaged one passed over);
    without it only its manifest, the shards on access."""
    if text.startswith(uris.SCHEMES):
        return _from_checkpoint(text, eager)
    path = Path(text)
    if not path.exists():
        raise ConfigError(KEY, f"no such run directory, checkpoint or model folder: {text}")
    if (path / "config.json").is_file():
        return _from_hf(path)
    if (path / config.RUN_CONFIG).is_file():
        return _from_run(path, eager)
    if path.is_dir():
        if split_checkpoint_uri(str(path))[1] is None and not _holds_checkpoints(path):
            raise ConfigError(KEY, f"{text} is {_what_folder(path)}, not a model: {ACCEPTS}")
        return _from_checkpoint(path.resolve().as_uri(), eager)
    raise ConfigError(KEY, f"{text} is a file; give a run directory, a checkpoint or a Hugging Face model folder")


def _holds_checkpoints(folder: Path) -> bool:
    """A checkpoint store: step-N folders in it (valid or not, which loading tells apart)."""
    return any(parse_step_dir(entry.name) is not None for entry in folder.iterdir())


def _what_folder(folder: Path) -> str:
    names = sorted(entry.name for entry, _ in zip(folder.iterdir(), range(4)))
    if not names:
        return "an empty folder"
    shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
    return f"a folder of other files ({shown})"


def _from_hf(folder: Path) -> EvalSource:
    # As data, not override text: a folder named "a #1" or "[x]" is still that folder.
    job = config.from_mapping({"model": {"hf": str(folder.resolve())}}, str(folder))
    return EvalSource("hf", job, str(folder.resolve()), where=f"Hugging Face model {folder}")


def _from_run(run_dir: Path, eager: bool) -> EvalSource:
    from ringtrain.actors.resume import incompatibility

    job = config.load_saved(run_dir / config.RUN_CONFIG, KEY)
    try:
        found = open_source(str(run_dir.absolute()), key=KEY, accept=incompatibility(job), eager=eager)
    except NoCheckpoint as exc:
        raise ConfigError(
            KEY,
            f"{run_dir} has no valid durable checkpoint in {exc.store_uri} "
            f"({exc.detail}; checkpoint.persist_every writes them)",
        ) from None
    loaded = found.checkpoint
    return _with_checkpoint("run", job, loaded, f"run {run_dir}, step {loaded.step}")


def _from_checkpoint(uri: str, eager: bool) -> EvalSource:
    from ringtrain.actors.resume import incompatibility

    loaded = open_source(uri, key=KEY, eager=eager).checkpoint
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
    return config.load_saved(config_file, KEY) if config_file.is_file() else None


def _job_of_meta(meta: Any) -> JobConfig:
    """The job a bare checkpoint was trained with, as far as its meta says: the whole model
    section (rope scaling and all) when it recorded one, else the shape of older checkpoints.
    Only the allowed model keys are read, and their values go in as data: a meta key such as
    ``hf=/elsewhere`` or a value holding ``=`` or a newline sets nothing else."""
    section = meta.get("model_config") if isinstance(meta, Mapping) else None
    model = section if isinstance(section, Mapping) else (meta.get("model") if isinstance(meta, Mapping) else None)
    allowed = _META_MODEL_FIELDS if isinstance(section, Mapping) else _META_SHAPE_KEYS
    values = {k: model[k] for k in allowed if isinstance(model, Mapping) and model.get(k) is not None}
    try:
        return config.from_mapping({"model": values}, "the checkpoint's meta")
    except ConfigError as exc:
        raise ConfigError(KEY, f"the checkpoint's meta gives a model config that is not valid: {exc}") from None
