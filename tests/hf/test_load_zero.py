"""A pretrained model loads bit for bit at every ZeRO stage: 2 gloo ranks (dp 2), each reading
only its fragments from the safetensors, gathered back equal to the file's tensors; the first
step's loss equals transformers' on the same rows."""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

import numpy as np
import pytest

from ringtrain_dev.ranks import gloo_rank, run_ranks

pytestmark = [pytest.mark.dist, pytest.mark.slow]

SEQ = 64


def _rank_main(rank: int, world: int, store: str, folder: str, rows: str, results: mp.Queue) -> None:
    import torch

    from ringtrain import config
    from ringtrain.hf import resolve_job
    from ringtrain.hf.weights import PretrainedWeights
    from ringtrain.train.trainer import Trainer

    with gloo_rank(rank, world, store, results):
        weights = PretrainedWeights(folder)
        out = {}
        for stage in (0, 1, 2, 3):
            job = resolve_job(config.load(None, [
                f"model.hf={folder}", f"data.path={rows}", f"data.seq_len={SEQ}", "mesh.dp=2", "train.global_batch=2",
                f"zero.stage={stage}", "checkpoint.snapshot_every=0", "train.lr=1e-30", "train.warmup_steps=0",
            ]))
            trainer = Trainer(job, rank=rank, device=torch.device("cpu"))
            params = trainer.parameters_fp32()
            mismatched = [n for n, v in params.items() if not torch.equal(v, torch.from_numpy(weights.full(n)))]
            report = trainer.train_step()
            out[stage] = (mismatched, report.loss, report.samples)
        if rank == 0:
            results.put(out)


def test_every_stage_loads_the_file_exactly(tmp_path: Path) -> None:
    import torch

    from ringtrain.train.data import SampleOrder
    from tests.hf_models import hf_logits, save_model, tokens

    folder = save_model(tmp_path / "model", "qwen3", tie=True)
    rows = tokens(8, SEQ).numpy().astype(np.int32)
    np.save(tmp_path / "rows.npy", rows)

    out = run_ranks(_rank_main, 2, tmp_path, str(folder), str(tmp_path / "rows.npy"))

    order = SampleOrder(rows.size, SEQ, seed=0, num_rows=len(rows))
    _, ref_loss = hf_logits(folder, torch.from_numpy(rows[[order.window(s) for s in range(2)]]).long())
    for stage, (mismatched, loss, _) in out.items():
        assert mismatched == [], f"ZeRO-{stage}: {mismatched}"
        assert abs(loss - ref_loss) / ref_loss < 1e-5, f"ZeRO-{stage}: {loss} vs {ref_loss}"
