"""The memory savers' config keys: the older boolean checkpointing still works, contradictions exit 2 naming the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from ringtrain import config
from ringtrain.errors import ConfigError

JOBS = Path(__file__).resolve().parents[2] / "jobs"


@pytest.mark.parametrize(("value", "mode"), [("true", "full"), ("false", "none"), ("True", "full"), ("selective", "selective")])
def test_checkpointing_takes_a_mode_or_the_older_boolean(value: str, mode: str) -> None:
    assert config.load(None, [f"model.activation_checkpointing={value}"]).model.activation_checkpointing == mode


def test_job_files_with_the_boolean_still_load(tmp_path: Path) -> None:
    job = config.load(JOBS / "llama3-8b-128k.yaml")  # activation_checkpointing: true
    assert job.model.activation_checkpointing == "full"
    again = tmp_path / "again.yaml"
    again.write_text(config.to_yaml(job))
    assert config.load(again).model.activation_checkpointing == "full"
    assert config.checkpointing_mode(True) == "full" and config.checkpointing_mode(False) == "none"


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (["model.activation_checkpointing=some"], "model.activation_checkpointing"),
        (["model.activation_offload_layers=5", "model.n_layers=4"], "model.activation_offload_layers"),
        (["model.activation_offload_layers=-1"], "model.activation_offload_layers"),
        (["model.mlp_tiles=0"], "model.mlp_tiles"),
        (["model.mlp_tiles=3", "data.seq_len=2048"], "model.mlp_tiles"),
        (["model.mlp_tiles=4", "data.seq_len=1024", "mesh.cp=512"], "model.mlp_tiles"),
        (["train.loss_chunk_tokens=-1"], "train.loss_chunk_tokens"),
    ],
)
def test_contradictions_name_the_key(overrides: list[str], key: str) -> None:
    with pytest.raises(ConfigError) as err:
        config.load(None, overrides)
    assert err.value.key == key


def test_good_settings_load() -> None:
    job = config.load(
        None,
        ["model.activation_offload_layers=4", "model.mlp_tiles=4", "train.loss_chunk_tokens=1024", "mesh.cp=2", "data.seq_len=2048"],
    )
    assert (job.model.activation_offload_layers, job.model.mlp_tiles, job.train.loss_chunk_tokens) == (4, 4, 1024)


def test_offload_layers_are_checked_against_a_hf_model_once_its_config_is_read(tmp_path: Path) -> None:
    import json

    from ringtrain.hf.hfconfig import resolve_job

    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 64, "hidden_size": 32,
                "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 64,
                "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 256,
            }
        )
    )
    job = config.load(None, [f"model.hf={tmp_path}", "model.activation_offload_layers=3", "data.seq_len=64"])
    with pytest.raises(ConfigError) as err:
        resolve_job(job)
    assert err.value.key == "model.activation_offload_layers"
