"""ringtrain's decoder against transformers' own, on tiny random models of each supported
architecture: logits and loss equal within 1e-5 relative (fp32, CPU), at one rank.

The weights come in through ``PretrainedWeights`` (safetensors, Hugging Face names) and the
shape through ``resolve_job`` (config.json), so this checks the whole import, not only the
forward pass. Sequences are twice ``original_max_position_embeddings`` so that llama3 and yarn
scaling change the answer (and a wrong frequency would show).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import pytest
import torch
import torch.nn.functional as F

from ringtrain import config
from ringtrain.hf import resolve_job
from ringtrain.hf.weights import PretrainedWeights, load_full
from ringtrain.topology import CPLayout
from ringtrain.train.attention import build_attention
from ringtrain.train.model import ModelArgs, Transformer
from tests.hf_models import ARCHS, hf_logits, save_model, tokens

SEQ = 64
ROPES: dict[str, Optional[dict[str, Any]]] = {
    "default": None,
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
    "llama3": {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 4.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 32,
    },
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32},
}


def ringtrain_logits(folder: Path, ids: torch.Tensor, overrides: tuple[str, ...] = ()) -> torch.Tensor:
    job = resolve_job(config.load(None, [f"model.hf={folder}", f"data.seq_len={ids.shape[1]}", *overrides]))
    local = build_attention(CPLayout(1, 1), "auto", ring_group=None, ulysses_group=None)
    model = Transformer(ModelArgs.from_job(job), attention_fn=local, init_std=None)
    load_full(model, PretrainedWeights(folder))
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    with torch.no_grad():
        return model(ids, positions)


def relative_gap(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("rope", ROPES, ids=ROPES)
@pytest.mark.parametrize("arch", ARCHS)
def test_logits_and_loss_equal_transformers(arch: str, rope: str, tmp_path: Path) -> None:
    folder = save_model(tmp_path, arch, rope=ROPES[rope], max_position_embeddings=128 if ROPES[rope] else 32)
    ids = tokens(2, SEQ)
    ref_logits, ref_loss = hf_logits(folder, ids)

    logits = ringtrain_logits(folder, ids)
    loss = float(F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()))

    assert relative_gap(logits, ref_logits) < 1e-5
    assert abs(loss - ref_loss) / ref_loss < 1e-5


def test_tied_embeddings_share_one_matrix(tmp_path: Path) -> None:
    folder = save_model(tmp_path, "qwen2", tie=True)
    ids = tokens(2, SEQ)
    ref_logits, _ = hf_logits(folder, ids)
    assert relative_gap(ringtrain_logits(folder, ids), ref_logits) < 1e-5


def test_the_positions_matter_at_this_scale(tmp_path: Path) -> None:
    """The check above can fail: the same weights under another rope scaling give other logits."""
    folder = save_model(tmp_path, "llama", rope=ROPES["llama3"], max_position_embeddings=128)
    ids = tokens(2, SEQ)
    ref_logits, _ = hf_logits(folder, ids)
    plain = ringtrain_logits(folder, ids, ("model.rope_scaling={rope_type: default}",))
    assert relative_gap(plain, ref_logits) > 1e-3


def test_rope_overrides_extend_the_context(tmp_path: Path) -> None:
    """model.rope_theta and model.rope_scaling replace the checkpoint's: the job's settings
    equal a transformers model configured with them."""
    folder = save_model(tmp_path / "8k", "llama")
    extended = {"rope_type": "yarn", "rope_theta": 40000.0, "factor": 4.0, "original_max_position_embeddings": 32}
    reference = save_model(tmp_path / "64k", "llama", rope=extended, max_position_embeddings=128)
    ids = tokens(2, SEQ)
    ref_logits, _ = hf_logits(reference, ids)
    logits = ringtrain_logits(
        folder, ids,
        ("model.rope_theta=40000.0", "model.rope_scaling={rope_type: yarn, factor: 4.0, original_max_position_embeddings: 32}"),
    )
    assert relative_gap(logits, ref_logits) < 1e-5
