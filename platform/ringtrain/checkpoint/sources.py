"""CheckpointSource: the store and checkpoint a user's SOURCE argument names.

SOURCE is a run directory (``config.yaml`` in it: the store is its ``checkpoint.uri``, else
``<run_dir>/checkpoints``, and the newest valid checkpoint there is meant), ``<store>/step-<n>``
(that checkpoint), or a store (its newest valid checkpoint); a local path or a ``file://`` or
``s3://`` URI. ``ringtrain export`` and ``ringtrain eval`` read their SOURCE through
``open_source``; what each makes of the checkpoint stays with the command.

Every failure is a ConfigError naming ``key``, so a command reports it as bad input (exit 2);
``NoCheckpoint`` marks a store that was read and holds nothing to load, for a caller that words
that case its own way.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from ringtrain import uris
from ringtrain.checkpoint.layout import split_checkpoint_uri
from ringtrain.checkpoint.loaded import LoadedCheckpoint
from ringtrain.checkpoint.manifest import CheckpointCorrupt
from ringtrain.checkpoint.s3_access import cause, check_reachable
from ringtrain.checkpoint.store import CheckpointStore, Compatible, open_store
from ringtrain.config.loading import RUN_CONFIG
from ringtrain.config.yamlfile import read_mapping
from ringtrain.errors import ConfigError
from ringtrain.links import check_inside

# A run's checkpoint store when its config names none: this folder of the run directory.
RUN_STORE = "checkpoints"


@dataclass(frozen=True)
class CheckpointSource:
    store: CheckpointStore
    checkpoint: LoadedCheckpoint
    run_dir: Optional[Path]  # the run directory SOURCE named, or None


class NoCheckpoint(ConfigError):
    """The store was read and holds no checkpoint that is committed, intact and accepted;
    ``detail`` says why (the first checkpoints passed over, or that it is empty)."""

    def __init__(self, key: str, store_uri: str, detail: str) -> None:
        super().__init__(key, f"no valid checkpoint in {store_uri} ({detail})")
        self.store_uri = store_uri
        self.detail = detail

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.key, self.store_uri, self.detail))


def open_source(
    source: str, *, key: str = "SOURCE", accept: Optional[Compatible] = None, eager: bool = False
) -> CheckpointSource:
    """The store and checkpoint ``source`` names. A store's newest checkpoint must pass
    ``accept`` (see ``CheckpointStore.latest_valid``); a checkpoint named by its step is
    loaded as it is. With ``eager`` every shard is read and checked here (a store's newest
    damaged checkpoint is then passed over); without it shards are read, and checked, on access.
    """
    run_dir: Optional[Path] = None
    uri = source
    if not uris.has_scheme(source):
        path = Path(source).expanduser()
        if not path.exists() and split_checkpoint_uri(source)[1] is None:  # a missing step is named below
            raise ConfigError(key, f"{source}: no such run directory, checkpoint or checkpoint store")
        if (path / RUN_CONFIG).is_file():
            run_dir = path
            uri = run_store_uri(path, key)
        else:
            uri = str(path.absolute())
    where = f"the checkpoints of {run_dir} ({uri})" if run_dir is not None else uri
    try:
        store_at, step = split_checkpoint_uri(uri)
        store = open_store(store_at)
    except ValueError as exc:  # a URI the store cannot address
        raise ConfigError(key, f"cannot load {where}: {exc}") from None
    check_reachable(store_at, key, subject=f"cannot read {where}")
    try:
        if step is not None:
            return CheckpointSource(store, store.load(step, verify=True, eager=eager), run_dir)
        loaded = store.latest_valid(accept, verify=eager)
    except (CheckpointCorrupt, ValueError) as exc:  # damage
        raise ConfigError(key, f"cannot load {where}: {exc}") from None
    except Exception as exc:  # these calls only read the source: denied, unreachable, no bucket
        said = cause(exc)
        raise ConfigError(key, f"cannot read {where}: {said or f'{type(exc).__name__}: {exc}'}") from None
    if loaded is None:
        why = "; ".join(str(s) for s in store.skipped[:3])
        raise NoCheckpoint(key, store.uri, why or "it is empty")
    return CheckpointSource(store, loaded, run_dir)


def run_store_uri(run_dir: Path, key: str = "SOURCE") -> str:
    """The checkpoint store of a run: its config's checkpoint.uri, else <run_dir>/checkpoints.
    The config is read as plain YAML, not validated: a run written by an older version, whose
    config the current schema would refuse, still names its store."""
    # Bounded, and from the folder itself: the folder may be someone else's.
    saved = read_mapping(check_inside(run_dir, run_dir / RUN_CONFIG, key), key)
    section = saved.get("checkpoint")
    uri = section.get("uri") if isinstance(section, dict) else None
    if uri is not None and not isinstance(uri, str):
        raise ConfigError(key, f"{run_dir / RUN_CONFIG}: checkpoint.uri must be a string, got a {type(uri).__name__}")
    return store_of_run(uri or "", run_dir.absolute())


def store_of_run(configured: str, run_dir: Path) -> str:
    """A run's checkpoint store: ``configured`` (its checkpoint.uri), else the run directory's
    own store folder (``run_dir`` absolute)."""
    return configured or (run_dir / RUN_STORE).as_uri()
