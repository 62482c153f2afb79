"""Loading the job config: a YAML file and ``key=value`` overrides merged onto the schema by
OmegaConf, unknown keys, bad values and any other failure turned into ``ConfigError``s naming
the key."""

from __future__ import annotations

import dataclasses
import functools
import os
from pathlib import Path
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf
from omegaconf import errors as oc_errors

from ringtrain.config.checks import validate
from ringtrain.config.destinations import TRACKING_KEY, check_tracking_uri, override_value
from ringtrain.config.interpolation import refuse_resolvers
from ringtrain.config.overrides import SECTIONS, apply, as_config_error, check_section, parse
from ringtrain.config.schema import MODEL_DEFAULTS, JobConfig, checkpointing_mode
from ringtrain.config.yamlfile import check_bounds, read_mapping
from ringtrain.errors import ConfigError, first_line
from ringtrain.links import check_inside

# The resolved config a run directory keeps, loadable again with ``load`` (and ``ringtrain run``).
RUN_CONFIG = "config.yaml"


def load(path: Optional[str | Path] = None, overrides: Optional[list[str]] = None) -> JobConfig:
    """Build the job config from an optional YAML file and ``key=value`` overrides, then validate.
    A tracking server the file names must be one the user allows (``destinations``)."""
    layers = [_layer(read_mapping(Path(path)), str(path))] if path is not None else []
    job = _build(layers, overrides or [])
    uri = job.telemetry.mlflow.tracking_uri
    given = path is None or override_value(parse(overrides or []), TRACKING_KEY) == uri
    check_tracking_uri(uri, given_by_user=given, where=str(path), environ=os.environ)
    return job


def load_saved(path: str | Path, key: str = "config") -> JobConfig:
    """A config ringtrain wrote and now reads as the source of a model (a run directory's
    ``config.yaml``, or the one beside a checkpoint store), validated, without its ``cluster``
    section: a file in a run folder others can write must never choose the cluster a command
    joins (with the user's token, unpickling what its workers send back). The cluster is the
    user's: ``cluster.*`` overrides, RAY_ADDRESS, else an embedded one. The file must lie in
    its folder: a link out of a folder from elsewhere is refused (``links``), naming ``key``."""
    check_inside(Path(path).parent, path, key)
    data = read_mapping(Path(path))
    data.pop("cluster", None)
    return _build([_layer(data, str(path))], [])


def from_mapping(data: dict[str, Any], where: str) -> JobConfig:
    """A job from plain data read elsewhere (a checkpoint's meta), bounded, checked and
    validated as a job file's would be; ``where`` names it in errors."""
    check_bounds(data, where)
    return _build([_layer(data, where)], [])


def _build(layers: list[DictConfig], overrides: list[str]) -> JobConfig:
    parsed = parse(overrides)  # every override checked before any is applied
    try:
        merged = OmegaConf.merge(_schema(), *layers)  # merge copies its first argument
    except oc_errors.OmegaConfBaseException as exc:
        raise as_config_error(exc) from None
    apply(merged, parsed)
    job = _to_job(merged)
    fill_model_defaults(job)
    _validated(job)
    return job


@functools.lru_cache(maxsize=1)
def _schema() -> DictConfig:
    """The schema's tree, built once: building it is most of a load's time (about 30 ms)."""
    return OmegaConf.structured(JobConfig)


def _to_job(tree: DictConfig) -> JobConfig:
    """The tree as a JobConfig once its interpolations resolve; no resolver may have been left."""
    try:
        job = OmegaConf.to_object(tree)
    except oc_errors.OmegaConfBaseException as exc:
        raise as_config_error(exc) from None
    except Exception as exc:  # a value OmegaConf could not convert, found only when resolving
        raise ConfigError("config", first_line(exc)) from None
    assert isinstance(job, JobConfig)
    refuse_resolvers(dataclasses.asdict(job))
    job.model.activation_checkpointing = checkpointing_mode(job.model.activation_checkpointing)
    return job


def _validated(job: JobConfig) -> None:
    try:
        validate(job)
    except ConfigError:
        raise
    except Exception as exc:  # a check meeting a value of a shape it did not expect: still bad input
        raise ConfigError("config", f"cannot be checked: {type(exc).__name__}: {first_line(exc)}") from None


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
    _validated(new)
    return new


def merge(job: JobConfig, overrides: list[str]) -> JobConfig:
    """A copy of ``job`` with dotlist overrides applied, not yet validated: for a caller that
    derives more keys from the result before validating it (``ringtrain eval`` sizes the batch
    and the sequence to the mesh the overrides ask for)."""
    parsed = parse(overrides)
    tree = OmegaConf.structured(job)
    apply(tree, parsed)
    new = _to_job(tree)
    fill_model_defaults(new)
    return new


def _layer(data: dict[str, Any], where: str) -> DictConfig:
    """A file's (or a meta's) mapping as an OmegaConf layer, refused before anything resolves."""
    try:
        layer = OmegaConf.create(data)
    except oc_errors.OmegaConfBaseException as exc:
        raise as_config_error(exc) from None
    except Exception as exc:  # keys OmegaConf cannot hold (a list as a key, ...)
        raise ConfigError("config", f"{where}: {first_line(exc)}") from None
    # Before the merge resolves anything: a resolver must not run even once.
    refuse_resolvers(layer, where)
    for name in SECTIONS:
        if name in layer:
            check_section(name, layer[name])
    return layer
