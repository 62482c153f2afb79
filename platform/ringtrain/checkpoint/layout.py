"""Where a checkpoint's objects live: step folder names and the keys of shards and manifests.

A checkpoint of step ``s`` is the folder ``step-<s:09d>/`` under the store's root, holding one
object per shard (its name is the key below the folder, so ``params/layers.0.wq`` becomes a
nested path) and ``manifest.json``. Keys are the same on every backend, so a checkpoint copied
between a file system and a bucket keeps its layout.

Shard names are checked before anything is written, because the same names come back out of a
manifest on load and must never address an object outside their checkpoint's folder.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Optional

MANIFEST_NAME = "manifest.json"
# What a training checkpoint says it holds (its manifest meta's ``format``): shards that are
# train/snapshot.py's encoding of each rank's fragments in parameter coordinates.
CHECKPOINT_FORMAT = "ringtrain-fragments-v1"
# The file backend writes each object under this prefix first and renames it into place.
TEMP_PREFIX = ".tmp-"
STEP_DIGITS = 9
_STEP_DIR = re.compile(r"^step-(\d{9,})$")
_CHECKPOINT_URI = re.compile(r"^(?P<store>.+)/step-(?P<step>\d+)/?$")
# File systems cap one path component at 255 bytes; S3 caps a whole key at 1024 bytes, and the
# root prefix and step folder take part of that budget.
_MAX_COMPONENT_BYTES = 255
_MAX_NAME_BYTES = 900


def check_step(step: int) -> int:
    """``step`` itself if it can name a checkpoint; steps past 9 digits simply get wider names."""
    if isinstance(step, bool) or not isinstance(step, int):
        raise TypeError(f"checkpoint step must be an int, got {type(step).__name__}")
    if step < 0:
        raise ValueError(f"checkpoint step must be >= 0, got {step}")
    return step


def step_dir(step: int) -> str:
    return f"step-{check_step(step):0{STEP_DIGITS}d}"


def parse_step_dir(name: str) -> Optional[int]:
    """The step a folder name denotes, or None when it is not one this layout writes.

    Only the canonical spelling counts (``step-000000012``, not ``step-0000000012``), so that
    one step maps to exactly one folder even past 9 digits.
    """
    match = _STEP_DIR.match(name)
    if match is None:
        return None
    step = int(match.group(1))
    return step if step_dir(step) == name else None


def split_checkpoint_uri(uri: str) -> tuple[str, Optional[int]]:
    """``<store>/step-<n>`` -> (store, n): a URI naming one checkpoint; any other -> (uri, None),
    a store whose newest valid checkpoint is meant."""
    match = _CHECKPOINT_URI.match(uri)
    return (match.group("store"), int(match.group("step"))) if match else (uri, None)


def manifest_key(step: int) -> str:
    return f"{step_dir(step)}/{MANIFEST_NAME}"


def shard_key(step: int, name: str) -> str:
    return f"{step_dir(step)}/{name}"


def shard_name_problem(name: object) -> Optional[str]:
    """Why ``name`` cannot be a shard name, or None when it can."""
    if not isinstance(name, str):
        return f"shard names must be str, got {type(name).__name__}"
    if not name:
        return "shard name is empty"
    if len(name.encode("utf-8")) > _MAX_NAME_BYTES:
        return f"shard name is longer than {_MAX_NAME_BYTES} bytes"
    if name == MANIFEST_NAME:
        return f"{MANIFEST_NAME!r} is reserved for the manifest"
    if "\\" in name or any(ord(ch) < 0x20 or ord(ch) == 0x7F for ch in name):
        return "shard names may not hold backslashes or control characters"
    for part in name.split("/"):
        if part in ("", ".", ".."):
            return "shard names may not start or end with '/', hold '//', or use '.' or '..' components"
        if part.startswith(TEMP_PREFIX):
            return f"path components starting with {TEMP_PREFIX!r} are reserved"
        if len(part.encode("utf-8")) > _MAX_COMPONENT_BYTES:
            return f"path component {part[:32]!r}... is longer than {_MAX_COMPONENT_BYTES} bytes"
    return None


def check_shard_names(names: Iterable[str]) -> None:
    """Raise ValueError naming the first shard name that cannot be stored on every backend.

    Besides each name on its own, no name may be a folder of another (``a`` and ``a/b``): a
    bucket holds both, but a file system cannot.
    """
    seen: set[str] = set()
    for name in names:
        problem = shard_name_problem(name)
        if problem is not None:
            raise ValueError(f"shard name {name!r}: {problem}")
        seen.add(name)
    for name in seen:
        parts = name.split("/")
        for depth in range(1, len(parts)):
            folder = "/".join(parts[:depth])
            if folder in seen:
                raise ValueError(f"shard name {folder!r} is also a folder of shard {name!r}")
