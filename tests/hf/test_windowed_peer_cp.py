"""Windowed models under context parallelism against transformers' own: each gloo rank runs its
zigzag shard of a 64-token sequence through ring, Ulysses or hybrid attention with windows of
8, 13 and 24 tokens (shorter and longer than a rank's chunk), and its logits equal transformers' at the same true positions (fp32, 1e-5 relative).
Tiny Gemma 3 (local and global layers, each with its RoPE), Mistral and Qwen2, one spawn per
layout; the table of gaps is printed (``-s``)."""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

import pytest

from ringtrain_dev.ranks import gloo_rank, run_ranks
from tests.hf.test_peer_cp import LAYOUTS
from tests.hf.windowed_models import MODELS

pytestmark = [pytest.mark.dist, pytest.mark.slow]

SEQ = 64


def _rank_main(
    rank: int, world: int, store: str, impl: str, ulysses: int, exchange: str, folders: dict[str, str], results: mp.Queue
) -> None:
    import torch
    import torch.distributed as dist

    from ringtrain import config
    from ringtrain.hf import resolve_job
    from ringtrain.hf.weights import PretrainedWeights, load_full
    from ringtrain.topology import Topology, sequence_positions
    from ringtrain.train.attention import build_attention
    from ringtrain.train.mesh import build_mesh
    from ringtrain.train.model import ModelArgs, Transformer
    from tests.hf_models import hf_logits, tokens

    with gloo_rank(rank, world, store, results):
        topology = Topology(1, world, ulysses)
        mesh = build_mesh(topology, rank)
        attention = build_attention(
            impl, "auto", ring_group=mesh.ring_group, ulysses_group=mesh.ulysses_group, kv_exchange=exchange
        )
        c = mesh.coord
        pos = torch.tensor(sequence_positions(SEQ, topology.ring, topology.ulysses, c.ring_idx, c.ulysses_idx))
        ids = tokens(2, SEQ)
        gaps = {}
        for name, folder in folders.items():
            job = resolve_job(config.load(None, [f"model.hf={folder}", f"data.seq_len={SEQ}"]))
            model = Transformer(ModelArgs.from_job(job), attention_fn=attention, init_std=None)
            load_full(model, PretrainedWeights(folder))
            with torch.no_grad():
                logits = model(ids[:, pos], pos.expand(2, -1))
            ref, _ = hf_logits(Path(folder), ids)
            gaps[name] = float((logits - ref[:, pos]).abs().max() / ref.abs().max())
        gathered: list[dict[str, float]] = [{}] * world
        dist.all_gather_object(gathered, gaps)
        if rank == 0:
            results.put({name: max(g[name] for g in gathered) for name in folders})


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    from tests.hf.windowed_models import save_windowed

    root = tmp_path_factory.mktemp("windowed")
    return {name: str(save_windowed(root / name, name)) for name in MODELS}


@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUTS)
def test_windowed_logits_equal_transformers_under_cp(layout: str, folders: dict[str, str], tmp_path: Path) -> None:
    impl, cp, ulysses, exchange = LAYOUTS[layout]
    gaps = run_ranks(_rank_main, cp, tmp_path, impl, ulysses, exchange, folders)
    assert set(gaps) == set(folders)
    for name, gap in gaps.items():
        print(f"{name} {layout}: relative logit gap {gap:.2e}")
    worst = max(gaps, key=gaps.get)
    assert gaps[worst] < 1e-5, f"{worst}: {gaps[worst]:.2e}"
