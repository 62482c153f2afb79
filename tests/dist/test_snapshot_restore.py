"""Restoring a snapshot resumes training exactly: bitwise at the same mesh, within float
tolerance at another dp, for every ZeRO stage.

Each case trains STEPS steps uninterrupted while taking the snapshot of step CUT, then starts
fresh processes, restores that snapshot and trains the remaining steps. A DPO run does so with
the reference table its first world took, read back from a checkpoint store: no pass over the
data runs again (one would fail the resumed ranks). And a world that fails while it snapshots a
step (before the copy starts, half-way through it, after it) is left the snapshots it resumes
from exactly, at every ZeRO stage.
"""

from __future__ import annotations

import json
import multiprocessing as mp
from pathlib import Path
from typing import Any, Optional

import numpy as np
import pytest

from ringtrain_dev.ranks import run_ranks
from ringtrain_dev.tiny import TINY_MODEL

pytestmark = [pytest.mark.dist, pytest.mark.slow]

STEPS, CUT = 6, 3
TINY = [
    *TINY_MODEL,
    "data.seq_len=64",
    "train.global_batch=4",
    f"train.steps={STEPS}",
    "train.warmup_steps=2",
]


def _rank_main(
    rank: int, world: int, store_path: str, overrides: list[str], blobs: Optional[list[bytes]], reference: Any,
    results: mp.Queue,
) -> None:
    import torch
    import torch.distributed as dist

    from ringtrain import config
    from ringtrain.train import reference as reference_pass
    from ringtrain.train.trainer import Trainer, set_rank_env

    torch.set_num_threads(1)
    device = torch.device("cpu")
    set_rank_env(rank=rank, world_size=world, device=device)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    try:
        if reference is not None:  # the run's stored table is given: a pass over the data would be a bug

            def computed_again(*args: Any, **kwargs: Any) -> Any:
                raise AssertionError("the reference log-probs were computed again")

            reference_pass.pair_logps = computed_again
        trainer = Trainer(config.load(None, overrides), rank=rank, device=device, reference=reference)
        losses, snapshot = [], None
        if blobs is not None:
            assert trainer.restore(blobs) == CUT
            # The restore re-snapshots the state it wrote: the caller compares it with ``blobs``.
            snapshot = bytes(trainer.snapshot(CUT).blob)
        while trainer.step < STEPS:
            losses.append(trainer.train_step().loss)
            if trainer.step == CUT and blobs is None:
                snapshot = bytes(trainer.snapshot(CUT).blob)
        shards: list[Optional[bytes]] = [None] * world
        dist.all_gather_object(shards, snapshot)
        params = {k: v.numpy() for k, v in trainer.parameters_fp32().items()}
        if rank == 0:
            results.put((losses, shards, params, trainer.reference))
        trainer.close()
    except BaseException as exc:
        results.put(exc)
        raise


