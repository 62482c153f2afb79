"""`ringtrain eval` on bad input: exit 2, one stderr line naming what to change, no traceback.

As in test_cli_errors, the subprocesses see stand-in ``torch``, ``ray`` and ``deepspeed``
packages that refuse to be imported: every check here happens before any of them is loaded,
let alone a cluster started.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional

import numpy as np
import pytest

from ringtrain import config
from ringtrain.commands.eval import _data_tokenizer_notes
from ringtrain.commands.eval_source import EvalSource
from ringtrain.errors import ConfigError
from ringtrain.prepared import tokenizer_sha256
from ringtrain.train.dataset_tokenizer import trained_tokenizer
from ringtrain.train.evalset import content_of, manifest_of
from ringtrain_dev.prepared_data import random_documents, write_prepared
from ringtrain_dev.tiny_tokenizer import save_tokenizer

REPO = Path(__file__).resolve().parents[2]
HEAVY_MODULES = ("torch", "ray", "deepspeed")
LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 96, "hidden_size": 64,
    "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 32, "rms_norm_eps": 1e-6, "hidden_act": "silu", "rope_theta": 10000.0,
}  # fmt: skip


def _eval(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return run_cli(tmp_path, "eval", *args)


def run_cli(tmp_path: Path, *args: str, refused: tuple[str, ...] = HEAVY_MODULES,
            env_extra: Optional[dict[str, str]] = None) -> subprocess.CompletedProcess[str]:
    """``ringtrain ARGS`` with the ``refused`` modules (torch, Ray and DeepSpeed) refusing to be imported."""
    poison = tmp_path / "poison"
    for name in refused:
        (poison / name).mkdir(parents=True, exist_ok=True)
        (poison / name / "__init__.py").write_text(f"raise ImportError('{name} imported before the input was checked')\n")
    env = dict(os.environ, HOME=str(tmp_path), RAY_AUTH_MODE="disabled", **(env_extra or {}))
    env.pop("RAY_ADDRESS", None)
    env["PYTHONPATH"] = os.pathsep.join([str(poison), str(REPO / "platform"), env.get("PYTHONPATH", "")])
    return subprocess.run(
        [sys.executable, "-m", "ringtrain", *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60
    )


@pytest.fixture
def model(tmp_path: Path) -> Path:
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(LLAMA))
    return folder


@pytest.fixture
def rows(tmp_path: Path) -> Path:
    path = tmp_path / "rows.npy"
    np.save(path, np.arange(2 * 16).reshape(2, 16) % 90)
    return path


CASES = {
    "no-source": ([], "SOURCE: is missing"),
    "no-data": (["{model}"], "--data: is missing: give stdlib, text files, a .bin or .npy token stream, a 2-D .npy of rows or a prepared dataset"),
    "missing-source": (["{tmp}/nowhere", "--data", "{rows}"], "SOURCE: no such run directory, checkpoint or model folder"),
    "missing-data": (["{model}", "--data", "{tmp}/nothing.npy"], "--data: no such file or directory"),
    "out-of-vocab": (["{model}", "--data", "stdlib"], "--data: stdlib holds token id"),
    "bad-passkey-list": (["{model}", "--data", "{rows}", "--passkey", "1k"], "--passkey: '1k' is not a comma-separated list"),
    "passkey-without-tokenizer": (["{model}", "--data", "{rows}", "--passkey", "400"], "--passkey: the model has no tokenizer.json"),
    "short-passkey": (["{tokmodel}", "--data", "{rows}", "--passkey", "400,20"], "--passkey: 20 tokens cannot hold the passkey prompt"),
    "bad-depth": (["{model}", "--data", "{rows}", "--passkey", "400", "--passkey-depths", "0,2"], "--passkey-depths[1]: must be in [0, 1]"),
    "bad-seq-len": (["{model}", "--data", "stdlib", "--seq-len", "0"], "--seq-len: must be >= 1"),
    "bad-bucket": (["{model}", "--data", "{rows}", "--bucket-tokens", "0"], "--bucket-tokens: must be >= 1"),
    "unknown-key": (["{model}", "--data", "{rows}", "mesh.bogus=1"], "mesh.bogus: unknown key"),
    "bad-mesh": (["{model}", "--data", "{rows}", "mesh.cp=2", "attention.impl=ulysses", "mesh.ulysses=3"], "mesh.ulysses"),
    "run-without-checkpoints": (["{run}", "--data", "{rows}"], "SOURCE: {run} has no valid durable checkpoint"),
    "empty-checkpoint-store": (["file://{tmp}/store", "--data", "{rows}"], "SOURCE: no valid checkpoint in"),
    # A run folder or a model folder from elsewhere whose file links out of it.
    "run-config-linking-out": (
        ["{linkrun}", "--data", "{rows}"], "SOURCE: {linkrun}/config.yaml leads through a link to {tmp}/elsewhere.yaml, outside {linkrun}"
    ),
    "tokenizer-linking-out": (
        ["{linkmodel}", "--data", "{rows}"], "model.hf: {linkmodel}/tokenizer.json leads through a link to {tokmodel}/tokenizer.json"
    ),
}


@pytest.mark.parametrize(("args", "expected"), CASES.values(), ids=CASES.keys())
def test_bad_input_exits_2_with_one_line(tmp_path: Path, model: Path, rows: Path, args: list[str], expected: str) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("name: r\n")
    (tmp_path / "store").mkdir()
    tokmodel = save_tokenizer(tmp_path / "tokmodel")
    (tokmodel / "config.json").write_text(json.dumps(LLAMA))
    linkrun = tmp_path / "linkrun"
    linkrun.mkdir()
    (tmp_path / "elsewhere.yaml").write_text("name: r\n")
    (linkrun / "config.yaml").symlink_to(tmp_path / "elsewhere.yaml")
    linkmodel = tmp_path / "linkmodel"
    linkmodel.mkdir()
    (linkmodel / "config.json").write_text(json.dumps(LLAMA))
    (linkmodel / "tokenizer.json").symlink_to(tokmodel / "tokenizer.json")
    names = {"model": model, "tokmodel": tokmodel, "rows": rows, "tmp": tmp_path, "run": run, "linkrun": linkrun, "linkmodel": linkmodel}
    proc = _eval(tmp_path, *(a.format(**names) for a in args))
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert expected.format(**names) in lines[0], lines[0]
    assert "Traceback" not in proc.stderr and proc.stdout == ""


def _prepared(root: Path, sha256: str, name: str) -> Path:
    docs = random_documents(6, vocab_size=90, eos_id=2, min_len=3, max_len=20)
    write_prepared(root, docs, vocab_size=90, eos_id=2, tokenizer_sha256=sha256, tokenizer_name=name)
    return root


def _notes(source: EvalSource, data: str) -> list[str]:
    """eval's tokenizer notes on ``data``, its manifest read as eval reads it."""
    return _data_tokenizer_notes(source, data, manifest_of(data))


