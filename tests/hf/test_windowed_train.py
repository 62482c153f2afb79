"""Windowed models through the Trainer: a tiny Gemma 3, Mistral and Qwen2 loaded into ZeRO-3 on
a ring of 2 gloo ranks (cp 2), their first step's loss equal to transformers' on the same rows
(fp32, 1e-5 relative), and a second step's loss lower (the backward through the windowed ring
moved the weights the right way)."""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

import numpy as np
import pytest

from ringtrain_dev.ranks import gloo_rank, run_ranks
from tests.hf.windowed_models import MODELS

pytestmark = [pytest.mark.dist, pytest.mark.slow]

SEQ = 64


def _rank_main(rank: int, world: int, store: str, folders: dict[str, str], rows: str, results: mp.Queue) -> None:
    import torch

    from ringtrain import config
    from ringtrain.hf import resolve_job
    from ringtrain.train.trainer import Trainer

    with gloo_rank(rank, world, store, results):
        out = {}
        for name, folder in folders.items():
            job = resolve_job(config.load(None, [
                f"model.hf={folder}", f"data.path={rows}", f"data.seq_len={SEQ}", "mesh.cp=2", "attention.impl=ring",
                "train.global_batch=2", "zero.stage=3", "checkpoint.snapshot_every=0", "train.lr=1e-3",
                "train.warmup_steps=0", "train.steps=2",
            ]))
            trainer = Trainer(job, rank=rank, device=torch.device("cpu"))
            out[name] = (trainer.train_step().loss, trainer.train_step().loss)
            trainer.prefetcher.close()
        if rank == 0:
            results.put(out)


def test_first_steps_loss_equals_transformers(tmp_path: Path) -> None:
    import torch

    from ringtrain.train.data import SampleOrder
    from tests.hf.windowed_models import save_windowed
    from tests.hf_models import hf_logits, tokens

    folders = {name: str(save_windowed(tmp_path / name, name)) for name in MODELS}
    rows = tokens(8, SEQ).numpy().astype(np.int32)
    np.save(tmp_path / "rows.npy", rows)

    out = run_ranks(_rank_main, 2, tmp_path, folders, str(tmp_path / "rows.npy"))

    order = SampleOrder(rows.size, SEQ, seed=0, num_rows=len(rows))
    batch = torch.from_numpy(rows[[order.window(s) for s in range(2)]]).long()
    for name, (first, second) in out.items():
        _, ref_loss = hf_logits(Path(folders[name]), batch)
        assert abs(first - ref_loss) / ref_loss < 1e-5, f"{name}: {first} vs {ref_loss}"
        assert second < first, name
