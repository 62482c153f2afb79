"""The workers ``eval`` and ``generate`` run a model on: the job they are given (a source's model,
shaped for inference), and the worker group started on a cluster for the length of a ``with``.

The job: the source's with the user's overrides, no snapshots, checkpoints, chaos or spares, a
free metrics port. The group: the cluster ``connect`` finds or starts, a checked capacity, the
workers started and, for a checkpoint, restored; everything is shut down on the way out, and the
cluster's logs are kept when the block failed.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Optional

from ringtrain import config
from ringtrain.commands.eval_source import EvalSource
from ringtrain.config import STDLIB_CORPUS, ChaosConfig, JobConfig

if TYPE_CHECKING:
    from ringtrain.actors.group import WorkerGroup


def inference_job(source: EvalSource, overrides: list[str]) -> JobConfig:
    """The source's job with ``overrides``, shaped for inference: no snapshots, checkpoints, chaos
    or spares, and nothing stopped early. Its objective stays the run's (or the overrides'): the
    caller says what it scores with, and gives its workers ``lm`` (a preference objective's
    workers would first take reference log-probs of data they are not given). Not validated:
    the caller sets what it needs first."""
    job = config.merge(source.job, overrides)
    job.checkpoint = dataclasses.replace(job.checkpoint, snapshot_every=0, persist_every=0, resume="none")
    job.chaos = ChaosConfig()
    job.mesh = dataclasses.replace(job.mesh, spares=0, min_dp=1, max_dp=None)
    # A run's fixed metrics port may be taken by a job still running; Ray picks a free one.
    job.telemetry = dataclasses.replace(job.telemetry, metrics_port=None)
    job.train = dataclasses.replace(job.train, stop_at_step=None, skip_batches=[])
    return job


def workers_job(job: JobConfig, seq_len: int, path: str = STDLIB_CORPUS) -> JobConfig:
    """The job the workers run, validated: ``data.seq_len`` ``seq_len`` rounded up to a length
    the job's CP layout shards (``CPLayout.padded_length``), ``data.path`` alone (the run's
    ``data.sources`` dropped: the workers' data is never read, only checked at that length),
    ``train.micro_batch`` sequences a replica takes at once, and the next-token objective whatever
    the run trained with (they score and decode, and take no pairs)."""
    job.data = dataclasses.replace(job.data, seq_len=job.cp_layout.padded_length(seq_len), path=path, sources=[])
    job.train = dataclasses.replace(job.train, global_batch=job.mesh.dp * job.train.micro_batch, objective="lm")
    return checked(job)


def checked(job: JobConfig) -> JobConfig:
    """``job`` resolved against its Hugging Face folder (if any) and validated."""
    from ringtrain.hf import resolve_job

    resolved = resolve_job(job)  # reads model.hf's config.json, and validates
    if not job.model.hf:
        config.validate(resolved)
    return resolved


@contextlib.contextmanager
def started_workers(job: JobConfig, source: EvalSource, banner: Callable[[str], None],
                    before_restore: Optional[Callable[["WorkerGroup"], None]] = None) -> Iterator["WorkerGroup"]:  # fmt: skip
    """The job's workers, started (and restored from the source's checkpoint) for the block;
    ``banner`` is handed the device once it is known, before the workers start;
    ``before_restore`` runs on the started workers before a checkpoint is loaded into them."""
    from ringtrain.actors.cluster import check_capacity, connect, resolve_device
    from ringtrain.actors.group import WorkerGroup

    cluster = connect(job)
    ok = False
    try:
        device = resolve_device(job)
        check_capacity(job, device)
        banner(device)
        group = WorkerGroup(cluster.for_workers(job), device)
        try:
            group.start()
            if before_restore is not None:
                before_restore(group)
            if source.checkpoint is not None:
                group.restore(source.shards())
            yield group
        finally:
            group.shutdown()
        ok = True
    finally:
        cluster.close(keep_logs=not ok)