def test_data_of_another_tokenizer_than_the_models_exits_2_naming_both(tmp_path: Path) -> None:
    """`ringtrain eval` refuses what `ringtrain run` refuses: a prepared --data tokenized with
    another tokenizer than the model's (a loss on other words under the same ids means nothing)."""
    tokmodel = save_tokenizer(tmp_path / "tokmodel")
    (tokmodel / "config.json").write_text(json.dumps(LLAMA))
    code = _prepared(tmp_path / "code", "c0de" * 16, "code-bpe")
    proc = _eval(tmp_path, str(tokmodel), "--data", str(code))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and proc.stdout == "", proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith(f"ringtrain: config error: --data: {code} was tokenized with 'code-bpe' (tokenizer.json sha256 c0dec0dec0de), "
                           f"not with the model's tokenizer ({tokmodel / 'tokenizer.json'}")
    # Prepared with the model's own tokenizer: no refusal (the run goes on to start its cluster).
    same = _prepared(tmp_path / "same", tokenizer_sha256(tokmodel / "tokenizer.json"), "tokmodel")
    source = EvalSource("hf", config.load(None, []), str(tokmodel))
    assert _notes(source, str(same)) == []


def test_eval_reads_a_prepared_datas_manifest_once_before_its_rows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What a prepared --data holds and the tokenizer it was made with come from one read of its
    manifest at start (no shard opened for it); the rows' reading opens the dataset once, and
    nothing else reads it."""
    from ringtrain.cli import _parser
    from ringtrain.commands.eval import prepare
    from ringtrain.prepared import Manifest
    from ringtrain.train.corpus import PreparedCorpus

    tokmodel = save_tokenizer(tmp_path / "tokmodel")
    (tokmodel / "config.json").write_text(json.dumps(LLAMA))
    data = _prepared(tmp_path / "data", tokenizer_sha256(tokmodel / "tokenizer.json"), "tokmodel")
    reads: list[str] = []
    load = Manifest.load.__func__  # type: ignore[attr-defined]

    def counted(cls: type[Manifest], root: Path) -> Manifest:
        reads.append(str(root))
        return load(cls, root)  # type: ignore[no-any-return]

    monkeypatch.setattr(Manifest, "load", classmethod(counted))
    opened: list[str] = []
    open_corpus = PreparedCorpus.__init__

    def opening(corpus: PreparedCorpus, uri: str, **kwargs: Any) -> None:
        opened.append(uri)
        open_corpus(corpus, uri, **kwargs)

    monkeypatch.setattr(PreparedCorpus, "__init__", opening)
    _, _, plan, _, _ = prepare(_parser().parse_args(["eval", str(tokmodel), "--data", str(data), "--seq-len", "16"]))
    assert plan.evalset is not None and reads == [str(data)] * 2 and opened == [str(data)]
    # What a dataset holds is its manifest's to say: run's check of eval.data opens no shard either.
    assert content_of(str(data)) == "text" and opened == [str(data)]


def test_a_run_trained_from_scratch_is_checked_against_its_training_data(tmp_path: Path) -> None:
    trained = _prepared(tmp_path / "trained", "a" * 64, "ours")
    other = _prepared(tmp_path / "other", "b" * 64, "theirs")
    run = EvalSource("run", config.load(None, [f"data.path={trained}"]), "")
    assert _notes(run, str(trained)) == []
    with pytest.raises(ConfigError, match=r"tokenized with 'theirs' .* not with the tokenizer of the data it trained on \('ours'"):
        _notes(run, str(other))
    # A byte-level model (trained on text) scoring a dataset of BPE ids.
    with pytest.raises(ConfigError, match=r"not with the bytes it trained on \(stdlib\)"):
        _notes(EvalSource("run", config.load(None, []), ""), str(other))
    # Its training data gone since (moved, deleted): nothing tells what it held, bytes or another
    # dataset's ids, so nothing is refused for it.
    gone = tmp_path / "gone"
    assert trained_tokenizer(str(gone)) is None and trained_tokenizer(gone.as_uri()) is None
    assert _notes(EvalSource("run", config.load(None, [f"data.path={gone}"]), ""), str(other)) == []


def test_a_model_folder_without_a_tokenizer_says_it_cannot_check(tmp_path: Path, model: Path) -> None:
    data = _prepared(tmp_path / "data", "c" * 64, "some-bpe")
    (note,) = _notes(EvalSource("hf", config.load(None, []), str(model)), str(data))
    assert note.startswith(f"SOURCE: {model} has no tokenizer.json, so whether {data} (tokenized with 'some-bpe'")
    assert "cannot be checked" in note


def test_tasks_without_lm_eval_installed_name_the_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    """lm-evaluation-harness is the eval extra's: without it, --tasks (and a job's eval.tasks)
    exit 2 saying what to install, not with an import traceback."""
    from ringtrain import cli
    from ringtrain.commands.eval_tasks import training_tasks
    from ringtrain.evaluation.tokenizer import find_tokenizer

    for name in ("lm_eval", "lm_eval.tasks"):
        monkeypatch.setitem(sys.modules, name, None)  # an import of it raises ModuleNotFoundError
    tokmodel = save_tokenizer(tmp_path / "tokmodel")
    (tokmodel / "config.json").write_text(json.dumps(LLAMA))
    assert cli.main(["eval", str(tokmodel), "--tasks", "arc_easy"]) == 2
    assert capsys.readouterr().err == (
        "ringtrain: config error: --tasks: needs lm-evaluation-harness: pip install 'ringtrain[eval]'\n")
    with pytest.raises(ConfigError) as in_a_job:
        training_tasks(["arc_easy"], include_path="", limit=None, num_fewshot=None, max_length=64,
                       tokenizer_folder=str(tokmodel), tokenizer=find_tokenizer(str(tokmodel)))  # fmt: skip
    assert (in_a_job.value.key, in_a_job.value.reason) == ("eval.tasks", "needs lm-evaluation-harness: pip install 'ringtrain[eval]'")


@pytest.mark.parametrize(("option", "value"), [("--include-path", "tasks"), ("--limit", "5"), ("--num-fewshot", "2")])
def test_an_lm_eval_option_without_tasks_is_refused(tmp_path: Path, model: Path, rows: Path, option: str, value: str) -> None:
    """It shapes --tasks' run alone: with --data only, it would silently do nothing."""
    from ringtrain.cli import _parser
    from ringtrain.commands.eval import prepare

    with pytest.raises(ConfigError) as refused:
        prepare(_parser().parse_args(["eval", str(model), "--data", str(rows), option, value]))
    assert (refused.value.key, refused.value.reason) == (option, "applies to --tasks only")
