"""The schema's dotted keys, and the one a mistyped key most likely meant ("did you mean").

Keys are spelled as a ConfigError names them: ``train.lr``, ``data.sources[0].path``; a list of
sections contributes its element's keys once, with ``[]`` where the index goes.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import re
import typing
from collections.abc import Iterator
from typing import Any, Optional

from ringtrain.config.schema import JobConfig

# An index as a user writes it, ``[3]`` or ``.3``; and as the key list holds it.
_INDEX = re.compile(r"\[(-?\d+)\]|\.(-?\d+)(?=\.|$)")
_ANY_INDEX = "[]"


@functools.lru_cache(maxsize=1)
def schema_keys() -> tuple[str, ...]:
    """Every key of the job schema, sections and leaves, in declaration order."""
    return tuple(_keys_of(JobConfig, ""))


def _keys_of(cls: Any, prefix: str) -> Iterator[str]:
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        kind, args = hints[f.name], typing.get_args(hints[f.name])
        yield f"{prefix}{f.name}"
        if dataclasses.is_dataclass(kind):
            yield from _keys_of(kind, f"{prefix}{f.name}.")
        elif typing.get_origin(kind) is list and args and dataclasses.is_dataclass(args[0]):
            yield from _keys_of(args[0], f"{prefix}{f.name}{_ANY_INDEX}.")


def did_you_mean(key: str) -> Optional[str]:
    """The schema key closest to ``key`` (with the user's own list indices), or None when
    nothing is close enough to be a likely typo."""
    indices = [a or b for a, b in _INDEX.findall(key)]
    pattern = _INDEX.sub(_ANY_INDEX, key)
    found = difflib.get_close_matches(pattern, schema_keys(), n=1, cutoff=0.75)
    if not found or found[0] == pattern:
        return None
    suggestion = found[0]
    for index in indices:
        suggestion = suggestion.replace(_ANY_INDEX, f"[{index}]", 1)
    return suggestion.replace(_ANY_INDEX, "[0]")