def _warm_up_rank(rank: int, world: int, store_path: str, overrides: list[str], results: mp.Queue) -> None:
    """A spare's rehearsal of the job (``trainer.warm_up``), no pass over the data allowed."""
    import torch

    from ringtrain import config
    from ringtrain.train import reference as reference_pass
    from ringtrain.train.trainer import warm_up

    def computed(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a warm-up computed the reference log-probs")

    try:
        reference_pass.pair_logps = computed
        warm_up(config.load(None, overrides), torch.device("cpu"))
        results.put(True)
    except BaseException as exc:
        results.put(exc)
        raise


# Where the world fails while it snapshots a step: the step whose copy it was, and the point of
# that copy. Each time it restores from what its snapshotters have left, and trains on.
COPY_FAILURES = {2: "before", 3: "half-way", 4: "after"}


def _rank_fails_while_it_snapshots(rank: int, world: int, store_path: str, overrides: list[str], results: mp.Queue) -> None:
    import contextlib

    import torch
    import torch.distributed as dist

    from ringtrain import config
    from ringtrain.train import snapshot as snapshot_module
    from ringtrain.train.trainer import Trainer, set_rank_env

    torch.set_num_threads(1)
    device = torch.device("cpu")
    set_rank_env(rank=rank, world_size=world, device=device)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    try:
        trainer = Trainer(config.load(None, overrides), rank=rank, device=device)
        snapshotter = trainer.snapshotter
        assert snapshotter is not None
        failing: dict[str, int] = {}  # point -> the step whose copy fails there, while it is due
        real_copy_each = snapshot_module._copy_each

        def copy_each(hosts: list[torch.Tensor], sources: list[torch.Tensor], *, non_blocking: bool = False) -> None:
            if failing.get("half-way") == trainer.step:
                real_copy_each(hosts[: len(hosts) // 2], sources[: len(sources) // 2])
                raise RuntimeError("the rank failed half-way through the copy")
            real_copy_each(hosts, sources, non_blocking=non_blocking)

        snapshot_module._copy_each = copy_each
        real_maybe_snapshot = trainer._maybe_snapshot
        # "before": the failure strikes between the optimizer step and the capture.
        trainer._maybe_snapshot = lambda: failing.get("before") != trainer.step and real_maybe_snapshot()  # type: ignore[method-assign]
        losses: dict[int, float] = {}
        redone: list[tuple[int, float]] = []
        resumed_at: list[int] = []
        failures = dict(COPY_FAILURES)
        while trainer.step < STEPS:
            step = trainer.step + 1
            point = failures.pop(step, None)
            failing.clear()
            if point is not None:
                failing[point] = step
            loss = trainer.train_step().loss
            if step in losses:
                redone.append((step, loss))
            losses[step] = loss
            if point is None:
                continue
            with contextlib.suppress(RuntimeError):
                snapshotter.wait()  # the copy in flight when the rank failed: done, or failed
            failing.clear()
            newest = snapshotter.newest()
            assert newest is not None
            blobs: list[Optional[bytes]] = [None] * world
            dist.all_gather_object(blobs, bytes(newest.blob))
            resumed_at.append(trainer.restore([b for b in blobs if b is not None]))
        params = {k: v.numpy() for k, v in trainer.parameters_fp32().items()}
        if rank == 0:
            results.put((losses, redone, resumed_at, params))
        trainer.close()
    except BaseException as exc:
        results.put(exc)
        raise


_UNINTERRUPTED: dict[tuple[str, ...], Any] = {}


def uninterrupted(overrides: list[str], tmp_path: Path) -> Any:
    """``run``'s of a run nothing interrupts, taken once per job in this module."""
    key = tuple(overrides)
    if key not in _UNINTERRUPTED:
        _UNINTERRUPTED[key] = run(overrides, tmp_path)
    return _UNINTERRUPTED[key]


def run(overrides: list[str], tmp_path: Path, blobs: Optional[list[bytes]] = None, reference: Any = None) -> Any:
    """(losses, every rank's snapshot of CUT, parameters)."""
    return run_with_table(overrides, tmp_path, blobs, reference)[:3]


def run_with_table(overrides: list[str], tmp_path: Path, blobs: Optional[list[bytes]] = None, reference: Any = None) -> Any:
    """``run``'s, and the reference table the Trainer scored against (None: no DPO or IPO)."""
    from ringtrain import config

    return run_ranks(_rank_main, config.load(None, overrides).world_size, tmp_path, overrides, blobs, reference)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_resume_is_exact_at_the_same_mesh_and_close_at_another_dp(stage: int, tmp_path: Path) -> None:
    grid = TINY + ["mesh.dp=2", "mesh.cp=2", f"zero.stage={stage}"]
    losses, shards, params = uninterrupted(grid, tmp_path)
    assert len(losses) == STEPS and all(isinstance(s, bytes) for s in shards)

    resumed_losses, _, resumed_params = run(grid, tmp_path, blobs=shards)
    assert resumed_losses == losses[CUT:]  # bitwise: same arithmetic in the same order
    for name, value in params.items():
        np.testing.assert_array_equal(resumed_params[name], value, err_msg=name)

    # dp 2 x cp 2 -> one rank: the fragments tile every parameter, so any mesh can load them.
    single_losses, _, single_params = run(TINY + ["mesh.dp=1", "mesh.cp=1", f"zero.stage={stage}"], tmp_path, blobs=shards)
    np.testing.assert_allclose(single_losses, losses[CUT:], rtol=1e-5)
    for name, value in params.items():
        np.testing.assert_allclose(single_params[name], value, rtol=0, atol=1e-5, err_msg=name)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_failure_at_any_point_of_a_snapshot_copy_resumes_bitwise(stage: int, tmp_path: Path) -> None:
    """The world fails while it snapshots step 2 (before the copy starts), step 3 (half-way
    through it) and step 4 (after it), and restores each time from its newest whole snapshot:
    steps 1, 2 and 4. Every step, redone ones included, and the final weights are the
    uninterrupted run's, bit for bit."""
    grid = TINY + ["mesh.dp=2", "mesh.cp=2", f"zero.stage={stage}"]
    losses, _, params = uninterrupted(grid, tmp_path)
    from ringtrain import config

    got, redone, resumed_at, got_params = run_ranks(_rank_fails_while_it_snapshots, config.load(None, grid).world_size,
                                                    tmp_path, grid)  # fmt: skip
    assert resumed_at == [1, 2, 4]
    assert [got[step] for step in range(1, STEPS + 1)] == losses
    assert redone == [(2, losses[1]), (3, losses[2])]
    for name, value in params.items():
        np.testing.assert_array_equal(got_params[name], value, err_msg=name)


def _payload(blob: bytes) -> dict[tuple[str, str, int], np.ndarray]:
    from ringtrain.checkpoint.wire import decode

    shard = decode(blob)
    return {(e["name"], e["key"], e["start"]): shard.array(e) for e in shard.entries}


def test_zero0_bf16_snapshot_holds_the_fp32_master_and_resumes_bitwise(tmp_path: Path) -> None:
    """Without ZeRO, bf16 puts DeepSpeed's FP16_UnfusedOptimizer around Adam, whose state is
    keyed by its own fp32 copies of the weights: the snapshot must read (and a restore write)
    those, not the bf16 model weights."""
    grid = TINY + ["mesh.dp=2", "mesh.cp=1", "zero.stage=0", "train.dtype=bf16"]
    losses, shards, params = run(grid, tmp_path)
    by_key: dict[str, list[np.ndarray]] = {}
    for blob in shards:
        for (_, key, _), values in _payload(blob).items():
            by_key.setdefault(key, []).append(values)
    # Adam's moments after CUT steps are not zero, and the master is fp32: some of its values
    # carry bits below bf16's 16.
    for key in ("exp_avg", "exp_avg_sq"):
        assert any(np.any(v != 0) for v in by_key[key]), f"{key} is all zeros"
    assert any(np.any(v.view(np.uint32) & 0xFFFF) for v in by_key["param"]), "the snapshot holds bf16 weights"

    resumed_losses, restored_shards, resumed_params = run(grid, tmp_path, blobs=shards)
    for saved, restored in zip(shards, restored_shards, strict=True):
        saved_arrays, restored_arrays = _payload(saved), _payload(restored)
        assert saved_arrays.keys() == restored_arrays.keys()
        for where, values in saved_arrays.items():
            np.testing.assert_array_equal(restored_arrays[where], values, err_msg=str(where))
    assert resumed_losses == losses[CUT:]
    for name, value in params.items():
        np.testing.assert_array_equal(resumed_params[name], value, err_msg=name)


def test_a_chat_run_shrunk_mid_epoch_goes_on_as_the_uninterrupted_run(tmp_path: Path) -> None:
    """Elastic shrink on a chat dataset: dp 2 x cp 2 snapshotted at step CUT, inside an epoch,
    resumed on one rank. The rows a step trains depend on the seed and the data alone
    (tests/unit/test_chat_packing.py), so the resumed steps see the same conversations, masks
    and per-conversation weights: losses and parameters as the uninterrupted run's, within fp32
    tolerance (the gradient is summed in another order on one rank)."""
    from ringtrain_dev.chat_data import random_conversations, write_chat

    root = tmp_path / "chat"
    # ~26 rows of 64 tokens: step CUT (12 rows in) falls inside the first epoch, STEPS crosses it.
    write_chat(root, random_conversations(48, vocab_size=256, min_len=10, max_len=60, seed=5), vocab_size=256, docs_per_shard=16)
    chat = [*TINY, f"data.path={root}", "data.packing=doc", "train.loss_norm=sequence", "zero.stage=2"]
    losses, shards, params = run([*chat, "mesh.dp=2", "mesh.cp=2"], tmp_path)
    shrunk_losses, _, shrunk_params = run([*chat, "mesh.dp=1", "mesh.cp=1"], tmp_path, blobs=shards)
    assert len(shrunk_losses) == STEPS - CUT
    np.testing.assert_allclose(shrunk_losses, losses[CUT:], rtol=1e-5)
    for name, value in params.items():
        np.testing.assert_allclose(shrunk_params[name], value, rtol=0, atol=1e-5, err_msg=name)


def test_a_dpo_run_resumed_or_shrunk_mid_epoch_scores_against_its_stored_table(tmp_path: Path) -> None:
    """DPO, dp 2 snapshotted at step CUT inside the first epoch of pairs, its reference table
    stored as the driver stores it (``ReferenceKeeper``) and read back by a keeper of a new run:
    resumed at dp 2, and shrunk to one rank, the remaining steps' losses and the parameters are
    bitwise the uninterrupted run's, and neither computes the table again (nor does a spare's
    warm-up for the job). Bitwise at another
    dp too: without CP each pair's forward is one rank's either way, the two replicas' gradients
    meet in one sum of two (a + b, as the accumulation's), every scale is the same number (the
    pairs' ``dp x accumulation / N``) and the gradient is not clipped."""
    from ringtrain import cli, config
    from ringtrain.actors.reference_keeper import ReferenceKeeper, run_key
    from ringtrain.checkpoint import open_store
    from ringtrain.commands.reference import initial_identity
    from ringtrain.train.mixture import open_mixture
    from ringtrain_dev.tiny_tokenizer import CHAT_WORDS, save_chat_tokenizer

    rng = np.random.default_rng(3)

    def say(n: int) -> str:
        return " ".join(rng.choice(CHAT_WORDS, size=n))

    records = [{"prompt": say(int(rng.integers(2, 8))), "chosen": say(int(rng.integers(1, 5))) + " yes",
                "rejected": say(int(rng.integers(1, 5))) + " no"} for _ in range(36)]  # fmt: skip
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    tokenizer = save_chat_tokenizer(tmp_path / "tokenizer", "chatml", vocab_size=320)
    assert cli.main(["prepare", str(tmp_path / "pairs.jsonl"), "--format", "preference", "--tokenizer", str(tokenizer),
                     "--out", str(tmp_path / "data"), "--quiet"]) == 0  # fmt: skip
    dpo = [*TINY, "model.vocab_size=320", f"data.path={tmp_path / 'data'}", "data.packing=doc", "train.objective=dpo",
           "train.micro_batch=2", "train.grad_clip=0", "zero.stage=2", "mesh.cp=1"]  # fmt: skip
    rows = open_mixture(config.load(None, dpo)).pair_rows().num_rows
    assert CUT * 4 < rows, rows  # the cut falls inside the first epoch of pairs
    losses, shards, params, table = run_with_table([*dpo, "mesh.dp=2"], tmp_path)
    assert table is not None and table.shape[1] == 2 and np.any(table != 0)

    job = config.load(None, [*dpo, "mesh.dp=2"])
    key = run_key(job, initial_identity(job), "cpu")
    store = open_store((tmp_path / "checkpoints").as_uri())
    ReferenceKeeper(key, None, store=store).learned(table)
    again = ReferenceKeeper(key, None, store=store)  # a later run of the same run directory
    assert again.table is not None and again.computed == 0
    np.testing.assert_array_equal(again.table, table)
    reference = again.join_input()

    # A spare warming up for this job rehearses its step without a pass over the data.
    assert run_ranks(_warm_up_rank, 1, tmp_path, [*dpo, "mesh.dp=2"]) is True

    for mesh in (["mesh.dp=2"], ["mesh.dp=1"]):
        resumed_losses, _, resumed_params, used = run_with_table([*dpo, *mesh], tmp_path, blobs=shards, reference=reference)
        assert resumed_losses == losses[CUT:], mesh
        np.testing.assert_array_equal(used, table)
        for name, value in params.items():
            np.testing.assert_array_equal(resumed_params[name], value, err_msg=f"{mesh} {name}")
