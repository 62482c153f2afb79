"""Links in a folder that may come from elsewhere: a file read or copied from the folder must lie inside it.

A model folder, a corpus folder or a run folder can be someone else's, and a link in it can
point anywhere this user can read: ``merges.txt -> /proc/self/environ`` in a model folder put
the whole environment into the exported model meant for publishing, and the same link in a
corpus folder tokenized it into a dataset. So every file such a folder gives (and every folder
on the way to it) must resolve to a place inside the folder, or it is refused naming it. A link
that stays inside (``tokenizer.json -> v2/tokenizer.json``) is the folder's own, and so is one
from a Hugging Face cache snapshot (``models--org--name/snapshots/<revision>``) into its
repository's ``blobs/``, which is how that cache lays out every file. The folder itself may be
a link: the user named it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional, Union

from ringtrain.errors import ConfigError

PathLike = Union[str, Path]
# The cache folders of Hugging Face repositories (huggingface_hub's layout): a snapshot's files
# are links to ``<repository>/blobs/<hash>``.
HF_CACHE_PREFIXES = ("models--", "datasets--", "spaces--")


def homes(folder: PathLike) -> tuple[Path, ...]:
    """Where the files of ``folder`` may resolve to: the folder itself, and for a snapshot of
    the Hugging Face cache its repository's ``blobs``."""
    real = Path(folder).resolve()
    places = [real]
    if real.parent.name == "snapshots" and real.parent.parent.name.startswith(HF_CACHE_PREFIXES):
        places.append(real.parent.parent / "blobs")
    return tuple(places)


def target_outside(folder: PathLike, path: PathLike) -> Optional[Path]:
    """Where ``path`` (a path under ``folder``) really is when that is outside the folder's
    homes, else None."""
    return _outside(homes(folder), Path(path))


def _outside(allowed: tuple[Path, ...], path: Path) -> Optional[Path]:
    target = path.resolve()
    return None if any(target == home or home in target.parents for home in allowed) else target


def check_inside(folder: PathLike, path: PathLike, key: str) -> Path:
    """``path``'s real location, or a ConfigError naming ``key`` and ``path`` when a link takes
    it out of ``folder``."""
    target = target_outside(folder, path)
    if target is not None:
        raise ConfigError(key, refusal(folder, path, target))
    return Path(path).resolve()


def refusal(folder: PathLike, path: PathLike, target: Path) -> str:
    """The reason a file of ``folder`` that resolves to ``target`` is not read."""
    return (
        f"{path} leads through a link to {target}, outside {folder}: a file of the folder is read only where it lies "
        "inside it (copy the file in instead of linking to it)"
    )


def check_folder(folder: PathLike, key: str) -> None:
    """Every link under ``folder`` (files and folders, at any depth) stays inside it, or a
    ConfigError naming ``key`` and the first link that leaves; links to folders are checked,
    not followed."""
    root = Path(folder)
    allowed = homes(root)
    for dirpath, dirnames, filenames in os.walk(root):
        for name in sorted(dirnames) + sorted(filenames):
            entry = Path(dirpath) / name
            target = _outside(allowed, entry) if entry.is_symlink() else None
            if target is not None:
                raise ConfigError(key, refusal(root, entry, target))
