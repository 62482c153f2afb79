"""Reading a YAML config file within bounds: its size, its nesting and what its aliases expand to.

A job file is a few KB of keys, but YAML lets a few lines describe far more: an alias (``*a``)
repeats an anchored value, so ten lines of aliases of aliases ("billion laughs") describe 10^9
values. PyYAML builds them as shared references, cheaply; OmegaConf copies every one out, which
takes memory and time without bound. So the plain data is measured first, each shared value
counted once per reference, and a file past the bounds is refused naming it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from ringtrain.errors import ConfigError, first_line

# Far above any real job (the largest, a chaos schedule or a model's layer_types, hold hundreds
# of values) and far below what would cost a user noticeable time or memory to expand.
MAX_FILE_BYTES = 1 << 20
MAX_VALUES = 100_000
MAX_DEPTH = 32


def read_mapping(path: Path, key: str = "config") -> dict[str, Any]:
    """The mapping a YAML config file holds, bounded; a ConfigError naming ``key`` and the file
    when it is missing, too big, not YAML, not a mapping, or expands past the bounds."""
    if not path.is_file():
        raise ConfigError(key, f"no such job file: {path}")
    size = path.stat().st_size
    if size > MAX_FILE_BYTES:
        raise ConfigError(key, f"{path} is {size:,} bytes; a config file holds at most {MAX_FILE_BYTES:,}")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise ConfigError(key, f"{path}{yaml_problem(exc)}") from None
    except RecursionError:
        raise ConfigError(key, f"{path} nests deeper than {MAX_DEPTH} levels") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(key, f"{path} is not UTF-8 text: {exc.reason} at byte {exc.start}") from None
    except OSError as exc:  # unreadable: permissions, a file gone since the check
        raise ConfigError(key, f"{path} cannot be read: {exc.strerror or exc}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(key, f"{path} must hold a mapping of config keys at the top level")
    check_bounds(data, str(path), key)
    return data


def yaml_problem(exc: yaml.YAMLError) -> str:
    """What PyYAML found wrong, where: ``:LINE:COLUMN: not valid YAML: PROBLEM (CONTEXT at line
    N)``, lines and columns counted from 1 as editors do; without a position, ``: not valid
    YAML: FIRST LINE``."""
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None)
    if mark is None or not problem:
        return f": not valid YAML: {first_line(exc)}"
    context, context_mark = getattr(exc, "context", None), getattr(exc, "context_mark", None)
    where = f" ({context} at line {context_mark.line + 1})" if context and context_mark is not None else ""
    return f":{mark.line + 1}:{mark.column + 1}: not valid YAML: {problem}{where}"


def check_bounds(data: Any, where: str, key: str = "config") -> None:
    """ConfigError naming ``key`` and ``where`` when plain ``data`` (YAML's output) holds more
    than MAX_VALUES values once its aliases are expanded, nests deeper than MAX_DEPTH, or holds
    itself (a recursive alias). Time: linear in the distinct values, whatever they expand to."""
    expanded: dict[int, int] = {}  # id of a container -> the values it expands to
    open_ids: set[int] = set()  # the containers being measured: one met again holds itself

    def measure(value: Any, depth: int) -> int:
        if not isinstance(value, (dict, list)):
            return 1
        known = expanded.get(id(value))
        if known is not None:
            return known
        if id(value) in open_ids:
            raise ConfigError(key, f"{where} holds a value that contains itself (a recursive YAML alias)")
        if depth >= MAX_DEPTH:
            raise ConfigError(key, f"{where} nests deeper than {MAX_DEPTH} levels")
        open_ids.add(id(value))
        total = 1
        for item in value.values() if isinstance(value, dict) else value:
            total += measure(item, depth + 1)
            if total > MAX_VALUES:
                raise ConfigError(
                    key,
                    f"{where} holds more than {MAX_VALUES:,} values, counting what each YAML alias "
                    "(*name) repeats; a config needs far fewer (an alias bomb?)",
                )
        open_ids.discard(id(value))
        expanded[id(value)] = total
        return total

    measure(data, 0)
