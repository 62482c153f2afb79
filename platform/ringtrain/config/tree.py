"""The leaves of a config tree (plain data: dicts, lists, scalars) with their dotted keys, the
spelling a ConfigError names them by: ``train.lr``, ``data.sources[0].weight``."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any


def leaves(value: Any, key: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted key, value) of every scalar below ``value``, in document order."""
    if isinstance(value, dict):
        for name, item in value.items():
            yield from leaves(item, f"{key}.{name}" if key else str(name))
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from leaves(item, f"{key}[{i}]")
    else:
        yield key, value
