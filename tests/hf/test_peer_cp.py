"""ringtrain's decoder under context parallelism against transformers' own: each gloo rank runs
its zigzag shard of the sequence through ring, Ulysses or hybrid attention, and its logits
equal transformers' logits at the same true positions (fp32, 1e-5 relative). Every
architecture, with default, llama3 and yarn rotary embeddings, in one spawn per layout."""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

import pytest

from ringtrain_dev.ranks import gloo_rank, run_ranks
from tests.hf_models import ARCHS

pytestmark = [pytest.mark.dist, pytest.mark.slow]

SEQ = 64
# impl, cp, ulysses, how the ring exchanges K/V
LAYOUTS = {
    "ring-cp2": ("ring", 2, 1, "ring"),
    "ring-cp2-allgather": ("ring", 2, 1, "allgather"),
    "ulysses-cp2": ("ulysses", 2, 2, "ring"),
    "hybrid-cp4": ("hybrid", 4, 2, "ring"),
}


def logit_gaps(
    rank: int, world: int, store: str, impl: str, ulysses: int, exchange: str, folders: dict[str, str], results: mp.Queue
) -> None:
    """A rank's body: each model folder's logits of the rank's shard under the layout, against
    transformers' at the same positions; rank 0 puts each folder's worst relative gap."""
    import torch
    import torch.distributed as dist

    from ringtrain import config
    from ringtrain.hf import resolve_job
    from ringtrain.hf.weights import PretrainedWeights, load_full
    from ringtrain.topology import Topology, cp_layout, sequence_positions
    from ringtrain.train.attention import build_attention
    from ringtrain.train.mesh import build_mesh
    from ringtrain.train.model import ModelArgs, Transformer
    from tests.hf_models import hf_logits, tokens

    with gloo_rank(rank, world, store, results):
        layout = cp_layout(impl, world, ulysses, exchange)
        topology = Topology(1, layout.cp, layout.ulysses)
        mesh = build_mesh(topology, rank)
        attention = build_attention(layout, "auto", ring_group=mesh.ring_group, ulysses_group=mesh.ulysses_group)
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
    from tests.hf.test_peer import ROPES
    from tests.hf_models import save_model

    root = tmp_path_factory.mktemp("models")
    out = {}
    for arch in ARCHS:
        for rope in ("default", "llama3", "yarn"):
            folder = root / f"{arch}-{rope}"
            save_model(folder, arch, rope=ROPES[rope], max_position_embeddings=128 if ROPES[rope] else 32)
            out[f"{arch}-{rope}"] = str(folder)
    return out


@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUTS)
def test_context_parallel_logits_equal_transformers(layout: str, folders: dict[str, str], tmp_path: Path) -> None:
    impl, cp, ulysses, exchange = LAYOUTS[layout]
    gaps = run_ranks(logit_gaps, cp, tmp_path, impl, ulysses, exchange, folders)
    assert set(gaps) == set(folders)
    worst = max(gaps, key=gaps.get)
    assert gaps[worst] < 1e-5, f"{worst}: {gaps[worst]:.2e}"
