"""The Trainer on CUDA: an NCCL world of one in bf16 at ZeRO 0-3, with per-step snapshots taken on
the side stream, a restore in a fresh process, and the state's round trip bit for bit.

Each stage trains STEPS steps while snapshotting every step and keeps the snapshot of step CUT.
A fresh process then restores it: the model's weights and every fragment of the optimizer state
(fp32 masters, Adam moments) must come back bit for bit (the restore re-snapshots the state it
loaded, which is compared with the original), and the remaining steps must give the same losses
up to the GPU kernels' own run-to-run variation (flash attention's backward adds with atomics,
so two runs of the same step need not agree to the last bit). The SDC probe digests, NCCL
all-reduce included, must agree between the two processes and between rounds.

Each process is spawned (ringtrain_dev/ranks.py): a process holds one default process group and
DeepSpeed picks its accelerator once, so every world gets a fresh one.
"""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path
from typing import Any, Optional

import numpy as np
import pytest

from ringtrain_dev.ranks import run_ranks

from .support import MARKS

pytestmark = [*MARKS, pytest.mark.slow]

STEPS, CUT = 6, 3
TINY = [
    "model.dim=256",
    "model.n_layers=2",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "data.seq_len=512",
    "train.global_batch=4",
    "train.micro_batch=2",  # two micro-batches: the snapshot fence sits at the accumulation boundary
    f"train.steps={STEPS}",
    "train.warmup_steps=2",
    "train.dtype=bf16",
    "checkpoint.snapshot_every=1",
    "checkpoint.keep_in_memory=8",
    "mesh.dp=1",
    "mesh.cp=1",
    "cluster.device=cuda",
]


def _state(blob: bytes) -> dict[tuple[str, str, int], bytes]:
    """A snapshot's tensor payload, (parameter, state key, start) -> raw bytes."""
    from ringtrain.checkpoint.wire import decode

    shard = decode(blob)
    return {(e["name"], e["key"], e["start"]): shard.array(e).tobytes() for e in shard.entries}


def _rank_main(
    rank: int, world: int, store_path: str, overrides: list[str], blob: Optional[bytes], results: mp.Queue
) -> None:
    import torch
    import torch.distributed as dist

    from ringtrain import config
    from ringtrain.train.trainer import Trainer, set_rank_env

    try:
        device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
        set_rank_env(rank=rank, world_size=world, device=device)
        dist.init_process_group(
            "nccl", store=dist.FileStore(store_path, world), rank=rank, world_size=world, device_id=device
        )
        trainer = Trainer(config.load(None, overrides), rank=rank, device=device)
        out: dict[str, Any] = {"losses": [], "snapshot": None}
        if blob is not None:
            assert trainer.restore([blob]) == CUT
            out["restored_state"] = _state(trainer.snapshot(CUT).blob)  # the state the restore loaded
            out["restored_params"] = {k: v.numpy() for k, v in trainer.parameters_fp32().items()}
        while trainer.step < STEPS:
            report = trainer.train_step()
            assert report.memory_bytes > 0 and np.isfinite(report.loss), report
            out["losses"].append(report.loss)
            if trainer.step == CUT and blob is None:
                out["snapshot"] = bytes(trainer.snapshot(CUT).blob)
                out["params_at_cut"] = {k: v.numpy() for k, v in trainer.parameters_fp32().items()}
        assert trainer.snapshotter is not None
        trainer.snapshotter.wait()
        assert not trainer.snapshotter.errors, trainer.snapshotter.errors
        # The side stream copied into host buffers registered with CUDA, page-locked at their size.
        buffers = trainer.snapshotter.buffers
        assert buffers and all(b.page_locked and b.data.is_pinned() for b in buffers), [b.page_locked for b in buffers]
        out["probes"] = [trainer.probe_round() for _ in range(2)]
        out["params"] = {k: v.numpy() for k, v in trainer.parameters_fp32().items()}
        trainer.close()
        results.put(out)
    except BaseException as exc:  # noqa: BLE001 - any failure must reach the test
        results.put(exc)
        raise


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_bf16_snapshot_restore_round_trip_at_every_zero_stage(stage: int, tmp_path: Path) -> None:
    overrides = [*TINY, f"zero.stage={stage}"]
    first = run_ranks(_rank_main, 1, tmp_path, overrides, None)
    assert len(first["losses"]) == STEPS and isinstance(first["snapshot"], bytes)
    assert first["losses"][-1] < first["losses"][0], f"bf16 training did not learn: {first['losses']}"

    second = run_ranks(_rank_main, 1, tmp_path, overrides, first["snapshot"])

    # The round trip: what the restore loaded is what was saved, bit for bit.
    saved, loaded = _state(first["snapshot"]), second["restored_state"]
    assert saved.keys() == loaded.keys()
    changed = [key for key in saved if saved[key] != loaded[key]]
    assert not changed, f"{len(changed)} fragments differ after the round trip, e.g. {changed[:3]}"
    for name, value in first["params_at_cut"].items():
        np.testing.assert_array_equal(second["restored_params"][name], value, err_msg=name)

    # Training goes on from there as it did the first time. The first resumed loss is a forward
    # pass over restored weights and the restored data position: the same arithmetic in the
    # same order, so the same bits. Later steps follow backward passes, which may differ in
    # their last bits run to run, and are held to the size of that variation.
    assert len(second["losses"]) == STEPS - CUT
    assert second["losses"][0] == first["losses"][CUT], (second["losses"][0], first["losses"][CUT])
    np.testing.assert_allclose(second["losses"], first["losses"][CUT:], rtol=2e-3)
    for name, value in first["params"].items():
        moved = np.abs(value - first["params_at_cut"][name]).mean()
        apart = np.abs(second["params"][name] - value).mean()
        assert apart <= 0.1 * moved + 1e-6, f"{name}: the runs differ by {apart:.2e}, the weights moved {moved:.2e}"

    # SDC probes: fixed inputs, so the same digests round after round and process after process.
    for out in (first, second):
        assert out["probes"][0] == out["probes"][1]
    assert first["probes"][0] == second["probes"][0]
    assert any(name.startswith("all_reduce") for name in first["probes"][0]), first["probes"][0]
