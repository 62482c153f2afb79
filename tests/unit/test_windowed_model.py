"""The per-layer attention spec and Gemma's block on one CPU rank: which layers a job's keys
window, the keys' checks (each failure names its key), and Gemma's block under every memory
saver giving the eager path's gradients."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ringtrain import config
from ringtrain.errors import ConfigError
from ringtrain.train.model import MemorySavers, ModelArgs
from tests.unit.savers_tools import TINY, grads, quiet_cpu, tiny_model  # noqa: F401 (quiet_cpu: a fixture)

SLIDING, FULL = config.SLIDING_ATTENTION, config.FULL_ATTENTION


@pytest.mark.parametrize(
    ("overrides", "windows"),
    [
        ([], (None, None, None)),
        (["model.sliding_window=16"], (16, 16, 16)),
        (["model.sliding_window=16", f"model.layer_types=[{SLIDING},{FULL},{SLIDING}]"], (16, None, 16)),
        (["model.sliding_window=0", f"model.layer_types=[{SLIDING},{FULL},{SLIDING}]"], (None, None, None)),
    ],
)
def test_layer_windows_come_from_the_window_and_the_layer_types(overrides: list[str], windows: tuple) -> None:
    job = config.load(None, ["model.n_layers=3", *overrides])
    assert job.layer_windows == windows
    assert ModelArgs.from_job(job).layer_windows == windows


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        ([f"model.layer_types=[{SLIDING},{FULL}]"], "model.layer_types"),  # 2 types, 4 layers
        ([f"model.layer_types=[{SLIDING},{FULL},{FULL},windowed]"], "model.layer_types[3]"),
        ([f"model.layer_types=[{SLIDING},{FULL},{FULL},{FULL}]"], "model.sliding_window"),  # sliding, no window
        (["model.sliding_window=-1"], "model.sliding_window"),
        (["model.norm_style=gemma2"], "model.norm_style"),
        (["model.activation=relu"], "model.activation"),
        (["model.query_pre_attn_scalar=0"], "model.query_pre_attn_scalar"),
        (["model.rope_local_scaling={rope_type: dynamic, factor: 2.0}"], "model.rope_local_scaling"),
        (["model.final_logit_softcapping=30.0", "train.loss_chunk_tokens=1024"], "train.loss_chunk_tokens"),
    ],
)
def test_bad_window_and_block_keys_name_the_key(overrides: list[str], key: str) -> None:
    with pytest.raises(ConfigError) as err:
        config.load(None, overrides)
    assert err.value.key == key


# The tiny decoder of the saver tests with Gemma's block, windows on two of its three layers, a
# RoPE of their own, its attention scale and logit soft-capping.
GEMMA = dataclasses.replace(
    TINY,
    layer_windows=(8, None, 8),
    local_rope_theta=100.0,
    norm_style="gemma",
    activation="gelu_pytorch_tanh",
    scale_embeddings=True,
    qk_norm=True,
    query_pre_attn_scalar=12.0,
    final_logit_softcapping=5.0,
    tie_embeddings=True,
)


def _gemma(savers: MemorySavers = MemorySavers()) -> torch.nn.Module:
    model = tiny_model(savers, args=GEMMA)
    with torch.no_grad():  # Gemma's gains start at zero, the identity; move them so they count
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
    return model


@pytest.mark.parametrize(
    "savers",
    [
        MemorySavers(checkpointing="full"),
        MemorySavers(checkpointing="selective"),
        MemorySavers(checkpointing="selective", mlp_tiles=4),
        MemorySavers(mlp_tiles=4),
        MemorySavers(offload_layers=2),
    ],
    ids=["full", "selective", "selective-tiles", "tiles", "offload"],
)
def test_gemmas_block_under_each_saver_gives_the_eager_gradients(savers: MemorySavers) -> None:
    reference = grads(_gemma())
    assert {"layers.0.attention_out_norm.weight", "layers.0.ffn_out_norm.weight"} <= reference.keys()
    saved = grads(_gemma(savers))
    assert saved.keys() == reference.keys()
    for name, g in reference.items():
        torch.testing.assert_close(saved[name], g, rtol=1e-5, atol=1e-7, msg=name)


def test_gemmas_switches_each_change_the_output() -> None:
    """Each switch reaches the forward: turning one off moves the logits."""
    ids = torch.arange(48).remainder(96)[None]
    pos = torch.arange(48)[None]
    reference = tiny_model(args=GEMMA).eval()(ids, pos)
    for change in (
        {"layer_windows": (None, None, None)},
        {"local_rope_theta": None},
        {"scale_embeddings": False},
        {"query_pre_attn_scalar": None},
        {"final_logit_softcapping": None},
        {"activation": "silu"},
    ):
        other = tiny_model(args=dataclasses.replace(GEMMA, **change)).eval()(ids, pos)
        assert (other - reference).abs().max() > 1e-3, change
