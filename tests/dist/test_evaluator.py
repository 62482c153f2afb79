"""The Evaluator on a dp=2 x cp=2 ring under ZeRO-3, as gloo ranks through the workers' Trainer.

- Loss: a tiny Hugging Face model's mean next-token loss over 2-D .npy rows equals
  transformers' own (``labels=input_ids``) within 1e-5 relative. Three rows of 30 tokens make
  both paddings happen: each row to 32 (2 x cp) with ignored labels, and the rows to 4 (a
  multiple of dp) with a row that is all padding, so every replica runs as many forwards.
- Passkey: a stand-in model that copies (an induction rule over the whole sequence, gathered
  across the CP ring) answers every prompt, which holds only if the token is taken from the
  rank holding the last position and reaches the ring's other ranks.
"""

from __future__ import annotations

import math
import multiprocessing as mp
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from ringtrain_dev.ranks import gloo_rank, run_ranks
from tests.hf_models import hf_logits, save_model, tokens

pytestmark = [pytest.mark.dist, pytest.mark.slow]

WORLD = 4
MESH = ["mesh.dp=2", "mesh.cp=2", "attention.impl=ring", "zero.stage=3"]
ROWS, LENGTH = 3, 30
BUCKET = 4  # buckets 0-4, 4-8, 8-16, 16-32: four of them in a row of 30
PASSKEY_LENGTHS, PASSKEY_DEPTHS = [256, 300], [0.0, 0.5, 1.0]
MATCH = 8  # tokens of context the copying stand-in matches


def copying_forward(cp_group: Any, vocab: int):  # type: ignore[no-untyped-def]
    """Logits that put all mass on the token that followed the latest earlier occurrence of the
    last ``MATCH`` tokens: a model that has learned only to copy. It sees the whole sequence by
    gathering every CP rank's tokens and positions, as ring attention would."""
    import torch.distributed as dist

    def forward(ids_BS: torch.Tensor, pos_BS: torch.Tensor) -> torch.Tensor:
        size = dist.get_world_size(cp_group)
        ids = [torch.empty_like(ids_BS) for _ in range(size)]
        pos = [torch.empty_like(pos_BS) for _ in range(size)]
        dist.all_gather(ids, ids_BS, group=cp_group)
        dist.all_gather(pos, pos_BS, group=cp_group)
        seq = torch.empty(sum(p.numel() for p in pos), dtype=torch.long)
        seq[torch.cat(pos, dim=1)[0]] = torch.cat(ids, dim=1)[0]
        text = seq.tolist()
        logits = torch.zeros(1, pos_BS.shape[1], vocab)
        for i, p in enumerate(pos_BS[0].tolist()):
            tail = text[max(0, p - MATCH + 1) : p + 1]
            for j in range(p - 1, len(tail) - 2, -1):
                if text[j - len(tail) + 1 : j + 1] == tail:
                    logits[0, i, text[j + 1]] = 1.0
                    break
        return logits

    return forward


def _rank_main(rank: int, world: int, store_path: str, folder: str, rows: str, results: mp.Queue) -> None:
    import torch.distributed as dist

    from ringtrain import config
    from ringtrain.evaluation.passkey import answer_tokens, build_prompts, score
    from ringtrain.evaluation.tally import merge_all
    from ringtrain.evaluation.text import ByteTokenizer
    from ringtrain.hf import resolve_job
    from ringtrain.train.evalset import load_eval_set
    from ringtrain.train.evaluator import Evaluator
    from ringtrain.train.trainer import Trainer

    device = torch.device("cpu")
    with gloo_rank(rank, world, store_path, results):
        job = resolve_job(
            config.load(None, [f"model.hf={folder}", "data.seq_len=32", "train.global_batch=2", "checkpoint.snapshot_every=0", *MESH])
        )
        trainer = Trainer(job, rank=rank, device=device)
        evaluator = Evaluator.of(trainer)
        evalset = load_eval_set(rows, seq_len=32, vocab_size=job.model_int("vocab_size"))
        tally = evaluator.losses(evalset, BUCKET)
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, tally)

        text = ByteTokenizer()
        prompts = build_prompts(text, PASSKEY_LENGTHS, PASSKEY_DEPTHS, trials=1)
        copier = Evaluator(trainer.model, trainer.mesh, device, forward=copying_forward(trainer.mesh.cp_group, 256))
        generated = copier.generate([list(p.ids) for p in prompts], answer_tokens(text, prompts))
        answers: list[Any] = [None] * world
        dist.all_gather_object(answers, generated)
        if rank == 0:
            topo = trainer.mesh.topology
            replicas = [ids for d in range(topo.dp) for ids in answers[topo.rank_of(d, 0)]][: len(prompts)]
            same_in_ring = all(answers[topo.rank_of(d, 0)] == answers[topo.rank_of(d, 1)] for d in range(topo.dp))
            results.put((merge_all(gathered), [t.tokens for t in gathered], score(text, prompts, replicas), same_in_ring))


def test_loss_and_passkey_on_a_zero3_ring(tmp_path: Path) -> None:
    folder = save_model(tmp_path / "hf", "llama")
    ids = tokens(ROWS, LENGTH)
    rows = tmp_path / "rows.npy"
    np.save(rows, ids.numpy().astype(np.int64))
    _, expected = hf_logits(folder, ids)

    tally, per_rank, grid, same_in_ring = run_ranks(_rank_main, WORLD, tmp_path, str(folder), str(rows))

    assert tally.tokens == ROWS * (LENGTH - 1), "every labelled prediction counted once, no padding"
    assert all(n > 0 for n in per_rank), per_rank
    assert math.isclose(tally.loss, expected, rel_tol=1e-5), (tally.loss, expected)
    buckets = tally.by_position()
    assert [(b["start"], b["end"]) for b in buckets] == [(0, 4), (4, 8), (8, 16), (16, 32)]
    assert sum(b["tokens"] for b in buckets) == tally.tokens
    assert math.isclose(sum(b["loss"] * b["tokens"] for b in buckets) / tally.tokens, tally.loss, rel_tol=1e-12)

    assert grid.lengths == tuple(PASSKEY_LENGTHS) and grid.depths == tuple(PASSKEY_DEPTHS)
    assert grid.overall == 1.0, grid
    assert same_in_ring
