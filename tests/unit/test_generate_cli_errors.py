"""`ringtrain generate` on bad input: exit 2, one stderr line naming the option, file and line,
no traceback, before torch, Ray or DeepSpeed is imported (the stand-ins of test_eval_cli_errors
refuse to be), let alone a cluster started."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import pytest

from ringtrain_dev.tiny_tokenizer import save_tokenizer
from tests.unit.test_eval_cli_errors import LLAMA, run_cli

PROMPTS = {
    "good": '{"prompt": "The sky is blue."}\n{"ids": [5, 6, 7]}\n',
    "not-json": '{"prompt": "fine"}\n{"prompt": oops}\n',
    "no-field": '{"ids": [1, 2]}\n\n{"text": "where is the prompt"}\n',
    "long": '{"ids": [5, 6]}\n{"ids": ' + json.dumps([5] * 60) + "}\n",
    "out-of-vocab": '{"ids": [5, 600]}\n',
}
CASES = {
    "no-prompts": (["{model}", "--max-new-tokens", "4"], "--prompts: is missing"),
    "zero-new": (["{model}", "--prompts", "{good}", "--max-new-tokens", "0"], "--max-new-tokens: must be at least 1"),
    "negative-temperature": (["{model}", "--prompts", "{good}", "--max-new-tokens", "4", "--temperature", "-0.5"],
                             "--temperature: temperature must be a finite number >= 0"),
    "nan-temperature": (["{model}", "--prompts", "{good}", "--max-new-tokens", "4", "--temperature", "nan"],
                        "--temperature: temperature must be a finite number >= 0 (got nan)"),
    "not-json": (["{model}", "--prompts", "{not-json}", "--max-new-tokens", "4"], "--prompts: {not-json} line 2: not JSON"),
    "no-field": (["{model}", "--prompts", "{no-field}", "--max-new-tokens", "4"],
                 "--prompts: {no-field} line 3: want an object with one of prompt, messages, ids"),
    "too-long": (["{model}", "--prompts", "{long}", "--max-new-tokens", "8", "data.seq_len=64"],
                 "--prompts: {long} line 2: 60 tokens and --max-new-tokens 8 exceed data.seq_len=64"),
    "out-of-vocab": (["{model}", "--prompts", "{out-of-vocab}", "--max-new-tokens", "4"],
                     "--prompts: {out-of-vocab} line 1: \"ids\" must be a non-empty list of token ids in [0, 96)"),
    "missing-file": (["{model}", "--prompts", "{tmp}/none.jsonl", "--max-new-tokens", "4"], "--prompts: {tmp}/none.jsonl is not a file"),
}


@pytest.mark.parametrize(("args", "expected"), CASES.values(), ids=CASES.keys())
def test_bad_input_exits_2_with_one_line(tmp_path: Path, args: list[str], expected: str) -> None:
    model = save_tokenizer(tmp_path / "model")
    (model / "config.json").write_text(json.dumps(LLAMA))
    names: dict[str, object] = {"model": model, "tmp": tmp_path}
    for name, text in PROMPTS.items():
        path = tmp_path / f"{name}.jsonl"
        path.write_text(text)
        names[name] = path
    proc = run_cli(tmp_path, "generate", *(a.format(**names) for a in args))
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert expected.format(**names) in lines[0], lines[0]
    assert "Traceback" not in proc.stderr and proc.stdout == ""



@pytest.mark.parametrize(("out", "says"), [("{tmp}/no-such-folder/out.jsonl", "{tmp}/no-such-folder/out.jsonl: no such folder"),
                                           ("{tmp}", "{tmp} is a folder; name a file to write")])  # fmt: skip
def test_an_out_file_that_cannot_be_written_is_refused_before_the_work(tmp_path: Path, out: str, says: str) -> None:
    """Among the input checks (generate.prepare), not when the results are written after the run."""
    from ringtrain.cli import _parser
    from ringtrain.commands.generate import prepare
    from ringtrain.errors import ConfigError

    model = save_tokenizer(tmp_path / "model")
    (model / "config.json").write_text(json.dumps(LLAMA))
    (tmp_path / "good.jsonl").write_text(PROMPTS["good"])
    args = _parser().parse_args(["generate", str(model), "--prompts", str(tmp_path / "good.jsonl"), "--max-new-tokens", "4",
                                 "--out", out.format(tmp=tmp_path)])  # fmt: skip
    with pytest.raises(ConfigError) as refused:
        prepare(args)
    assert refused.value.key == "--out" and refused.value.reason.startswith(says.format(tmp=tmp_path))


def test_an_existing_out_file_that_may_not_be_written_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A read-only file is refused too (os.access stands in: a root shell may write any file)."""
    import os

    from ringtrain.commands.destination import check_writable
    from ringtrain.errors import ConfigError

    kept = tmp_path / "kept.jsonl"
    kept.write_text("")
    check_writable(str(kept), "--out")
    monkeypatch.setattr(os, "access", lambda path, mode: Path(path) != kept)
    with pytest.raises(ConfigError, match="kept.jsonl: cannot write this file"):
        check_writable(str(kept), "--out")


