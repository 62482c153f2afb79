"""``ringtrain export`` of checkpoints the Trainer wrote, on a 2-rank gloo world.

Each case imports a tiny Hugging Face model (``model.hf``), trains it on dp=2 under some ZeRO
stage, and saves the ranks' snapshots with the meta a run records, as the Persister does. Then:

- the round trip: at a learning rate too small to move any fp32 weight, the export gives back
  the imported tensors bit for bit, for each architecture, with tied embeddings, and with a
  rope_scaling whose exported config.json reads back to the same model keys;
- the trained model: after real steps with an extended context (yarn over the source's 32
  positions), transformers' logits of the export equal ringtrain's logits of the checkpoint.
"""

from __future__ import annotations

import json
import multiprocessing as mp
from pathlib import Path
from typing import Any, Optional

import numpy as np
import pytest
import torch

from ringtrain import cli
from ringtrain_dev.ranks import gloo_rank, run_ranks
from tests.hf_models import ARCHS, hf_logits, save_model, tokens

pytestmark = [pytest.mark.dist, pytest.mark.slow]

WORLD = 2
SEQ = 32
LLAMA3 = {
    "rope_type": "llama3", "rope_theta": 500000.0, "factor": 4.0, "low_freq_factor": 1.0,
    "high_freq_factor": 4.0, "original_max_position_embeddings": 32,
}
# name -> (architecture, save_model keywords, ZeRO stage): every stage is covered once at least.
ROUND_TRIPS: dict[str, tuple[str, dict[str, Any], int]] = {
    "llama": ("llama", {}, 1),
    "mistral": ("mistral", {}, 2),
    "qwen2": ("qwen2", {}, 3),
    "qwen3": ("qwen3", {}, 2),
    "qwen2-tied": ("qwen2", {"tie": True}, 3),
    "llama-llama3": ("llama", {"rope": LLAMA3, "max_position_embeddings": 128}, 0),
}
# A rate whose every update rounds to nothing in fp32. 1e-30 is not: the padding row of a tied
# embedding is exactly zero, gets a gradient through the output projection, and 0 + 1e-30 is a
# float32 number.
FROZEN = ["train.lr=1e-50", "train.warmup_steps=0", "train.steps=1"]
# Trained for real at twice the source's context, with yarn stretching its 32 positions.
TRAINED_SEQ = 64
TRAINED = [
    "train.lr=1e-2", "train.warmup_steps=0", "train.steps=3", f"data.seq_len={TRAINED_SEQ}",
    "model.rope_scaling={rope_type: yarn, factor: 2.0, original_max_position_embeddings: 32}",
]


def _rank_main(rank: int, world: int, store_path: str, cases: list[tuple[list[str], str]], results: mp.Queue) -> None:
    import torch.distributed as dist

    from ringtrain import config
    from ringtrain.actors.persister import shard_name
    from ringtrain.actors.resume import checkpoint_meta
    from ringtrain.checkpoint import open_store
    from ringtrain.hf import resolve_job
    from ringtrain.train.trainer import Trainer

    with gloo_rank(rank, world, store_path, results):
        for overrides, store_uri in cases:  # one world for every case: spawning one costs seconds
            job = resolve_job(config.load(None, overrides))
            trainer = Trainer(job, rank=rank, device=torch.device("cpu"))
            while trainer.step < job.train.steps:
                trainer.train_step()
            blobs: list[Optional[bytes]] = [None] * world
            dist.all_gather_object(blobs, bytes(trainer.snapshot(trainer.step).blob))
            if rank == 0:  # what the Persister writes
                shards = {shard_name(r): blob for r, blob in enumerate(blobs) if blob is not None}
                meta = dict(checkpoint_meta(job), step=trainer.step, world_size=world)
                open_store(store_uri).save(trainer.step, shards, meta)
            assert trainer.snapshotter is not None
            trainer.snapshotter.close()
        if rank == 0:
            results.put("ok")


def _job(folder: Path, data: Path, stage: int, extra: list[str]) -> list[str]:
    return [
        f"model.hf={folder}", f"data.path={data}", f"data.seq_len={SEQ}", "mesh.dp=2",
        "train.global_batch=2", f"zero.stage={stage}", *extra,
    ]


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path, list[str]]]:
    """Case name -> (the source model folder, its checkpoint store, the job's overrides)."""
    root = tmp_path_factory.mktemp("export")
    data = root / "tokens.bin"
    np.random.default_rng(0).integers(3, 96, size=16384).astype(np.uint16).tofile(data)
    cases: dict[str, tuple[Path, Path, list[str]]] = {}
    for name, (arch, kwargs, stage) in ROUND_TRIPS.items():
        folder = save_model(root / name / "hf", arch, **kwargs)
        cases[name] = (folder, root / name / "checkpoints", _job(folder, data, stage, FROZEN))
    folder = save_model(root / "trained" / "hf", "qwen2")  # biases too
    cases["trained"] = (folder, root / "trained" / "checkpoints", _job(folder, data, 2, TRAINED))
    run_ranks(_rank_main, WORLD, root, [(overrides, store.as_uri()) for _, store, overrides in cases.values()])
    return cases


