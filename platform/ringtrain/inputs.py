"""The local inputs a job's config names, and where a process that is not the driver finds them.

A job reads ``data.path``, ``data.sources[i].path``, ``eval.data`` and ``model.hf``; a relative
one means a path from the folder the job runs in. That is the same folder for the driver and its
workers on an embedded cluster (the driver starts it) and in a submitted job (Ray unpacks the
job's working_dir on every node and starts each worker in it). A driver that joins a cluster
started elsewhere has workers running from that cluster's folder, so there its relative inputs
are made absolute (``anchored``): the workers read the driver's files, as a local run does.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from ringtrain import uris
from ringtrain.config import STDLIB_CORPUS, JobConfig


def _inputs(job: JobConfig) -> list[tuple[str, Any, str]]:
    """(key, the config section holding it, its attribute) of every config key that names an
    input the job reads: the one list both functions below walk."""
    found: list[tuple[str, Any, str]] = [("data.path", job.data, "path"), ("eval.data", job.eval, "data"),
                                         ("model.hf", job.model, "hf")]
    found += [(f"data.sources[{i}].path", s, "path") for i, s in enumerate(job.data.sources)]
    return found


def input_paths(job: JobConfig) -> list[tuple[str, str]]:
    """(key, value) of every config key that names an input the job reads, set or not."""
    return [(key, getattr(section, name)) for key, section, name in _inputs(job)]


def is_relative_local(value: str) -> bool:
    """Whether an input is a local path relative to the folder the job runs in."""
    if not value or value == STDLIB_CORPUS or uris.has_scheme(value):
        return False
    return not Path(value).is_absolute() and not value.startswith("~")


def anchored(job: JobConfig, base: Path) -> JobConfig:
    """A copy of ``job`` whose relative local inputs are absolute paths under ``base``."""
    out = copy.deepcopy(job)
    for _, section, name in _inputs(out):
        value = getattr(section, name)
        if is_relative_local(value):
            setattr(section, name, str(base / value))
    return out
