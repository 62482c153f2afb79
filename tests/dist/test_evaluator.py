"""The Evaluator on a dp=2 x cp=2 ring under ZeRO-3, as gloo ranks through the workers' Trainer.

- Loss: a tiny Hugging Face model's mean next-token loss over 2-D .npy rows equals
  transformers' own (``labels=input_ids``) within 1e-5 relative. Three rows of 30 tokens make
  both paddings happen: each row to 32 (2 x cp) with ignored labels, and the rows to 4 (a
  multiple of dp) with a row that is all padding, so every replica runs as many forwards.
- Generation (passkey's path): prompts of 5 to 300 tokens decoded with the KV cache sharded over
  each ring, in batches shared out over the replicas (a batch of 16 padded tokens: one prompt
  each, so one replica decodes three and the other two and a copy), under ZeRO-3's parameter
  gathers: the same tokens as transformers' greedy ``generate`` on every prompt, and the same on
  both ranks of a ring.
"""

from __future__ import annotations

import math
import multiprocessing as mp
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from ringtrain_dev.ranks import run_ranks
from tests.hf_models import greedy_reference, hf_logits, save_model, tokens

pytestmark = [pytest.mark.dist, pytest.mark.slow]

WORLD = 4
MESH = ["mesh.dp=2", "mesh.cp=2", "attention.impl=ring", "zero.stage=3"]
ROWS, LENGTH = 3, 30
BUCKET = 4  # buckets 0-4, 4-8, 8-16, 16-32: four of them in a row of 30
PROMPT_LENGTHS = (5, 40, 300, 17, 90)  # five prompts: the replicas' batches differ in number and length
NEW = 6
def _rank_main(rank: int, world: int, store_path: str, folder: str, rows: str, prompts: list[list[int]],
               results: mp.Queue) -> None:
    import torch.distributed as dist

    from ringtrain import config
    from ringtrain.evaluation.generation import GenerationRequest
    from ringtrain.evaluation.tally import merge_all
    from ringtrain.hf import resolve_job
    from ringtrain.train.evalset import load_eval_set
    from ringtrain.train.evaluator import Evaluator
    from ringtrain.train.trainer import Trainer, set_rank_env

    torch.set_num_threads(1)
    device = torch.device("cpu")
    set_rank_env(rank=rank, world_size=world, device=device)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    try:
        job = resolve_job(
            config.load(None, [f"model.hf={folder}", "data.seq_len=32", "train.global_batch=2", "checkpoint.snapshot_every=0", *MESH])
        )
        trainer = Trainer(job, rank=rank, device=device)
        evaluator = Evaluator.of(trainer)
        evalset = load_eval_set(rows, seq_len=32, vocab_size=job.model_int("vocab_size"))
        tally = evaluator.losses(evalset, BUCKET)
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, tally)

        request = GenerationRequest.of(prompts, NEW)
        evaluator = Evaluator(trainer.model, trainer.mesh, device, lockstep=True, batch_tokens=16)
        generated = evaluator.generate(request)
        answers: list[Any] = [None] * world
        dist.all_gather_object(answers, generated)
        if rank == 0:
            topo = trainer.mesh.topology
            same_in_ring = all(answers[topo.rank_of(d, 0)] == answers[topo.rank_of(d, 1)] for d in range(topo.dp))
            merged = [next(a[i] for a in answers if a[i] is not None) for i in range(len(prompts))]
            results.put((merge_all(gathered), [t.tokens for t in gathered], merged, same_in_ring))
    except BaseException as exc:
        results.put(exc)
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_loss_and_passkey_on_a_zero3_ring(tmp_path: Path) -> None:
    folder = save_model(tmp_path / "hf", "llama")
    ids = tokens(ROWS, LENGTH)
    rows = tmp_path / "rows.npy"
    np.save(rows, ids.numpy().astype(np.int64))
    _, expected = hf_logits(folder, ids)

    prompts = [tokens(1, n, seed=n)[0].tolist() for n in PROMPT_LENGTHS]
    want = greedy_reference(folder, prompts, NEW)

    tally, per_rank, generated, same_in_ring = run_ranks(_rank_main, WORLD, tmp_path, str(folder), str(rows), prompts)

    assert tally.tokens == ROWS * (LENGTH - 1), "every labelled prediction counted once, no padding"
    assert all(n > 0 for n in per_rank), per_rank
    assert math.isclose(tally.loss, expected, rel_tol=1e-5), (tally.loss, expected)
    buckets = tally.by_position()
    assert [(b["start"], b["end"]) for b in buckets] == [(0, 4), (4, 8), (8, 16), (16, 32)]
    assert sum(b["tokens"] for b in buckets) == tally.tokens
    assert math.isclose(sum(b["loss"] * b["tokens"] for b in buckets) / tally.tokens, tally.loss, rel_tol=1e-12)

    assert generated == want
    assert same_in_ring
