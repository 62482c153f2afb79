"""Document packing under context parallelism: a packed sample trains as its documents alone.

A prepared dataset is read with ``data.packing: doc`` through ``ShardedData`` (each CP rank
its positions, document ids and restarted position ids) into the model with ring, Ulysses or
hybrid attention on gloo ranks. The loss over the packed micro-batch must equal the
token-weighted mean of each document's loss computed alone (the document as its own sequence,
positions from 0, plain local attention, no document ids), in fp32 to 1e-5, and the gradients
of every parameter must match too.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from ringtrain_dev.prepared_data import random_documents, write_prepared
from ringtrain_dev.ranks import gloo_rank, run_ranks

VOCAB, EOS, SEQ = 64, 3, 32


def _model(attention_fn: Any) -> Any:
    from ringtrain.train.model import ModelArgs, Transformer

    args = ModelArgs(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, ffn_dim=48,
                     norm_eps=1e-5, rope_theta=10000.0)
    torch.manual_seed(0)
    # Peaky weights: with the default init a tiny model's loss barely depends on what it sees.
    return Transformer(args, attention_fn=attention_fn, init_std=0.35)


def _loss_sum(logits_BSV: torch.Tensor, labels_BS: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits_BSV.flatten(0, 1).float(), labels_BS.flatten(), ignore_index=-100,
                                             reduction="sum")


def _reference(mb: Any) -> tuple[float, dict[str, torch.Tensor]]:
    """Each document of each sample alone: the token-weighted mean loss and its gradients."""
    from ringtrain.topology import CPLayout
    from ringtrain.train.attention import build_attention

    model = _model(build_attention(CPLayout(1, 1), "auto", ring_group=None, ulysses_group=None))
    total, count = torch.zeros(()), 0
    for b in range(mb.input_ids.shape[0]):
        for doc in np.unique(mb.doc_ids[b]):
            where = mb.doc_ids[b] == doc
            ids, labels = torch.as_tensor(mb.input_ids[b][where])[None], torch.as_tensor(mb.labels[b][where])[None]
            positions = torch.arange(ids.shape[1])[None]
            total = total + _loss_sum(model(ids, positions), labels)
            count += int((labels != -100).sum())
    loss = total / count
    loss.backward()
    return float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters()}


def _rank(rank: int, world: int, store: str, root: str, impl: str, ulysses: int, results: Any) -> None:
    with gloo_rank(rank, world, store, results):
        import torch.distributed as dist

        from ringtrain.topology import Topology, cp_layout
        from ringtrain.train.attention import build_attention
        from ringtrain.train.corpus import PreparedCorpus
        from ringtrain.train.data import BatchPlan, ShardedData
        from ringtrain.train.mesh import build_mesh
        from ringtrain.train.mixture import MixedSamples, SourceSpec

        layout = cp_layout(impl, world, ulysses)
        topology = Topology(1, layout.cp, layout.ulysses)
        mesh = build_mesh(topology, rank)

        def data(ring: int, ulysses: int, ring_idx: int, ulysses_idx: int) -> Any:
            samples = MixedSamples([PreparedCorpus(root)], [SourceSpec(root)], seq_len=SEQ, seed=5, packing="doc")
            return ShardedData(samples, seq_len=SEQ, seed=5, plan=BatchPlan(2, 1, 2), ring=ring, ulysses=ulysses,
                               ring_idx=ring_idx, ulysses_idx=ulysses_idx, vocab_size=VOCAB)

        mb = data(topology.ring, topology.ulysses, mesh.coord.ring_idx, mesh.coord.ulysses_idx).step_batches(1, 0)[0]
        model = _model(build_attention(layout, "auto", ring_group=mesh.ring_group, ulysses_group=mesh.ulysses_group))
        labels = torch.as_tensor(mb.labels)
        local = _loss_sum(model(torch.as_tensor(mb.input_ids), torch.as_tensor(mb.position_ids),
                                doc_ids_BS=torch.as_tensor(mb.doc_ids)), labels)
        count = torch.tensor([float((labels != -100).sum())])
        dist.all_reduce(count)
        # Each rank's share of the mean; the CP ranks' parameter gradients add up to the whole's.
        (local / count).backward()
        loss = local.detach().clone()
        dist.all_reduce(loss)
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        for g in grads.values():
            dist.all_reduce(g)
        if rank == 0:
            full = data(1, 1, 0, 0).step_batches(1, 0)[0]
            assert len(np.unique(full.doc_ids)) >= 4, "the sample should pack several documents"
            ref_loss, ref_grads = _reference(full)
            results.put({
                "loss": float(loss / count), "ref_loss": ref_loss,
                "grad_diff": max(float((grads[n] - ref_grads[n]).abs().max()) for n in grads),
                "grad_scale": max(float(g.abs().max()) for g in ref_grads.values()),
            })


@pytest.mark.parametrize(("impl", "world", "ulysses"), [("ring", 2, 1), ("ulysses", 2, 2), ("hybrid", 4, 2)])
def test_a_packed_sample_trains_as_its_documents_alone(tmp_path: Path, impl: str, world: int, ulysses: int) -> None:
    docs = random_documents(12, vocab_size=VOCAB, eos_id=EOS, min_len=5, max_len=14, seed=2)
    write_prepared(tmp_path / "data", docs, vocab_size=VOCAB, eos_id=EOS)
    out = run_ranks(_rank, world, tmp_path, str(tmp_path / "data"), impl, ulysses)
    print(f"{impl} cp{world}: loss {out['loss']:.7f} alone {out['ref_loss']:.7f} "
          f"|dloss| {abs(out['loss'] - out['ref_loss']):.2e} max|dgrad| {out['grad_diff']:.2e}")
    assert out["loss"] == pytest.approx(out["ref_loss"], abs=1e-5, rel=0)
    assert out["grad_diff"] <= 1e-5 * max(1.0, out["grad_scale"])
