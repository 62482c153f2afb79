"""``key=value`` overrides: parsed, checked and applied one at a time onto the merged config tree.

Each is applied where it points in the tree the schema and the job file already built, so a key
may index a list element (``data.sources[0].path=/x`` or ``data.sources.0.path=/x``) as well
as name a section's key. Every failure is a ConfigError naming the override's key, never an
exception of OmegaConf's with its internals.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Union

from omegaconf import DictConfig, OmegaConf
from omegaconf import errors as oc_errors

from ringtrain.config.interpolation import refuse_resolvers
from ringtrain.config.keys import did_you_mean
from ringtrain.config.schema import JobConfig
from ringtrain.config.yamlfile import check_bounds
from ringtrain.errors import ConfigError, first_line

SYNTAX = "overrides are key=value with no leading dashes (for example mesh.dp=2 or data.sources[0].path=/x)"
# The parts of a key: a name, ``[i]``, or ``.i`` where the tree holds a list.
_PART = re.compile(r"\[([^\]]*)\]|([^.\[\]]+)")
# The top-level keys that are sections of keys, which a plain value cannot replace.
SECTIONS = tuple(f.name for f in dataclasses.fields(JobConfig) if dataclasses.is_dataclass(f.default_factory))  # type: ignore[arg-type]


def parse(overrides: list[str]) -> list[tuple[str, Any]]:
    """(key, value) of each override, its value read as YAML as OmegaConf's dotlist reads it;
    all of them checked before any is applied."""
    parsed = []
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key.strip() or key.startswith("-"):
            raise ConfigError(item if item.strip() else repr(item), SYNTAX)
        key = key.strip()
        try:
            # One dotlist entry under a fixed key: the value is read exactly as OmegaConf reads
            # an override, without our key's brackets ever reaching its key grammar.
            value = OmegaConf.to_container(OmegaConf.from_dotlist([f"value={text}"]), resolve=False)["value"]  # type: ignore[index,call-overload]
        except Exception as exc:  # a YAML error, an alias bomb OmegaConf's own bound caught, ...
            raise ConfigError(key, f"cannot read the value {text!r}: {first_line(exc)}") from None
        check_bounds(value, "the value", key)
        refuse_resolvers({key: value}, "the overrides")
        check_section(key, value)
        parsed.append((key, value))
    return parsed


def apply(tree: DictConfig, overrides: list[tuple[str, Any]]) -> None:
    """Set each (key, value) in ``tree`` in order, merging a mapping into the section it names."""
    for key, value in overrides:
        _check_indices(tree, key)
        try:
            OmegaConf.update(tree, key, value, merge=True)
        except oc_errors.OmegaConfBaseException as exc:
            raise as_config_error(exc, key) from None
        except Exception as exc:  # OmegaConf raises plain TypeError and ValueError on some keys
            raise ConfigError(key, first_line(exc)) from None


def check_section(key: str, value: Any) -> None:
    """A plain value where the schema has a section (``mesh: 3``): name the section's key.

    OmegaConf reports this as a merge error without the key, so it is caught before merging.
    """
    if key in SECTIONS and not isinstance(value, (dict, DictConfig)):
        raise ConfigError(key, f"must be a section of keys (e.g. {key}.<key>=...), got {value!r}")


def _check_indices(tree: DictConfig, key: str) -> None:
    """An index into a list that is not there, or a name where the tree holds a list: OmegaConf
    would try to make the element and fail with its own types' names."""
    node: Any = OmegaConf.to_container(tree, resolve=False)
    walked = ""
    for bracketed, name in _PART.findall(key):
        part = bracketed or name
        if isinstance(node, list):
            if not re.fullmatch(r"-?\d+", part):
                raise ConfigError(walked, f"is a list: name an element by its index ({walked}[0]), or set the whole list")
            index = int(part)
            if not -len(node) <= index < len(node):
                raise ConfigError(
                    f"{walked}[{index}]",
                    f"{walked} has {len(node)} element{'s' if len(node) != 1 else ''}, so there is no [{index}]: "
                    f"set the whole list instead ({walked}=[...])",
                )
            node, walked = node[index], f"{walked}[{index}]"
        elif isinstance(node, dict) and part in node:
            node, walked = node[part], f"{walked}.{part}" if walked else part
        else:
            return  # a new key of a mapping, or not a container: OmegaConf says what is wrong


def as_config_error(exc: oc_errors.OmegaConfBaseException, key: Union[str, None] = None) -> ConfigError:
    """An OmegaConf error as a ConfigError naming the key it concerns (with a likely meant one
    when the key is unknown)."""
    named = getattr(exc, "full_key", None) or key or "config"
    if isinstance(exc, (oc_errors.ConfigKeyError, oc_errors.ConfigAttributeError)):
        guess = did_you_mean(key or named)
        return ConfigError(named, f"unknown key (did you mean {guess}?)" if guess else "unknown key")
    if isinstance(exc, oc_errors.ValidationError) and "is not Optional" in str(exc):
        return ConfigError(named, "needs a value: an empty one means null here (write '' for an empty string)")
    # OmegaConf's first line says what was wrong ("Value 'abc' of type 'str' could not be
    # converted to Integer"); the lines after it repeat the key and internal type names.
    return ConfigError(named, first_line(getattr(exc, "msg", "") or exc))
