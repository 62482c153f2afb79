"""EvalSource: which model a SOURCE names, and where its config and weights come from."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ringtrain import config
from ringtrain.actors.resume import checkpoint_meta
from ringtrain.checkpoint import open_store
from ringtrain.errors import ConfigError
from ringtrain.commands.eval_source import resolve_source
from ringtrain.telemetry.rundir import RunDir

LLAMA = {
    "architectures": ["LlamaForCausalLM"], "vocab_size": 96, "hidden_size": 64, "intermediate_size": 96,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 32,
}  # fmt: skip
SHAPE = ["model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.rope_theta=500000"]


def _run_with_checkpoints(run_dir: Path, steps: list[int]) -> config.JobConfig:
    job = config.load(None, [*SHAPE, f"run_dir={run_dir}"])
    run = RunDir(run_dir)
    run.write_config(job)
    run.close()
    store = open_store((run_dir / "checkpoints").as_uri())
    for step in steps:
        store.save(step, {"rank-0": f"shard of step {step}".encode()}, checkpoint_meta(job))
    return job


def test_a_run_directory_gives_its_config_and_newest_checkpoint(tmp_path: Path) -> None:
    _run_with_checkpoints(tmp_path / "run", [10, 20])
    source = resolve_source(str(tmp_path / "run"))
    assert source.kind == "run" and source.checkpoint is not None and source.checkpoint.step == 20
    assert source.job.model.rope_theta == 500000 and source.job.model.dim == 64  # from config.yaml
    assert source.shards() == [b"shard of step 20"]
    assert "step 20" in source.where


def test_a_run_directory_follows_its_checkpoint_uri(tmp_path: Path) -> None:
    elsewhere = tmp_path / "bucket"
    job = config.load(None, [*SHAPE, f"run_dir={tmp_path / 'run'}", f"checkpoint.uri={elsewhere.as_uri()}"])
    run = RunDir(tmp_path / "run")
    run.write_config(job)
    run.close()
    open_store(elsewhere.as_uri()).save(7, {"rank-0": b"elsewhere"}, checkpoint_meta(job))
    source = resolve_source(str(tmp_path / "run"))
    assert source.kind == "run" and source.shards() == [b"elsewhere"]
    assert source.checkpoint is not None and source.checkpoint.uri.startswith(elsewhere.as_uri())


def test_a_checkpoint_uri_reads_the_config_beside_its_store_or_the_shape_it_records(tmp_path: Path) -> None:
    _run_with_checkpoints(tmp_path / "run", [10, 20])
    store = tmp_path / "run" / "checkpoints"
    one = resolve_source(f"{store.as_uri()}/step-000000010")
    assert one.kind == "checkpoint" and one.checkpoint is not None and one.checkpoint.step == 10
    assert one.job.model.rope_theta == 500000  # the run's config.yaml, beside the store
    assert resolve_source(str(store)).checkpoint.step == 20  # type: ignore[union-attr]

    (tmp_path / "run" / "config.yaml").unlink()
    alone = resolve_source(store.as_uri())
    assert alone.job.model.dim == 64 and alone.job.model.n_layers == 2  # from the checkpoint's meta
    assert alone.job.model.rope_theta == 500000  # the model section the checkpoint records


def test_a_hf_folder_is_its_own_weights_and_tokenizer(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(LLAMA))
    source = resolve_source(str(tmp_path))
    assert source.kind == "hf" and source.checkpoint is None
    assert source.job.model.hf == str(tmp_path.resolve()) == source.tokenizer_folder


def test_a_file_is_no_source(tmp_path: Path) -> None:
    (tmp_path / "model.bin").write_bytes(b"")
    with pytest.raises(ConfigError, match="SOURCE: .* is a file"):
        resolve_source(str(tmp_path / "model.bin"))


def test_a_bare_checkpoint_keeps_its_whole_model_section() -> None:
    """Rope scaling and the architecture switches come from the checkpoint's recorded model
    section: evaluating without them would score another model."""
    from ringtrain.commands.eval_source import _job_of_meta

    scaling = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
    meta = {"model_config": {"hf": "/gone", "vocab_size": 96, "dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2,
                             "head_dim": 24, "ffn_dim": 96, "rope_theta": 40000.0, "rope_scaling": scaling, "qk_norm": True}}
    model = _job_of_meta(meta).model
    assert (model.rope_scaling, model.rope_theta, model.head_dim, model.qk_norm, model.hf) == (scaling, 40000.0, 24, True, "")


def test_a_hf_folder_whose_name_yaml_would_misread_is_still_that_folder(tmp_path: Path) -> None:
    folder = tmp_path / "my model #1 [v2]"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(LLAMA))
    assert resolve_source(str(folder)).job.model.hf == str(folder.resolve())


def test_a_preference_run_is_scored_by_its_objective_on_pairs_alone(tmp_path: Path) -> None:
    """Evaluating a DPO run on text (or generating from it) scores the next-token loss: its
    workers never train, and with the run's objective they would first take reference log-probs
    of data they are not given. An objective the command line names is kept, to be checked
    against the data."""
    from ringtrain.cli import _parser
    from ringtrain.commands.eval import _eval_job
    from ringtrain.commands.workers import inference_job, workers_job

    job = config.load(None, [*SHAPE, f"run_dir={tmp_path / 'run'}", "train.objective=dpo", "train.preference.beta=0.2"])
    run = RunDir(tmp_path / "run")
    run.write_config(job)
    run.close()
    open_store((tmp_path / "run" / "checkpoints").as_uri()).save(4, {"rank-0": b"shard"}, checkpoint_meta(job))
    source = resolve_source(str(tmp_path / "run"))
    assert source.job.train.objective == "dpo"
    assert inference_job(source, ["train.objective=ipo"]).train.objective == "ipo"
    assert workers_job(inference_job(source, []), 64).train.objective == "lm"

    def evaluated(*overrides: str) -> config.JobConfig:
        return _eval_job(source, _parser().parse_args(["eval", str(tmp_path / "run"), "--data", "stdlib", *overrides]))

    on_text = evaluated()
    assert on_text.train.objective == "lm" and on_text.train.preference.beta == 0.2
    assert evaluated("train.objective=ipo").train.objective == "ipo"
    assert evaluated("train={objective: ipo}").train.objective == "ipo"  # named through its section


def test_the_workers_of_a_run_trained_on_sources_take_the_eval_data_alone(tmp_path: Path) -> None:
    """A run trained on data.sources: eval's and generate's workers are given their own data
    (eval's rows, or stdlib at generate's length) and none of the run's sources, which the
    config check would refuse beside a data.path the user never wrote."""
    import numpy as np

    from ringtrain.cli import _parser
    from ringtrain.commands import eval as evaluate
    from ringtrain.commands import generate

    rows = tmp_path / "rows.npy"
    np.save(rows, np.arange(2 * 16).reshape(2, 16) % 90)
    job = config.load(None, [*SHAPE, f"run_dir={tmp_path / 'run'}", f"data.sources=[{{path: {rows}}}]",
                             "data.seq_len=64"])  # fmt: skip
    run = RunDir(tmp_path / "run")
    run.write_config(job)
    run.close()
    open_store((tmp_path / "run" / "checkpoints").as_uri()).save(4, {"rank-0": b"shard"}, checkpoint_meta(job))
    assert resolve_source(str(tmp_path / "run")).job.data.sources

    _, scored, *_ = evaluate.prepare(_parser().parse_args(["eval", str(tmp_path / "run"), "--data", str(rows)]))
    assert (scored.data.sources, scored.data.path, scored.data.seq_len) == ([], str(rows), 16)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"ids": [5, 6, 7]}\n')
    decoding = generate.prepare(_parser().parse_args(["generate", str(tmp_path / "run"), "--prompts", str(prompts),
                                                      "--max-new-tokens", "4"])).job  # fmt: skip
    assert (decoding.data.sources, decoding.data.path, decoding.data.seq_len) == ([], config.STDLIB_CORPUS, 64)


def test_the_length_eval_scores_is_seq_len_else_the_jobs_eval_seq_len_else_its_data_seq_len(tmp_path: Path) -> None:
    """The one length of a stream's windows, a chat dataset's conversations, a row of pairs and
    lm-eval's max_length, as --seq-len's help and docs/evaluation.md say."""
    from ringtrain.cli import _parser
    from ringtrain.commands.eval import _eval_job

    (tmp_path / "config.json").write_text(json.dumps(LLAMA))
    source = resolve_source(str(tmp_path))

    def length(*args: str) -> int:
        job = _eval_job(source, _parser().parse_args(["eval", str(tmp_path), "--data", "stdlib", *args]))
        assert job.eval.seq_len is not None
        return job.eval.seq_len

    assert length("data.seq_len=24") == 24
    assert length("data.seq_len=24", "eval.seq_len=20") == 20
    assert length("--seq-len", "16", "data.seq_len=24", "eval.seq_len=20") == 16
