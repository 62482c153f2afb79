"""ReferenceKeeper: the driver's copy of DPO's and IPO's reference table, for every world of a run.

A run starts with the table its checkpoint store holds under the run's key
(``checkpoint/reference_table.py``: the dataset, the reference model, the model settings it is
scored under, the layout and precision),
or with none: then the first world computes it on its own mesh before step 1 and rank 0 hands it
back (``learned``), and the keeper writes it to the store once, through the run's fence, beside
the checkpoints a resume reads. Every later world (a resize, a recovery's new world) and every
later run of the same run directory is given that table: none computes it again, so a run
resumed or resized at any mesh scores against the very values the first world took.

A run without a store (``checkpoint.snapshot_every=0``) keeps the table in memory for its own
worlds only; a store that refuses the write costs the table's reuse by a later run, not this
run (the line says so).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, Callable, Optional

import numpy as np

from ringtrain.checkpoint import CheckpointStore
from ringtrain.checkpoint.fence import Fence
from ringtrain.checkpoint.reference_table import Found, load_table, save_table, table_key
from ringtrain.config import MODEL_DEFAULTS, JobConfig
from ringtrain.errors import first_line
from ringtrain.hf.hfconfig import OVERRIDABLE_KEYS, SHAPE_KEYS
from ringtrain.train.reference_input import Reference, ReferenceWeights

log = logging.getLogger(__name__)


class ReferenceKeeper:
    def __init__(self, key: Mapping[str, Any], weights: Optional[ReferenceWeights], *, store: Optional[CheckpointStore],
                 fence: Optional[Fence] = None, say: Callable[[str], None] = log.info,
                 rows: Optional[int] = None) -> None:  # fmt: skip
        self.key = dict(key)
        self.weights = weights
        self.store = store
        self.fence = fence
        self.say = say
        self.table: Optional[np.ndarray] = None
        self.uri = ""  # where the table is stored ("" while it is not)
        self.computed = 0  # tables a world computed: 1 for a fresh run, 0 for one that found its own
        self._rows = rows  # the rows of pairs a pass scores: the driver's packing counts, else counted once
        if store is not None:
            found = self._load(store)
            if found.note:
                say(f"reference log-probs: {found.note}; computing them again")
            if found.table is not None:
                self.table, self.uri, self.weights = found.table, found.uri, None
                say(f"reference log-probs of {len(found.table)} pairs read from {found.uri}")

    def _load(self, store: CheckpointStore) -> Found:
        """The store's table of this key (``load_table``: one the store cannot hand over is
        computed again, as a damaged one is, with the line saying why)."""
        return load_table(store, self.key)

    def join_input(self) -> Reference:
        """What each rank of a world forming is given: the table once there is one, else the
        weights to compute it with (None: the starting weights). The keeper holds the weights
        only until the table is known; a checkpoint's are read as they are handed over
        (``commands/reference.py``'s ``CheckpointWeights``)."""
        return Reference(table=self.table) if self.table is not None else Reference(weights=self.weights)

    def pass_rows(self, job: JobConfig) -> int:
        """The rows of pairs the pass over ``job``'s dataset scores (counted once: the packing is
        a function of the data and the seed, the same in every world)."""
        if self._rows is None:
            self._rows = pair_rows(job)
        return self._rows

    def learned(self, table: np.ndarray) -> None:
        """The table a world computed; stored once (later worlds were given it, and compute none)."""
        if self.table is not None:
            return
        self.table = np.asarray(table, dtype=np.float64)
        self.weights = None  # no world needs them any more
        self.computed += 1
        if self.store is None:
            return
        try:
            self.uri = save_table(self.store, self.key, self.table, fence=self.fence)
        except Exception as exc:  # the run goes on with the table in memory; a later run computes it again
            why = f"{type(exc).__name__}: {first_line(exc)}"
            self.say(f"reference log-probs: could not store them in {self.store.uri}: {why}")
            return
        self.say(f"reference log-probs of {len(self.table)} pairs stored in {self.uri}")


def pair_rows(job: JobConfig) -> int:
    """How many rows ``job``'s preference dataset packs into, as the workers pack it (from its
    documents' lengths: no token is read)."""
    from ringtrain.train.mixture import open_mixture

    mixture = open_mixture(job)
    try:
        return mixture.pair_rows().num_rows
    finally:
        mixture.close()


def run_key(job: JobConfig, identity: Mapping[str, Any], device: str, seq_len: Optional[int] = None) -> dict[str, Any]:
    """The table key of ``job``'s dataset (``data.path``) and ``identity``, scored under
    ``job``'s model settings (``job`` resolved: ``ringtrain.hf.resolve_job``) at ``seq_len``
    (None: ``data.seq_len``), computed on ``device``."""
    from ringtrain.train.corpus import read_manifest
    from ringtrain.train.pairs import STORED_DOCUMENTS

    manifest = read_manifest(job.data.path)
    d = job.data
    return table_key(dataset=manifest.digest(), num_pairs=manifest.num_documents // STORED_DOCUMENTS, reference=identity,
                     model=forward_settings(job), seq_len=seq_len or d.seq_len, prefix_sharing=d.prefix_sharing,
                     overlong=d.chat_overlong, precision={"dtype": job.train.dtype, "device": device})  # fmt: skip


def forward_settings(job: JobConfig) -> dict[str, Any]:
    """The model settings a forward pass runs under: what a model folder's config.json decides
    (the shape, norms, scales) and what a job may change over the same weights (rotary
    embeddings, context length, attention windows), an unset key as its default."""
    m = job.model
    settings = {key: getattr(m, key) for key in (*SHAPE_KEYS, *OVERRIDABLE_KEYS)}
    settings.update(head_dim=job.head_dim, ffn_dim=job.ffn_dim)
    return {key: MODEL_DEFAULTS.get(key) if value is None else value for key, value in settings.items()}
