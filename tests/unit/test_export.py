"""``ringtrain export`` on checkpoints written here, without training: bad input, the output
folder's layout, sharding, dtypes, side files, and the checkpoint meta an export relies on.

Checkpoints are made of real snapshot blobs (``train/snapshot.encode``) holding a model's
weights split into fragments the way ZeRO splits them: ``flat`` cuts the parameters laid end to
end into one contiguous run per rank (stages 1-2), ``sliced`` gives every rank a slice of every
parameter (stages 0 and 3). They are saved through the real store with the meta a run records.
The Trainer-made checkpoints are exported in tests/dist/test_export_roundtrip.py.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import pytest
import torch

from ringtrain import cli, config
from ringtrain.actors.resume import FORMAT, checkpoint_meta, incompatibility
from ringtrain.checkpoint import open_store
from ringtrain.checkpoint.wire import encode
from ringtrain.config import JobConfig
from ringtrain.hf import resolve_job
from ringtrain.errors import ConfigError, DataError, RingtrainError
from ringtrain.hf import export as hf_export
from ringtrain.hf.export import CHECKPOINT_FORMAT, EXPORT_MANIFEST, ExportError, export
from ringtrain.hf.hfconfig import read_hf_config
from ringtrain.hf.names import to_hf
from ringtrain.hf.shards import INDEX_FILE, SINGLE_FILE, parse_size
from ringtrain.hf.weights import PretrainedWeights
from ringtrain.topology import CPLayout
from ringtrain.train.attention import build_attention
from ringtrain.train.model import ModelArgs, Transformer
from ringtrain.train.zero_state import Fragment
from tests.hf_models import save_model, tokens

SEQ = 32
TINY = ["model.vocab_size=96", "model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", f"data.seq_len={SEQ}"]
Params = dict[str, torch.Tensor]


@pytest.fixture(autouse=True)
def no_fsync(monkeypatch: pytest.MonkeyPatch) -> None:
    """The store and the export fsync what they write; these tests check what is written."""
    monkeypatch.setattr(os, "fsync", lambda fd: None)


def scratch(*overrides: str, seed: int = 0) -> tuple[JobConfig, Transformer]:
    """A from-scratch job and its model, with weights large enough for positions to matter."""
    job = config.load(None, TINY + list(overrides))
    torch.manual_seed(seed)
    local = build_attention(CPLayout(1, 1), "auto", ring_group=None, ulysses_group=None)
    return job, Transformer(ModelArgs.from_job(job), attention_fn=local, init_std=0.3)


def params_of(model: torch.nn.Module) -> Params:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def fragments(params: Params, world: int, layout: str) -> list[list[tuple[str, tuple[int, ...], int, np.ndarray]]]:
    """Each rank's (name, shape, start, values) pieces of ``params`` under ``layout``."""
    ranks: list[list[tuple[str, tuple[int, ...], int, np.ndarray]]] = [[] for _ in range(world)]
    total = sum(p.numel() for p in params.values())
    offset = 0
    for name, p in params.items():
        flat = p.reshape(-1).numpy()
        if layout == "sliced":
            cuts = [min(flat.size, r * math.ceil(flat.size / world)) for r in range(world + 1)]
        else:  # where the rank boundaries of the whole flat vector fall inside this parameter
            cuts = [min(max(r * math.ceil(total / world) - offset, 0), flat.size) for r in range(world + 1)]
        for rank in range(world):
            if cuts[rank + 1] > cuts[rank]:
                ranks[rank].append((name, tuple(p.shape), cuts[rank], flat[cuts[rank] : cuts[rank + 1]]))
        offset += flat.size
    return ranks