def export(source: Path, out: Path, *flags: str) -> Path:
    assert cli.main(["export", str(source), str(out), *flags]) == 0
    return out


def safetensors_of(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {name: t for file in sorted(folder.glob("*.safetensors")) for name, t in load_file(file).items()}


@pytest.mark.parametrize("case", ROUND_TRIPS)
def test_export_gives_back_the_imported_tensors_exactly(case: str, trained: dict[str, Any], tmp_path: Path) -> None:
    from ringtrain.hf.hfconfig import model_fields, read_hf_config

    source, store, _ = trained[case]
    out = export(store, tmp_path / "out")
    original, exported = safetensors_of(source), safetensors_of(out)
    assert exported.keys() == original.keys()
    gaps = {name: float((exported[name] - t).abs().max()) for name, t in original.items()}
    assert all(exported[name].dtype == torch.float32 for name in exported)
    print(f"{case}: round-trip max abs diff {max(gaps.values()):.1e} over {len(gaps)} tensors")
    assert max(gaps.values()) == 0.0, {k: v for k, v in gaps.items() if v}
    # The exported config means the same model (rope_scaling included) to ringtrain's reader,
    # and to transformers: the same weights under either config.json give the same logits.
    assert model_fields(read_hf_config(out)) == model_fields(read_hf_config(source))
    ids = tokens(2, SEQ)
    assert torch.equal(hf_logits(out, ids)[0], hf_logits(source, ids)[0])
    assert json.loads((out / "generation_config.json").read_text()) == json.loads((source / "generation_config.json").read_text())


def test_tied_embeddings_export_no_lm_head(trained: dict[str, Any], tmp_path: Path) -> None:
    tied = safetensors_of(export(trained["qwen2-tied"][1], tmp_path / "tied"))
    untied = safetensors_of(export(trained["qwen2"][1], tmp_path / "untied"))
    assert "lm_head.weight" not in tied and "lm_head.weight" in untied
    assert json.loads((tmp_path / "tied" / "config.json").read_text())["tie_word_embeddings"] is True


def test_a_trained_export_gives_ringtrains_logits(trained: dict[str, Any], tmp_path: Path) -> None:
    from ringtrain import config
    from ringtrain.checkpoint import open_store
    from ringtrain.hf import resolve_job
    from ringtrain.topology import CPLayout
    from ringtrain.train.attention import build_attention
    from ringtrain.train.model import ModelArgs, Transformer
    from ringtrain.checkpoint.wire import FragmentIndex, decode

    source, store_path, overrides = trained["trained"]
    out = export(store_path, tmp_path / "out")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["max_position_embeddings"] == TRAINED_SEQ
    assert cfg["rope_parameters"] == {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 32, "rope_theta": 10000.0}

    # ringtrain's own forward pass on the checkpoint's weights, read without the export's code.
    job = resolve_job(config.load(None, overrides))
    store = open_store(store_path.as_uri())
    loaded = store.load(store.list()[0].step)
    index = FragmentIndex([decode(loaded.shards[name]) for name in loaded.shards])
    local = build_attention(CPLayout(1, 1), "auto", ring_group=None, ulysses_group=None)
    model = Transformer(ModelArgs.from_job(job), attention_fn=local, init_std=None)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.from_numpy(index.full(name)))
    moved = max(float((safetensors_of(out)[k] - t).abs().max()) for k, t in safetensors_of(source).items())
    assert moved > 1e-3, "training must have moved the weights, or this compares the source with itself"

    ids = tokens(2, TRAINED_SEQ)
    with torch.no_grad():
        ours = model(ids, torch.arange(TRAINED_SEQ).expand_as(ids))
    theirs, _ = hf_logits(out, ids)
    gap = float((theirs - ours).abs().max() / ours.abs().max())
    print(f"relative logit gap of the exported model: {gap:.2e}")
    assert gap < 1e-5


def test_every_architecture_is_covered() -> None:
    assert {arch for arch, _, _ in ROUND_TRIPS.values()} == set(ARCHS)
    assert {stage for _, _, stage in ROUND_TRIPS.values()} == {0, 1, 2, 3}
