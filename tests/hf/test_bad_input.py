"""Bad model.hf input stops `ringtrain run` before anything starts: exit 2, one line naming the
key and the file or tensor, no traceback, no run directory."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Callable

import pytest

from ringtrain import cli
from tests.hf_models import save_model

Breaker = Callable[[Path], None]


def _rewrite_config(**changes: object) -> Breaker:
    def breaker(folder: Path) -> None:
        cfg = json.loads((folder / "config.json").read_text())
        cfg.update(changes)
        (folder / "config.json").write_text(json.dumps(cfg))

    return breaker


def _drop_tensor(folder: Path) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


def _reshape_tensor(folder: Path) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(folder / "model.safetensors")
    tensors["model.layers.0.self_attn.k_proj.weight"] = tensors["model.layers.0.self_attn.k_proj.weight"][:-1]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


def _index_names_missing_shard(folder: Path) -> None:
    (folder / "model.safetensors").rename(folder / "model-00001-of-00002.safetensors")
    from safetensors import safe_open

    with safe_open(str(folder / "model-00001-of-00002.safetensors"), framework="pt") as f:
        names = list(f.keys())
    weight_map = {n: "model-00001-of-00002.safetensors" for n in names}
    weight_map["lm_head.weight"] = "model-00002-of-00002.safetensors"
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def _index_points_outside(file: str) -> Breaker:
    """An index whose weight_map sends one tensor to a file outside the model folder (a real
    safetensors file is there: only the path may refuse it)."""

    def breaker(folder: Path) -> None:
        from safetensors import safe_open

        outside = folder.parent / "outside.safetensors"
        shutil.copyfile(folder / "model.safetensors", outside)
        with safe_open(str(outside), framework="pt") as f:
            names = list(f.keys())
        weight_map = {n: "model.safetensors" for n in names}
        weight_map["lm_head.weight"] = file.replace("{outside}", str(outside))
        (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))

    return breaker


def _link_out(name: str) -> Breaker:
    """A file of the folder that is a link to a file outside it: /proc/self/environ as merges.txt
    put the whole environment into the exported model."""

    def breaker(folder: Path) -> None:
        secret = folder.parent / "secret.txt"
        secret.write_text("AWS_SECRET_ACCESS_KEY=not-for-the-model\n")
        (folder / name).unlink(missing_ok=True)
        (folder / name).symlink_to(secret)

    return breaker


def _truncate(folder: Path) -> None:
    path = folder / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-1000])


CASES: dict[str, tuple[Breaker, list[str], str]] = {
    "folder missing": (lambda f: None, ["model.hf=/nonexistent/model"], "no such model folder: /nonexistent/model"),
    "config.json missing": (lambda f: (f / "config.json").unlink(), [], "config.json is missing"),
    "config.json not JSON": (lambda f: (f / "config.json").write_text("{not json"), [], "config.json is not valid JSON"),
    # A config.json of a folder from elsewhere is a few KB: one of 17 GiB (sparse here) is refused unread.
    "config.json huge": (lambda f: os.truncate(f / "config.json", 17 << 30), [], "config.json holds more than 16,777,216 bytes"),
    "config.json nested too deep": (lambda f: (f / "config.json").write_text("[" * 100_000), [], "config.json nests too deeply"),
    "unsupported architecture": (
        _rewrite_config(architectures=["GPT2LMHeadModel"]), [], "'GPT2LMHeadModel' is not supported; supported: LlamaForCausalLM"
    ),
    "tensor missing": (_drop_tensor, [], "tensor model.layers.1.mlp.down_proj.weight (for layers.1.feed_forward.w2.weight) is missing"),
    "tensor of the wrong shape": (_reshape_tensor, [], "tensor model.layers.0.self_attn.k_proj.weight in model.safetensors has shape [31, 64]"),
    "shard in the index but absent": (_index_names_missing_shard, [], "model-00002-of-00002.safetensors is listed in"),
    "weight_map entry outside the folder (..)": (
        _index_points_outside("../outside.safetensors"), [],
        "model.hf: {folder}/model.safetensors.index.json: weight_map['lm_head.weight'] is '../outside.safetensors', "
        "which points outside the model folder {folder}",
    ),
    "weight_map entry outside the folder (absolute)": (
        _index_points_outside("{outside}"), [], "weight_map['lm_head.weight'] is '{outside}', which points outside the model folder",
    ),
    "truncated safetensors": (_truncate, [], "model.safetensors is not a readable safetensors file"),
    "merges.txt linking out of the folder": (
        _link_out("merges.txt"), [], "model.hf: {folder}/merges.txt leads through a link to {secret}, outside {folder}: a file of the folder"
    ),
    "config.json linking out of the folder": (_link_out("config.json"), [], "model.hf: {folder}/config.json leads through a link to {secret}"),
    "Gemma 2": (
        _rewrite_config(architectures=["Gemma2ForCausalLM"]), [],
        "model.hf: {folder}/config.json: architecture 'Gemma2ForCausalLM' is not supported: Gemma 2 soft-caps its attention scores",
    ),
    "attention soft-capping": (
        _rewrite_config(architectures=["Gemma3ForCausalLM"], attn_logit_softcapping=50.0), [],
        "attn_logit_softcapping=50.0 soft-caps the attention scores",
    ),
    "a Mistral window on some layers only": (
        _rewrite_config(sliding_window=16), ["model.layer_types=[full_attention,sliding_attention]"],
        "model.layer_types: MistralForCausalLM applies its sliding window to every layer",
    ),
    "a window on a Llama": (
        _rewrite_config(architectures=["LlamaForCausalLM"], model_type="llama"), ["model.sliding_window=16"],
        "model.sliding_window: LlamaForCausalLM has no sliding window",
    ),
    "layer types of another model": (
        lambda f: None, ["model.layer_types=[full_attention]"], "model.layer_types: has 1 entries, one per layer of model.n_layers=2",
    ),
    "unknown rope_scaling type": (
        _rewrite_config(rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "factor": 2.0}), [], "rope_type 'longrope' is not one of"
    ),
    "dynamic rope_scaling": (
        lambda f: None, ["model.rope_scaling={rope_type: dynamic, factor: 2.0}"], "model.rope_scaling: rope_type 'dynamic' rescales"
    ),
    "a shape key that contradicts config.json": (lambda f: None, ["model.dim=128"], "model.dim: 128 contradicts"),
    "token ids beyond the vocabulary": (lambda f: None, ["data.path={bad_rows}"], "data.path: {bad_rows} holds token id 500"),
}


@pytest.mark.parametrize("case", CASES)
def test_bad_model_input_exits_2_naming_it(case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import numpy as np

    breaker, overrides, expected = CASES[case]
    folder = save_model(tmp_path / "model", "mistral")
    breaker(folder)
    bad_rows = tmp_path / "rows.npy"
    np.save(bad_rows, np.full((4, 64), 500, dtype=np.int32))
    run_dir = tmp_path / "run"
    args = [f"model.hf={folder}", "data.seq_len=64", f"run_dir={run_dir}", *[o.replace("{bad_rows}", str(bad_rows)) for o in overrides]]

    capsys.readouterr()  # what making the model printed
    code = cli.main(["run", str(Path(__file__).resolve().parents[2] / "jobs" / "quickstart.yaml"), *_UNSET_SHAPE, *args])

    err = capsys.readouterr().err
    assert code == 2, err
    names = {
        "{bad_rows}": str(bad_rows),
        "{folder}": str(folder),
        "{outside}": str(tmp_path / "outside.safetensors"),
        "{secret}": str(tmp_path / "secret.txt"),
    }
    for name, value in names.items():
        expected = expected.replace(name, value)
    assert expected in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not run_dir.exists()


# The quickstart job sets a from-scratch shape; a model.hf job takes the folder's.
_UNSET_SHAPE = [f"model.{key}=null" for key in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads")]
