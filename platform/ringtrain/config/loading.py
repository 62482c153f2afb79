"""Loading the job config: a YAML file and ``key=value`` overrides merged onto the schema by
OmegaConf, unknown keys and bad values turned into ``ConfigError``s naming the key."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Optional

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf import errors as oc_errors

from ringtrain.config.checks import validate
from ringtrain.config.interpolation import refuse_resolvers
from ringtrain.config.schema import MODEL_DEFAULTS, JobConfig, checkpointing_mode
from ringtrain.errors import ConfigError

# The resolved config a run directory keeps, loadable again with ``load`` (and ``ringtrain run``).
RUN_CONFIG = "config.yaml"

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
    refuse_resolvers(dataclasses.asdict(job))
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
    refuse_resolvers(dataclasses.asdict(new))
    new.model.activation_checkpointing = checkpointing_mode(new.model.activation_checkpointing)
    fill_model_defaults(new)
    return new


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
    # Before the merge resolves anything: a resolver must not run even once.
    refuse_resolvers(layer, str(path))
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
    refuse_resolvers(layer, "the overrides")
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
