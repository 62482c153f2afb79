"""A spare or a new worker warming up for a preference job rehearses the job's step on one rank:
a short row holding one made-up pair, whatever the job's context length, and no pass over the data.

The rehearsal's Trainer is replaced by a stand-in that records what it was given; the row it was
given is read as a step reads it. ``tests/dist/test_snapshot_restore.py`` runs a real one."""

from __future__ import annotations

from typing import Any, Optional

import numpy as np
import pytest
import torch

from ringtrain import config
from ringtrain.train import trainer as trainer_module
from ringtrain.train.data import IGNORE_INDEX, BatchPlan, SampleSource, ShardedData
from ringtrain.train.pairs import PAIR_FAMILY
from ringtrain.train.pairset import rehearsal_pairs

VOCAB = 320


class _Built(Exception):
    pass


def _rehearsed(monkeypatch: pytest.MonkeyPatch, overrides: list[str]) -> tuple[config.JobConfig, Optional[SampleSource]]:
    built: list[tuple[config.JobConfig, Any]] = []

    def trainer(job: config.JobConfig, **kwargs: Any) -> None:
        built.append((job, kwargs.get("samples")))
        raise _Built

    monkeypatch.setattr(trainer_module, "set_rank_env", lambda **kwargs: None)
    monkeypatch.setattr(trainer_module.dist, "init_process_group", lambda *args, **kwargs: None)
    monkeypatch.setattr(trainer_module, "Trainer", trainer)
    with pytest.raises(_Built):
        trainer_module.warm_up(config.load(None, [f"model.vocab_size={VOCAB}", *overrides]), torch.device("cpu"))
    ((job, samples),) = built
    return job, samples


@pytest.mark.parametrize("shared", [True, False])
def test_a_long_context_preference_job_rehearses_one_made_up_pair_in_a_short_row(
    monkeypatch: pytest.MonkeyPatch, shared: bool
) -> None:
    """DPO on rows of 32K tokens over a ring of eight: the rehearsal trains SimPO (no reference
    pass) on one rank, one row of WARM_UP_SEQ_LEN tokens holding one pair laid out as the job
    lays its pairs out, its both completions trained."""
    job, samples = _rehearsed(monkeypatch, ["train.objective=dpo", "data.seq_len=32768", "mesh.cp=8",
                                            "attention.impl=ring", "data.packing=doc", f"data.prefix_sharing={shared}"])  # fmt: skip
    seq_len = trainer_module.WARM_UP_SEQ_LEN
    assert job.data.seq_len == seq_len and job.topology.world_size == 1 and job.train.objective == "simpo"
    assert samples is not None
    data = ShardedData(samples, seq_len=seq_len, seed=job.train.seed, plan=BatchPlan(1, 1, 1), ring=1, ulysses=1,
                       ring_idx=0, ulysses_idx=0, vocab_size=VOCAB)  # fmt: skip
    (mb,) = data.step_batches(0, 0)
    assert mb.input_ids.shape == (1, seq_len) and mb.pairs == (0,)
    assert mb.family == (PAIR_FAMILY if shared else 0)
    assert mb.completions is not None
    trained = mb.labels != IGNORE_INDEX
    chosen, rejected = (mb.completions == 0) & trained, (mb.completions == 1) & trained
    assert chosen.sum() == rejected.sum() == seq_len // 8
    assert ((mb.completions >= 0) == trained).all()  # every trained label is a completion's
    data.close()


def test_an_lm_job_rehearses_no_made_up_pair(monkeypatch: pytest.MonkeyPatch) -> None:
    job, samples = _rehearsed(monkeypatch, ["data.seq_len=4096"])
    assert samples is None and job.data.seq_len == trainer_module.WARM_UP_SEQ_LEN


@pytest.mark.parametrize("seq_len", [4, 7, 16, 64])
@pytest.mark.parametrize("shared", [True, False])
def test_the_made_up_pair_fits_a_row_of_any_warm_up_length(seq_len: int, shared: bool) -> None:
    pairs = rehearsal_pairs(seq_len, VOCAB, prefix_sharing=shared)
    (row,) = pairs.rows
    assert len(row.tokens) == seq_len + 1 and pairs.pair_rows().num_rows == 1 and row.pairs == (0,)
    assert row.completions is not None and {0, 1} <= set(np.unique(row.completions).tolist())