def write_checkpoint(
    store: Path | str,
    job: JobConfig,
    params: Params,
    *,
    step: int = 7,
    world: int = 2,
    layout: str = "flat",
    edit_meta: Callable[[dict[str, Any]], None] = lambda meta: None,
    drop: Optional[str] = None,
) -> str:
    """A checkpoint of ``params`` at ``step`` under ``store`` (a folder or a URI), as the
    Persister writes one; ``drop`` leaves out every fragment of that parameter. Returns the
    checkpoint's URI."""
    blobs = {}
    for rank, pieces in enumerate(fragments(params, world, layout)):
        arrays = [
            (Fragment(name, shape, start, {}), {"param": values, "exp_avg": 0 * values, "exp_avg_sq": 0 * values})
            for name, shape, start, values in pieces
            if name != drop
        ]
        blobs[f"rank-{rank:05d}"] = encode(step, rank, world, {"trainer_step": step}, arrays)
    meta = dict(checkpoint_meta(job), step=step, world_size=world)
    edit_meta(meta)
    uri = store.as_uri() if isinstance(store, Path) else store
    return open_store(uri, keep=10).save(step, blobs, meta).uri


def run_export(capsys: pytest.CaptureFixture[str], *args: Any) -> tuple[int, str, str]:
    code = cli.main(["export", *map(str, args)])
    out, err = capsys.readouterr()
    return code, out, err