def _bare_model(tmp_path: Path) -> Path:
    """A model folder with no tokenizer at all: config.json alone."""
    folder = tmp_path / "bare"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(LLAMA))
    return folder


FOLDER_CASES = {
    # (the model folder, its generation_config.json's bytes or None, the prompt file's bytes, the error's key and start)
    "not-utf8": ("tok", None, b'{"ids": [5]}\n{"prompt": "caf\xe9"}\n', ("--prompts", "{prompts} line 2: not UTF-8 text (byte 16 of the line)")),
    "no-tokenizer-for-messages": ("bare", None, b'{"messages": [{"role": "user", "content": "hi"}]}\n',
                                  ("--prompts", "{prompts} line 1: \"messages\" needs the model's chat template, and the tokenizer of {model} cannot be loaded (")),
    "generation-config-not-json": ("tok", b'{"eos_token_id": ', b'{"ids": [5]}\n', ("SOURCE", "{model}/generation_config.json is not valid JSON")),
    "generation-config-a-list": ("tok", b"[2]", b'{"ids": [5]}\n', ("SOURCE", "{model}/generation_config.json must hold a JSON object")),
    "eos-not-an-id": ("tok", b'{"eos_token_id": [2, "</s>"]}', b'{"ids": [5]}\n',
                      ("SOURCE", "{model}/generation_config.json: eos_token_id must be a token id or a list of them (got [2, '</s>'])")),
}  # fmt: skip


@pytest.mark.parametrize(("folder", "generation_config", "prompts", "expected"), FOLDER_CASES.values(), ids=FOLDER_CASES.keys())
def test_a_prompt_file_or_model_folder_transformers_cannot_read_is_one_line(
    tmp_path: Path, folder: str, generation_config: Optional[bytes], prompts: bytes, expected: tuple[str, str]
) -> None:
    """Refused by generate's input checks (generate.prepare) with the option or SOURCE, the file
    and the line: not a UnicodeDecodeError, transformers' many-line ValueError or a JSONDecodeError."""
    from ringtrain.cli import _parser
    from ringtrain.commands.generate import prepare
    from ringtrain.errors import ConfigError

    model = _bare_model(tmp_path) if folder == "bare" else save_tokenizer(tmp_path / "model")
    (model / "config.json").write_text(json.dumps(LLAMA))
    if generation_config is not None:
        (model / "generation_config.json").write_bytes(generation_config)
    (tmp_path / "prompts.jsonl").write_bytes(prompts)
    args = _parser().parse_args(["generate", str(model), "--prompts", str(tmp_path / "prompts.jsonl"), "--max-new-tokens", "4"])
    with pytest.raises(ConfigError) as refused:
        prepare(args)
    key, start = expected
    assert refused.value.key == key and "\n" not in refused.value.reason
    assert refused.value.reason.startswith(start.format(prompts=tmp_path / "prompts.jsonl", model=model)), refused.value.reason
