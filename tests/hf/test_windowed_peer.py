"""Windowed models against transformers' own at one rank: tiny Gemma 3, Mistral with a sliding
window and Qwen2 with ``use_sliding_window``, windows of 8 to 24 tokens over sequences of 64, their
logits and loss equal within 1e-5 relative (fp32, CPU).

Each check can fail: a window off by one, the global RoPE on Gemma's local layers, or every
Gemma layer windowed moves the logits by far more than the tolerance. Context extension scales
only Gemma 3's global layers, as a transformers model configured so does; and the configs
published before transformers 5 wrote ``layer_types`` read as transformers reads them (Gemma 3's
``sliding_window_pattern`` and ``rope_local_base_freq``, Qwen2's ``max_window_layers``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.hf.test_peer import relative_gap, ringtrain_logits
from tests.hf.windowed_models import MODELS, WINDOWS, save_windowed
from tests.hf_models import hf_logits, tokens

SEQ = 64


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("windowed")
    return {name: save_windowed(root / name, name) for name in MODELS}


@pytest.fixture(scope="module")
def ids() -> torch.Tensor:
    return tokens(2, SEQ)


@pytest.mark.parametrize("name", MODELS)
def test_logits_and_loss_equal_transformers(name: str, folders: dict[str, Path], ids: torch.Tensor) -> None:
    ref_logits, ref_loss = hf_logits(folders[name], ids)
    logits = ringtrain_logits(folders[name], ids)
    loss = float(F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()))
    gap = relative_gap(logits, ref_logits)
    print(f"{name} dp1 x cp1: relative logit gap {gap:.2e}")
    assert gap < 1e-5
    assert abs(loss - ref_loss) / ref_loss < 1e-5


BREAKS = {
    "window one shorter": ("mistral-windowed", (f"model.sliding_window={WINDOWS['mistral-windowed'] - 1}",)),
    "window one longer": ("qwen2-windowed", (f"model.sliding_window={WINDOWS['qwen2-windowed'] + 1}",)),
    "gemma window one longer": ("gemma3", (f"model.sliding_window={WINDOWS['gemma3'] + 1}",)),
    "gemma's local layers on the global RoPE": ("gemma3", ("model.rope_local_theta=50000.0",)),
    "every gemma layer windowed": ("gemma3", ("model.layer_types=[" + ",".join(["sliding_attention"] * 4) + "]",)),
}


@pytest.mark.parametrize("case", BREAKS)
def test_a_wrong_window_or_rope_goes_red(case: str, folders: dict[str, Path], ids: torch.Tensor) -> None:
    name, overrides = BREAKS[case]
    ref_logits, _ = hf_logits(folders[name], ids)
    assert relative_gap(ringtrain_logits(folders[name], ids, overrides), ref_logits) > 1e-2


def test_context_extension_scales_only_gemmas_global_layers(folders: dict[str, Path], ids: torch.Tensor, tmp_path: Path) -> None:
    """model.rope_scaling is the full layers' (Gemma 3's recipe: a linear factor on the global
    base); the local layers keep their RoPE, as transformers' rope_parameters per layer type do."""
    extended = {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 50000.0},
    }
    reference = save_windowed(tmp_path / "extended", "gemma3", rope_parameters=extended)
    ref_logits, _ = hf_logits(reference, ids)
    logits = ringtrain_logits(folders["gemma3"], ids, ("model.rope_scaling={rope_type: linear, factor: 8.0}",))
    assert relative_gap(logits, ref_logits) < 1e-5
    assert relative_gap(ringtrain_logits(folders["gemma3"], ids), ref_logits) > 1e-3  # the factor mattered


def test_gemma3s_older_config_spelling(folders: dict[str, Path], ids: torch.Tensor, tmp_path: Path) -> None:
    """Published Gemma 3 configs carry sliding_window_pattern (every sixth layer global) and
    rope_theta / rope_scaling / rope_local_base_freq instead of layer_types and rope_parameters."""
    folder = save_windowed(tmp_path / "old", "gemma3", layer_types=None)  # transformers derives them from the pattern
    cfg = json.loads((folder / "config.json").read_text())
    rope = cfg.pop("rope_parameters")
    cfg.pop("layer_types")
    cfg.update(
        sliding_window_pattern=3,
        rope_theta=rope["full_attention"]["rope_theta"],
        rope_scaling={"rope_type": "linear", "factor": 2.0},
        rope_local_base_freq=rope["sliding_attention"]["rope_theta"],
    )
    (folder / "config.json").write_text(json.dumps(cfg))
    ref_logits, _ = hf_logits(folder, ids)
    assert relative_gap(ringtrain_logits(folder, ids), ref_logits) < 1e-5


def test_qwen2s_windowed_layers_from_max_window_layers(ids: torch.Tensor, tmp_path: Path) -> None:
    """Published Qwen2 configs carry no layer_types: the layers from max_window_layers on slide."""
    folder = save_windowed(tmp_path / "old", "qwen2-windowed")
    cfg = json.loads((folder / "config.json").read_text())
    del cfg["layer_types"]
    cfg["max_window_layers"] = 2  # layers 0 and 1 full, layer 2 windowed
    (folder / "config.json").write_text(json.dumps(cfg))
    ref_logits, _ = hf_logits(folder, ids)
    assert relative_gap(ringtrain_logits(folder, ids), ref_logits) < 1e-5
