"""What a submitted job's working_dir holds: the job file and the input paths it declares, never
a hidden file.

Ray packs a job's working_dir into a zip, stores it on the cluster and unpacks it for the driver
and every worker, so whatever lies in it is readable by anyone who runs code there. Shipping
the job file's whole folder would send along whatever happens to sit next to it: a ``.env``, an
``.aws`` folder, notes. The working_dir is therefore a fresh folder made for the submission,
holding the job file and, at the same relative places, the local inputs its config names by a
relative path (``data.path``, ``data.sources[i].path``, ``eval.data``, ``model.hf``), which the
job reads relative to its working_dir. Absolute paths and URIs are the cluster's to resolve and
are not shipped.

Refused, naming the key: a relative input that does not exist, that leaves the job file's
folder, that names a hidden file or folder, that holds a link to somewhere outside the job
file's folder (it would ship the link's target), or that reaches its files through such a link
(``data.path=shared/corpus`` where ``shared`` links elsewhere). Every file is placed from its
resolved path, checked again as it is placed. Inside a shipped folder, hidden entries and
compiled leftovers are left out.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ringtrain.config import JobConfig
from ringtrain.errors import ConfigError
from ringtrain.inputs import input_paths, is_relative_local

# Never useful on the cluster, and different on every machine.
LEFT_OUT_NAMES = ("__pycache__",)
LEFT_OUT_SUFFIXES = (".pyc",)


def hidden(name: str) -> bool:
    return name.startswith(".") and name not in (".", "..")


def shipped_inputs(job_path: Path, job: JobConfig) -> list[Path]:
    """The inputs to ship, relative to the job file's folder; ConfigError for one that cannot be."""
    base = job_path.resolve().parent
    shipped: list[Path] = []
    for key, value in input_paths(job):
        if not is_relative_local(value):
            continue
        relative = Path(os.path.normpath(value))
        if relative.parts and relative.parts[0] == "..":
            raise ConfigError(key, f"{value} leaves the job file's folder {base}: a submitted job gets only that "
                              "folder's files; use an absolute path on storage the cluster reads, or move it")
        if any(hidden(part) for part in relative.parts):
            raise ConfigError(key, f"{value} is a hidden file or folder, which a submission never ships")
        source = base / relative
        if not source.exists():
            raise ConfigError(key, f"{value} does not exist next to the job file (looked for {source})")
        _check_links(key, source, base)
        shipped.append(relative)
    return shipped


def _check_links(key: str, source: Path, base: Path) -> None:
    """Everything that would be shipped must resolve inside ``base``: a link's target is what
    ships, and so is what lies behind a linked folder on the way to ``source``."""
    candidates = [source] if not source.is_dir() else [source, *_entries(source)]
    for path in candidates:
        target = path.resolve()
        if _inside(target, base):
            continue
        how = "links to" if path.is_symlink() else "passes through a link, to"
        raise ConfigError(key, f"{path} {how} {target}, outside the job file's folder {base}; "
                          "a submission would ship what it points to")


def _entries(folder: Path) -> Iterator[Path]:
    """What a shipped folder contributes: every entry below it but hidden ones and leftovers."""
    for root, dirs, files in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if _kept(d))
        for name in [*dirs, *sorted(f for f in files if _kept(f))]:
            yield Path(root) / name


def _kept(name: str) -> bool:
    return not hidden(name) and name not in LEFT_OUT_NAMES and not name.endswith(LEFT_OUT_SUFFIXES)


def _inside(path: Path, base: Path) -> bool:
    return path == base or base in path.parents


def _place(source: Path, dest: Path, base: Path) -> None:
    """A file's bytes at ``dest``: a hard link when the file system allows it (data can be
    large and is only read), else a copy; from its resolved path, which must still lie inside
    ``base`` (a link swapped in since the check is not followed out)."""
    target = source.resolve()
    if not _inside(target, base):
        raise ConfigError(str(source), f"now resolves to {target}, outside the job file's folder {base}")
    dest.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(target, dest)
    except OSError:
        shutil.copyfile(target, dest)


@contextmanager
def working_dir(job_path: Path, job: JobConfig) -> Iterator[Path]:
    """A fresh folder (mode 0700) holding exactly what the job ships; removed on exit (Ray has
    packed and uploaded it by the time ``submit_job`` returns)."""
    inputs = shipped_inputs(job_path, job)
    base = job_path.resolve().parent
    folder = Path(tempfile.mkdtemp(prefix="ringtrain-submit-"))
    try:
        # The job file is the one the user named, wherever a link of theirs leads.
        _place(job_path, folder / job_path.name, job_path.resolve().parent)
        for relative in inputs:
            source = base / relative
            if not source.is_dir():
                _place(source, folder / relative, base)
                continue
            (folder / relative).mkdir(parents=True, exist_ok=True)
            for entry in _entries(source):
                if entry.is_file():
                    _place(entry, folder / entry.relative_to(base), base)
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def listing(folder: Path) -> list[str]:
    """Every file under ``folder``, relative and sorted: what a submission ships."""
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())
