"""Windowed models out again: ``ringtrain export`` of a checkpoint holding an imported Gemma 3,
Mistral or Qwen2 gives back every tensor bit for bit, and a config.json that transformers reads
as the same model (its logits equal the source's exactly). What a job changed comes back out:
Gemma 3's global RoPE scaled and its local one kept, Qwen2's windowed layers moved, windows
dropped; and a model trained from scratch with Gemma's block or windows on every layer
exports as the architecture that has them, with ringtrain's logits.

Checkpoints are written as the Persister writes them (tests/unit/test_export.py's
``write_checkpoint``), without training.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from ringtrain import config
from ringtrain.hf import resolve_job
from ringtrain.hf.export import export
from ringtrain.hf.hfconfig import model_fields
from ringtrain.hf.weights import PretrainedWeights, load_full
from ringtrain.topology import CPLayout
from ringtrain.train.attention import build_attention
from ringtrain.train.model import ModelArgs, Transformer
from tests.hf.test_peer import relative_gap
from tests.hf.windowed_models import MODELS, save_windowed
from tests.hf_models import hf_logits, tokens
from tests.unit.test_export import params_of, write_checkpoint

SEQ = 64


@pytest.fixture(autouse=True)
def no_fsync(monkeypatch: pytest.MonkeyPatch) -> None:
    """The store and the export fsync what they write; these tests check what is written."""
    monkeypatch.setattr(os, "fsync", lambda fd: None)


def _imported(folder: Path, *overrides: str) -> tuple[config.JobConfig, Transformer]:
    job = resolve_job(config.load(None, [f"model.hf={folder}", f"data.seq_len={SEQ}", *overrides]))
    local = build_attention(CPLayout(1, 1), "auto", ring_group=None, ulysses_group=None)
    model = Transformer(ModelArgs.from_job(job), attention_fn=local, init_std=None)
    load_full(model, PretrainedWeights(folder))
    return job, model


def _export(tmp_path: Path, job: config.JobConfig, model: Transformer) -> Path:
    uri = write_checkpoint(tmp_path / "ckpt", job, params_of(model))
    return export(uri, tmp_path / "out").out_dir


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {name: t for file in sorted(folder.glob("*.safetensors")) for name, t in load_file(file).items()}


def _ringtrain_logits(model: Transformer, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids, torch.arange(ids.shape[1]).expand_as(ids))


@pytest.mark.parametrize("name", MODELS)
def test_round_trip_is_bit_exact(name: str, tmp_path: Path) -> None:
    source = save_windowed(tmp_path / "source", name)
    out = _export(tmp_path, *_imported(source))

    theirs, ours = _tensors(source), _tensors(out)
    assert ours.keys() == theirs.keys()
    for key, tensor in theirs.items():
        assert ours[key].dtype == tensor.dtype and torch.equal(ours[key], tensor), key
    read_back = model_fields(json.loads((out / "config.json").read_text()))
    assert read_back == {**model_fields(json.loads((source / "config.json").read_text())), "max_position_embeddings": SEQ}
    ids = tokens(2, SEQ)
    assert torch.equal(hf_logits(out, ids)[0], hf_logits(source, ids)[0])


# name -> (job overrides, what the exported config.json must hold)
CHANGES: dict[str, tuple[str, tuple[str, ...], dict[str, Any]]] = {
    "gemma3 extended": (
        "gemma3",
        ("model.rope_scaling={rope_type: linear, factor: 8.0}",),
        {"rope_parameters": {
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 50000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        }},
    ),
    "qwen2 windows moved": (
        "qwen2-windowed",
        ("model.layer_types=[sliding_attention,full_attention,sliding_attention]", "model.sliding_window=9"),
        {"use_sliding_window": True, "sliding_window": 9,
         "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]},
    ),
    "qwen2 windows off": ("qwen2-windowed", ("model.sliding_window=0",), {"use_sliding_window": False}),
    "mistral window off": ("mistral-windowed", ("model.sliding_window=0",), {"sliding_window": None}),
    "gemma3 windows off": ("gemma3", ("model.sliding_window=0",), {"layer_types": ["full_attention"] * 4}),
}


@pytest.mark.parametrize("case", CHANGES)
def test_what_the_job_changed_comes_back_out(case: str, tmp_path: Path) -> None:
    name, overrides, expected = CHANGES[case]
    job, model = _imported(save_windowed(tmp_path / "source", name), *overrides)
    out = _export(tmp_path, job, model)
    cfg = json.loads((out / "config.json").read_text())
    assert {key: cfg[key] for key in expected} == expected
    ids = tokens(2, SEQ)
    assert relative_gap(_ringtrain_logits(model, ids), hf_logits(out, ids)[0]) < 1e-5


SCRATCH = [
    "model.vocab_size=96", "model.dim=64", "model.n_layers=3", "model.n_heads=4", "model.n_kv_heads=2",
    f"data.seq_len={SEQ}", "model.sliding_window=8",
]
# name -> (overrides, the architecture it exports as)
SCRATCH_MODELS = {
    "gemma block": (
        ["model.norm_style=gemma", "model.activation=gelu_pytorch_tanh", "model.scale_embeddings=true",
         "model.qk_norm=true", "model.tie_embeddings=true", "model.query_pre_attn_scalar=24",
         "model.layer_types=[sliding_attention,full_attention,sliding_attention]", "model.rope_local_theta=1000.0"],
        "Gemma3ForCausalLM",
    ),
    "windowed on every layer": ([], "MistralForCausalLM"),
}


@pytest.mark.parametrize("case", SCRATCH_MODELS)
def test_a_scratch_model_exports_as_the_architecture_that_has_its_block(case: str, tmp_path: Path) -> None:
    overrides, arch = SCRATCH_MODELS[case]
    job = config.load(None, SCRATCH + overrides)
    torch.manual_seed(0)
    model = Transformer(ModelArgs.from_job(job), attention_fn=build_attention(CPLayout(1, 1), "auto", ring_group=None, ulysses_group=None), init_std=0.3)
    with torch.no_grad():  # norm gains away from the identity, so their convention shows
        for param_name, p in model.named_parameters():
            if "norm" in param_name:
                p.add_(torch.randn_like(p) * 0.2)
    out = _export(tmp_path, job, model)
    assert json.loads((out / "config.json").read_text())["architectures"] == [arch]
    ids = tokens(2, SEQ)
    assert relative_gap(_ringtrain_logits(model, ids), hf_logits(out, ids)[0]) < 1e-5


def test_a_scratch_model_no_architecture_has_is_refused(tmp_path: Path) -> None:
    from ringtrain.errors import ConfigError

    job = config.load(None, SCRATCH + ["model.layer_types=[sliding_attention,full_attention,sliding_attention]"])
    model = Transformer(ModelArgs.from_job(job), attention_fn=build_attention(CPLayout(1, 1), "auto", ring_group=None, ulysses_group=None))
    with pytest.raises(ConfigError, match="model.sliding_window: LlamaForCausalLM has no sliding window"):
        _export(tmp_path, job, model)
