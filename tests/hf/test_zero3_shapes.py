"""Under ZeRO-3 a pretrained model is built inside DeepSpeed's ``zero.Init``: every parameter is a
(0,)-shaped placeholder, its partition elsewhere. Every rule that reads a parameter's shape must
read the whole shape (``train.model.full_shape``), or it silently changes the training:

- the optimizer's groups (weight decay on matrices only): three steps with weight decay 0.5 at
  ZeRO-3 equal ZeRO-2's and plain PyTorch AdamW's, losses and pre-clip gradient norms, with
  clipping active;
- the parameter count the report and the run's summary carry: transformers' own count, as the
  planner's model of the job has it.

The snapshots and the export read ZeRO-3's partitions by ``ds_shape`` and are checked at stage 3
with a pretrained model by tests/dist/test_export_roundtrip.py and test_snapshot_restore.py; the
SDC probes and the MFU read no parameter (fixed inputs; the planner's model of the job)."""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

import numpy as np
import pytest

from ringtrain_dev.ranks import gloo_rank, run_ranks

pytestmark = [pytest.mark.dist, pytest.mark.slow]

SEQ = 32
STEPS = 3
LR = 2e-3
GRAD_CLIP = 0.5
DECAY = 0.5
TOLERANCE = 1e-5


def _job(folder: str, rows: str, stage: int) -> list[str]:
    return [
        f"model.hf={folder}", f"data.path={rows}", f"data.seq_len={SEQ}", "mesh.dp=2", "train.global_batch=2",
        f"zero.stage={stage}", "checkpoint.snapshot_every=0", f"train.lr={LR}", "train.warmup_steps=0",
        f"train.steps={STEPS}", f"train.weight_decay={DECAY}", f"train.grad_clip={GRAD_CLIP}",
    ]


def _rank_main(rank: int, world: int, store: str, folder: str, rows: str, results: mp.Queue) -> None:
    import torch

    from ringtrain import config
    from ringtrain.hf import resolve_job
    from ringtrain.planner.models import from_job
    from ringtrain.train.model import num_params
    from ringtrain.train.trainer import Trainer

    with gloo_rank(rank, world, store, results):
        out = {}
        for stage in (2, 3):
            job = resolve_job(config.load(None, _job(folder, rows, stage)))
            trainer = Trainer(job, rank=rank, device=torch.device("cpu"))
            # Counted as a worker reports it, once its model is built: before the first forward,
            # where ZeRO-3 gathers (and keeps whole, below its persistence threshold) small ones.
            count = num_params(trainer.model)
            reports = [trainer.train_step() for _ in range(STEPS)]
            out[stage] = {
                "loss": [r.loss for r in reports],
                "grad_norm": [r.grad_norm for r in reports],
                "num_params": count,
                "planned_params": from_job(job).num_params,
            }
        if rank == 0:
            results.put(out)


def _adamw_reference(folder: Path, batches: list[np.ndarray], weight_decay: float) -> dict[str, list[float]]:
    """transformers' model trained by torch's AdamW alone: decay on matrices, the job's betas,
    eps and schedule (no warmup: constant rate over three steps of a cosine to 0.1 x), clipped
    to GRAD_CLIP by the same coefficient."""
    import torch
    from transformers import AutoModelForCausalLM

    from ringtrain.train.engine import lr_multiplier

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(
        [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
         {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
        lr=LR, betas=(0.9, 0.95), eps=1e-8,
    )
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_multiplier(s, warmup_steps=0, total_steps=STEPS, min_ratio=0.1)
    )
    losses, norms = [], []
    for rows in batches:
        ids = torch.from_numpy(rows).long()
        loss = model(input_ids=ids, labels=ids).loss
        optimizer.zero_grad()
        loss.backward()
        norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        torch.nn.utils.clip_grads_with_norm_(params, GRAD_CLIP, norm)
        optimizer.step()
        schedule.step()
        losses.append(float(loss.detach()))
        norms.append(float(norm))
    return {"loss": losses, "grad_norm": norms}


def _close(ours: list[float], theirs: list[float]) -> bool:
    return all(abs(a - b) <= TOLERANCE * abs(b) for a, b in zip(ours, theirs, strict=True))


def test_zero3_trains_a_pretrained_model_as_zero2_and_plain_adamw_do(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from ringtrain.train.data import SampleOrder
    from tests.hf_models import save_model, tokens

    folder = save_model(tmp_path / "model", "llama")  # untied: matrices, norms' gains
    rows = tokens(8, SEQ).numpy().astype(np.int32)
    np.save(tmp_path / "rows.npy", rows)

    out = run_ranks(_rank_main, 2, tmp_path, str(folder), str(tmp_path / "rows.npy"))

    order = SampleOrder(rows.size, SEQ, seed=0, num_rows=len(rows))
    batches = [rows[[order.window(2 * step), order.window(2 * step + 1)]] for step in range(STEPS)]
    decayed = _adamw_reference(folder, batches, DECAY)
    undecayed = _adamw_reference(folder, batches, 0.0)
    # The check can see decay (it moves the last step's loss well past the tolerance), and the
    # clipping is on (every step's gradient is longer than the limit).
    assert not _close(decayed["loss"], undecayed["loss"])
    assert min(decayed["grad_norm"]) > GRAD_CLIP
    for stage in (2, 3):
        for key in ("loss", "grad_norm"):
            assert _close(out[stage][key], decayed[key]), f"ZeRO-{stage} {key}: {out[stage][key]} vs AdamW {decayed[key]}"

    hf_count = AutoModelForCausalLM.from_pretrained(folder).num_parameters()
    for stage in (2, 3):
        assert out[stage]["num_params"] == out[stage]["planned_params"] == hf_count, stage