def tensors_in(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {name: t for file in sorted(folder.glob("*.safetensors")) for name, t in load_file(file).items()}


def assert_one_line_error(err: str, *named: str) -> None:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    for text in named:
        assert text in lines[0], (text, lines[0])


# --- what comes out ----------------------------------------------------------------------------


def test_a_from_scratch_model_exports_as_llama_with_ringtrains_logits(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from transformers import AutoModelForCausalLM

    job, model = scratch()
    write_checkpoint(tmp_path / "ckpt", job, params_of(model), layout="sliced")
    code, out, err = run_export(capsys, tmp_path / "ckpt", tmp_path / "hf")
    assert code == 0, err
    assert "trained from scratch" in out and "wrote" in out

    folder = tmp_path / "hf"
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["model_type"] == "llama"
    assert cfg["max_position_embeddings"] == SEQ and cfg["dtype"] == "float32"
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", SINGLE_FILE, EXPORT_MANIFEST]

    exported = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
    ids = tokens(2, SEQ)
    with torch.no_grad():
        theirs = exported(input_ids=ids).logits
        ours = model(ids, torch.arange(SEQ).expand_as(ids))
    assert float((theirs - ours).abs().max() / ours.abs().max()) < 1e-5


@pytest.mark.parametrize("layout", ["flat", "sliced"])
def test_shards_split_at_max_shard_size_with_a_valid_index(layout: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    job, model = scratch()
    params = params_of(model)
    write_checkpoint(tmp_path / "ckpt", job, params, layout=layout)
    limit = 40_000
    code, _, err = run_export(capsys, tmp_path / "ckpt", tmp_path / "hf", "--max-shard-size", "40KB")
    assert code == 0, err

    folder = tmp_path / "hf"
    files = sorted(folder.glob("*.safetensors"))
    index = json.loads((folder / INDEX_FILE).read_text())
    assert len(files) > 2 and not (folder / SINGLE_FILE).exists()
    assert sorted(set(index["weight_map"].values())) == [f.name for f in files]
    from safetensors import safe_open

    total = 0
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            names = list(f.keys())
            sizes = [f.get_tensor(n).nbytes for n in names]
        assert all(index["weight_map"][n] == file.name for n in names)
        assert sum(sizes) <= limit or len(names) == 1, (file.name, sizes)
        total += sum(sizes)
    assert index["metadata"]["total_size"] == total
    exported = tensors_in(folder)
    assert exported.keys() == index["weight_map"].keys() == {to_hf(n) for n in params}
    for name, value in params.items():
        assert torch.equal(exported[to_hf(name)], value), name


def test_a_sharded_export_loads_in_transformers(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from transformers import AutoModelForCausalLM

    job, model = scratch()
    write_checkpoint(tmp_path / "ckpt", job, params_of(model))
    assert run_export(capsys, tmp_path / "ckpt", tmp_path / "hf", "--max-shard-size", "30KB")[0] == 0
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    for name, p in model.named_parameters():
        assert torch.equal(exported.get_parameter(to_hf(name)), p.detach()), name


def test_contiguous_fragments_are_read_once_and_sliced_ones_once_per_file(tmp_path: Path) -> None:
    """The memory/IO trade of the streaming reader: one blob in memory at a time, each read once
    under ZeRO-1/2's layout; under ZeRO-0/3's every output file needs every blob."""
    job, model = scratch()
    params = params_of(model)
    flat = export(write_checkpoint(tmp_path / "flat", job, params, world=4), tmp_path / "a", max_shard_size=40_000)
    sliced = export(write_checkpoint(tmp_path / "sliced", job, params, world=4, layout="sliced"), tmp_path / "b", max_shard_size=40_000)
    num_files = len([f for f in flat.files if f.endswith(".safetensors")])
    assert num_files > 2
    assert flat.num_blob_reads == 4
    assert 4 < sliced.num_blob_reads <= 4 * num_files


def test_bf16_export_rounds_the_fp32_master_weights(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    job, model = scratch()
    params = params_of(model)
    write_checkpoint(tmp_path / "ckpt", job, params)
    assert run_export(capsys, tmp_path / "ckpt", tmp_path / "hf", "--dtype", "bf16")[0] == 0
    exported = tensors_in(tmp_path / "hf")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["dtype"] == "bfloat16"
    for name, value in params.items():
        assert exported[to_hf(name)].dtype == torch.bfloat16
        assert torch.equal(exported[to_hf(name)], value.to(torch.bfloat16)), name


def hf_job(folder: Path, *overrides: str) -> tuple[JobConfig, Params]:
    """A job importing ``folder`` and the weights it starts from, by ringtrain name."""
    job = resolve_job(config.load(None, [f"model.hf={folder}", f"data.seq_len={SEQ}", *overrides]))
    weights = PretrainedWeights(folder)
    local = build_attention(CPLayout(1, 1), "auto", ring_group=None, ulysses_group=None)
    with torch.device("meta"):
        names = [n for n, _ in Transformer(ModelArgs.from_job(job), attention_fn=local, init_std=None).named_parameters()]
    return job, {name: torch.from_numpy(weights.full(name)) for name in names}


def test_the_default_dtype_is_the_source_models(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = save_model(tmp_path / "src", "qwen3", dtype=torch.bfloat16)
    assert json.loads((source / "config.json").read_text())["dtype"] == "bfloat16"
    job, params = hf_job(source)
    write_checkpoint(tmp_path / "ckpt", job, params)
    assert run_export(capsys, tmp_path / "ckpt", tmp_path / "hf")[0] == 0
    original, exported = tensors_in(source), tensors_in(tmp_path / "hf")
    assert exported.keys() == original.keys()
    assert all(exported[k].dtype == torch.bfloat16 and torch.equal(exported[k], t) for k, t in original.items())


def test_tied_embeddings_write_no_lm_head(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    job, model = scratch("model.tie_embeddings=true")
    assert model.output.weight is model.tok_embeddings.weight
    write_checkpoint(tmp_path / "ckpt", job, params_of(model))
    assert run_export(capsys, tmp_path / "ckpt", tmp_path / "hf")[0] == 0
    assert "lm_head.weight" not in tensors_in(tmp_path / "hf")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["tie_word_embeddings"] is True


# --- the source model's other files ------------------------------------------------------------

SIDE = {"tokenizer.json": '{"model": {}}', "tokenizer_config.json": '{"eos_token": "</s>"}'}


def source_with_tokenizer(folder: Path) -> Path:
    save_model(folder, "llama")
    for name, text in SIDE.items():
        (folder / name).write_text(text)
    return folder


def test_tokenizer_and_generation_config_are_copied(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = source_with_tokenizer(tmp_path / "src")
    job, params = hf_job(source)
    write_checkpoint(tmp_path / "ckpt", job, params)
    code, out, _ = run_export(capsys, tmp_path / "ckpt", tmp_path / "hf")
    assert code == 0
    for name in [*SIDE, "generation_config.json"]:
        assert (tmp_path / "hf" / name).read_bytes() == (source / name).read_bytes(), name
    assert "copied" in out


def test_a_source_folder_that_is_gone_is_reported_and_hf_source_replaces_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = source_with_tokenizer(tmp_path / "src")
    job, params = hf_job(source)
    write_checkpoint(tmp_path / "ckpt", job, params)
    moved = tmp_path / "moved"
    shutil.move(source, moved)

    code, out, _ = run_export(capsys, tmp_path / "ckpt", tmp_path / "hf")
    assert code == 0 and f"{source} is gone" in out
    assert not (tmp_path / "hf" / "tokenizer.json").exists() and (tmp_path / "hf" / "config.json").exists()

    code, out, _ = run_export(capsys, tmp_path / "ckpt", tmp_path / "hf2", "--hf-source", moved)
    assert code == 0 and (tmp_path / "hf2" / "tokenizer.json").read_text() == SIDE["tokenizer.json"]


@pytest.mark.parametrize("explicit", [False, True], ids=["recorded folder", "--hf-source"])
def test_a_side_file_linking_out_of_the_model_folder_is_refused_before_anything_is_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], explicit: bool
) -> None:
    """merges.txt -> /proc/self/environ in a model folder, fine-tuned and exported, put the whole
    environment into the folder meant for publishing."""
    source = source_with_tokenizer(tmp_path / "src")
    job, params = hf_job(source)
    write_checkpoint(tmp_path / "ckpt", job, params)
    (source / "merges.txt").symlink_to("/proc/self/environ")
    out_dir = tmp_path / "hf"
    capsys.readouterr()  # what making the model printed

    extra = ["--hf-source", source] if explicit else []
    code, _, err = run_export(capsys, tmp_path / "ckpt", out_dir, *extra)
    assert code == 2
    assert_one_line_error(err, f"--hf-source: {source}/merges.txt leads through a link to /proc/", "outside")
    assert not out_dir.exists() and not list(tmp_path.glob(".hf.export-*"))


def test_a_link_inside_the_model_folder_is_copied_as_a_regular_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = source_with_tokenizer(tmp_path / "src")
    job, params = hf_job(source)
    write_checkpoint(tmp_path / "ckpt", job, params)
    (source / "originals").mkdir()
    (source / "tokenizer.json").rename(source / "originals" / "tokenizer.json")
    (source / "tokenizer.json").symlink_to("originals/tokenizer.json")

    code, _, _ = run_export(capsys, tmp_path / "ckpt", tmp_path / "hf")
    assert code == 0
    copied = tmp_path / "hf" / "tokenizer.json"
    assert not copied.is_symlink() and copied.read_text() == SIDE["tokenizer.json"]
    assert all(not p.is_symlink() and p.is_file() for p in (tmp_path / "hf").iterdir())


# --- which checkpoint a SOURCE names -----------------------------------------------------------


def test_a_run_directory_exports_its_newest_checkpoint_and_a_step_uri_that_one(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    job, old = scratch(seed=1)
    _, new = scratch(seed=2)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(config.to_yaml(job))
    old_uri = write_checkpoint(run_dir / "checkpoints", job, params_of(old), step=3)
    write_checkpoint(run_dir / "checkpoints", job, params_of(new), step=9)

    assert run_export(capsys, run_dir, tmp_path / "newest")[0] == 0
    assert torch.equal(tensors_in(tmp_path / "newest")["lm_head.weight"], new.output.weight.detach())
    assert run_export(capsys, old_uri, tmp_path / "old")[0] == 0
    assert torch.equal(tensors_in(tmp_path / "old")["lm_head.weight"], old.output.weight.detach())


def test_a_run_directory_follows_its_checkpoint_uri(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    elsewhere = tmp_path / "bucket"
    job, model = scratch(f"checkpoint.uri={elsewhere.as_uri()}")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(config.to_yaml(job))
    write_checkpoint(elsewhere, job, params_of(model))
    code, out, err = run_export(capsys, run_dir, tmp_path / "hf")
    assert code == 0, err
    assert elsewhere.as_uri() in out


# --- bad input ---------------------------------------------------------------------------------


def test_a_non_empty_destination_needs_overwrite_and_overwrite_replaces_only_an_export(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    job, model = scratch()
    write_checkpoint(tmp_path / "ckpt", job, params_of(model))
    dest = tmp_path / "hf"
    dest.mkdir()
    (dest / "notes.txt").write_text("mine")

    code, _, err = run_export(capsys, tmp_path / "ckpt", dest)
    assert code == 2
    assert_one_line_error(err, "OUT_DIR", str(dest), "--overwrite")
    assert sorted(p.name for p in dest.iterdir()) == ["notes.txt"]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temp folder left

    # Not an export: --overwrite refuses it as well, and leaves it as it was.
    code, _, err = run_export(capsys, tmp_path / "ckpt", dest, "--overwrite")
    assert code == 2
    assert_one_line_error(err, "OUT_DIR", str(dest), f"holds no {EXPORT_MANIFEST}", "only a folder `ringtrain export` wrote")
    assert sorted(p.name for p in dest.iterdir()) == ["notes.txt"] and (dest / "notes.txt").read_text() == "mine"

    fresh = tmp_path / "fresh"
    assert run_export(capsys, tmp_path / "ckpt", fresh)[0] == 0
    record = json.loads((fresh / EXPORT_MANIFEST).read_text())
    assert record["files"] == ["config.json", SINGLE_FILE] and record["step"] == 7
    assert run_export(capsys, tmp_path / "ckpt", fresh, "--overwrite")[0] == 0  # an export of ours: replaced
    assert sorted(p.name for p in fresh.iterdir()) == ["config.json", SINGLE_FILE, EXPORT_MANIFEST]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []

    # An export with a file of the user's added: refused, nothing lost.
    (fresh / "README.md").write_text("my model card")
    code, _, err = run_export(capsys, tmp_path / "ckpt", fresh, "--overwrite")
    assert code == 2
    assert_one_line_error(err, "OUT_DIR", f"holds README.md, which its {EXPORT_MANIFEST} does not list")
    assert (fresh / "README.md").read_text() == "my model card"


def test_an_empty_destination_is_used(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    job, model = scratch()
    write_checkpoint(tmp_path / "ckpt", job, params_of(model))
    (tmp_path / "hf").mkdir()
    assert run_export(capsys, tmp_path / "ckpt", tmp_path / "hf")[0] == 0


def test_a_destination_holding_the_checkpoint_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    job, model = scratch()
    write_checkpoint(tmp_path / "run" / "checkpoints", job, params_of(model))
    code, _, err = run_export(capsys, tmp_path / "run" / "checkpoints", tmp_path / "run", "--overwrite")
    assert code == 2
    assert_one_line_error(err, "OUT_DIR", "holds the checkpoint store")
    assert (tmp_path / "run" / "checkpoints").is_dir()


def _empty_store(tmp: Path) -> str:
    (tmp / "empty").mkdir()
    return str(tmp / "empty")


def _missing_step(tmp: Path) -> str:
    return _empty_store(tmp) + "/step-000000099"


def _run_dir_without_checkpoints(tmp: Path) -> str:
    (tmp / "run").mkdir()
    (tmp / "run" / "config.yaml").write_text("name: x\n")
    return str(tmp / "run")


# name -> (tmp_path -> the SOURCE argument, a phrase its one-line error must hold)
BAD_SOURCES: dict[str, tuple[Callable[[Path], str], str]] = {
    "missing": (lambda tmp: str(tmp / "nowhere"), "no such run directory"),
    "empty store": (_empty_store, "no valid checkpoint"),
    "missing step": (_missing_step, "manifest is missing"),
    "run dir without checkpoints": (_run_dir_without_checkpoints, "no valid checkpoint"),
    "unknown scheme": (lambda tmp: "ftp://host/ckpt", "supported schemes"),
}


@pytest.mark.parametrize("case", BAD_SOURCES)
def test_a_bad_source_is_one_line_and_exit_2(case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    make, phrase = BAD_SOURCES[case]
    source = make(tmp_path)
    code, _, err = run_export(capsys, source, tmp_path / "hf")
    assert code == 2
    assert_one_line_error(err, "SOURCE", phrase)
    assert not (tmp_path / "hf").exists()


# what the export met -> (exit code, its one line, with SOURCE s and OUT_DIR o)
ENDINGS: dict[str, tuple[BaseException, int, str]] = {
    "bad input": (ExportError("OUT_DIR", "o is not empty"), 2, "ringtrain: export: OUT_DIR: o is not empty"),
    "bad flag": (ConfigError("--dtype", "fp16 is not bf16 or fp32"), 2, "ringtrain: export: --dtype: fp16 is not bf16 or fp32"),
    "damaged": (RingtrainError("rank-00001 fails its checksum"), 2, "ringtrain: export: SOURCE s: rank-00001 fails its checksum"),
    "unreadable": (DataError("m.json: not valid JSON"), 2, "ringtrain: export: SOURCE s: m.json: not valid JSON"),
    "disk full": (OSError(28, "No space left on device"), 1, "ringtrain: export: failed writing o: [Errno 28] No space left on device"),
}


@pytest.mark.parametrize("case", ENDINGS)
def test_an_export_ends_by_what_it_met(case: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Bad input names what to change, whatever reading the checkpoint met names SOURCE, and
    only a write the OS refused is a failure (exit 1)."""
    raised, code, line = ENDINGS[case]

    def meets(*args: Any, **kwargs: Any) -> None:
        raise raised

    monkeypatch.setattr(hf_export, "export", meets)
    assert run_export(capsys, "s", "o") == (code, "", line + "\n")


def test_a_checkpoint_without_its_model_section_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    job, model = scratch()
    write_checkpoint(tmp_path / "ckpt", job, params_of(model), edit_meta=lambda meta: meta.pop("model_config"))
    code, _, err = run_export(capsys, tmp_path / "ckpt", tmp_path / "hf")
    assert code == 2
    assert_one_line_error(err, "SOURCE", "model section")


def test_a_checkpoint_missing_a_tensor_is_refused_and_leaves_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    job, model = scratch()
    write_checkpoint(tmp_path / "ckpt", job, params_of(model), drop="layers.1.attention.wk.weight")
    code, _, err = run_export(capsys, tmp_path / "ckpt", tmp_path / "hf")
    assert code == 2
    assert_one_line_error(err, "layers.1.attention.wk.weight", "covers 0 of")
    assert not (tmp_path / "hf").exists() and [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


@pytest.mark.parametrize(("flag", "value"), [("--dtype", "fp16"), ("--max-shard-size", "lots")])
def test_a_bad_flag_is_one_line_and_exit_2(flag: str, value: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    job, model = scratch()
    write_checkpoint(tmp_path / "ckpt", job, params_of(model))
    code, _, err = run_export(capsys, tmp_path / "ckpt", tmp_path / "hf", flag, value)
    assert code == 2
    assert_one_line_error(err, flag)


def test_sizes_read_as_hugging_face_writes_them() -> None:
    assert parse_size("5GB") == 5 * 10**9 and parse_size("2GiB") == 2 * 2**30
    assert parse_size("500MB") == 500 * 10**6 and parse_size("1234") == 1234 and parse_size("1.5KB") == 1500
    for bad in ("", "GB", "5 parsecs", "0"):
        with pytest.raises(ValueError):
            parse_size(bad)


# --- the meta a run records --------------------------------------------------------------------


def test_the_meta_carries_what_an_export_needs(tmp_path: Path) -> None:
    source = save_model(tmp_path / "src", "qwen2")
    job = resolve_job(config.load(None, [f"model.hf={source}", "data.seq_len=64", "model.rope_theta=20000.0"]))
    meta = checkpoint_meta(job)
    assert meta["format"] == CHECKPOINT_FORMAT == FORMAT
    assert meta["seq_len"] == 64
    assert meta["hf_config"] == read_hf_config(source) and meta["hf_source"] == str(source.resolve())
    section = meta["model_config"]
    assert section["rope_theta"] == 20000.0 and section["qkv_bias"] is True and section["head_dim"] == 16
    assert section["ffn_dim"] == 96 and section["hf"] == str(source.resolve())
    assert json.loads(json.dumps(meta)) == meta  # the manifest stores it as JSON

    scratch_meta = checkpoint_meta(scratch()[0])
    assert scratch_meta["hf_config"] is None and scratch_meta["hf_source"] is None
    assert scratch_meta["model_config"]["ffn_dim"] == 192 and scratch_meta["model_config"]["head_dim"] == 16


def test_a_resume_checks_the_new_shape_keys_and_accepts_old_checkpoints() -> None:
    job = scratch()[0]
    check = incompatibility(job)
    meta = checkpoint_meta(job)
    assert check(meta) is None
    first_keys = ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim")
    old = dict(meta, model={k: v for k, v in meta["model"].items() if k in first_keys})
    assert check(old) is None  # written before head_dim and the switches were recorded: their defaults
    for key, value in (("qkv_bias", True), ("tie_embeddings", True), ("head_dim", 32), ("qk_norm", True)):
        reason = check(dict(meta, model=dict(meta["model"], **{key: value})))
        assert reason is not None and f"model.{key}={value}" in reason, (key, reason)
    assert check(dict(old, model=dict(old["model"], mlp_bias=True))) is not None


@pytest.mark.parametrize("appears", ["a file in the export being replaced", "a folder where there was none"])
def test_what_appears_at_the_destination_during_an_export_is_never_deleted(
    appears: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The destination is checked before the export and judged again when it is replaced: a
    file of the user's written into it meanwhile (or a folder made there) stops the export."""
    import ringtrain.hf.export as export_module

    job, model = scratch()
    write_checkpoint(tmp_path / "ckpt", job, params_of(model))
    dest = tmp_path / "hf"
    if appears.startswith("a file"):
        assert run_export(capsys, tmp_path / "ckpt", dest)[0] == 0  # an export of ours: --overwrite may replace it
    write_shard = export_module._write_shard

    def then_the_user_writes(*args: Any, **kwargs: Any) -> Any:
        dest.mkdir(exist_ok=True)
        (dest / "notes.txt").write_text("mine")
        return write_shard(*args, **kwargs)

    monkeypatch.setattr(export_module, "_write_shard", then_the_user_writes)
    code, _, err = run_export(capsys, tmp_path / "ckpt", dest, "--overwrite")
    assert code == 2
    assert_one_line_error(err, "OUT_DIR", str(dest), "notes.txt" if appears.startswith("a file") else f"holds no {EXPORT_MANIFEST}")
    assert (dest / "notes.txt").read_text() == "mine"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # put back, nothing half-done left


def test_a_checkpoint_meta_is_data_checked_as_a_job_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A checkpoint from elsewhere names no folder of this machine (its model section's ``hf`` is
    not read) and a value of the wrong type is one line naming SOURCE, not a traceback."""
    job, model = scratch()

    def point_elsewhere(meta: dict[str, Any]) -> None:
        meta["model_config"]["hf"] = str(tmp_path / "elsewhere")

    write_checkpoint(tmp_path / "elsewhere-ckpt", job, params_of(model), edit_meta=point_elsewhere)
    code, _, err = run_export(capsys, tmp_path / "elsewhere-ckpt", tmp_path / "hf")
    assert code == 0, err
    assert read_hf_config(tmp_path / "hf")["hidden_size"] == job.model.dim

    def garble(meta: dict[str, Any]) -> None:
        meta["model_config"]["dim"] = "sixty-four"

    write_checkpoint(tmp_path / "garbled", job, params_of(model), edit_meta=garble)
    code, _, err = run_export(capsys, tmp_path / "garbled", tmp_path / "hf2")
    assert code == 2
    assert_one_line_error(err, "SOURCE", "the model section its meta records is not valid", "model.dim")
    assert not (tmp_path / "hf2").exists()
