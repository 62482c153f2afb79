"""Messages that point the right way: each names what the user gave, what it is, and what to do.

In-process through ``cli.main`` where the command line is the subject (one stderr line, exit 2).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ringtrain import cli, config
from ringtrain.commands.eval_source import resolve_source
from ringtrain.errors import ConfigError
from ringtrain.hf.hfconfig import read_hf_config

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "jobs" / "quickstart.yaml"


def _one_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err.strip()


def test_eval_of_a_folder_that_is_no_model_says_what_it_is_and_what_eval_takes(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("not a model")
    (tmp_path / "data.jsonl").write_text("{}\n")
    with pytest.raises(ConfigError) as caught:
        resolve_source(str(tmp_path))
    text = str(caught.value)
    assert f"SOURCE: {tmp_path} is a folder of other files (data.jsonl, notes.txt), not a model" in text
    assert "empty" not in text and "run directory (config.yaml)" in text and "Hugging Face model folder" in text

    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match="is an empty folder, not a model: eval takes"):
        resolve_source(str(empty))


def test_model_hf_of_a_run_directory_says_export_it_first(tmp_path: Path) -> None:
    (tmp_path / config.RUN_CONFIG).write_text("name: r\n")
    with pytest.raises(ConfigError) as caught:
        read_hf_config(tmp_path)
    assert caught.value.key == "model.hf"
    assert "is a ringtrain run directory" in caught.value.reason
    assert f"`ringtrain export {tmp_path} OUT_DIR`" in caught.value.reason


def test_help_is_written_for_users(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out = capsys.readouterr().out
    assert "Train long-context language models" in out and "docs/configuration.md" in out
    assert "dispatch" not in out and "``" not in out  # the module's docstring is for developers
    for verb in ("run", "plan", "eval", "export", "prepare", "submit", "status", "logs", "stop", "report", "dashboards"):
        assert f"\n    {verb} " in out or f"\n    {verb}\n" in out, verb


@pytest.mark.parametrize(
    ("arg", "fixed"),
    [("--train.steps=20", "train.steps=20"), ("--data.sources[0].path", "data.sources[0].path=VALUE")],
)
def test_an_override_written_as_an_option_says_how_to_write_it(
    arg: str, fixed: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["run", str(QUICKSTART), arg]) == cli.EXIT_USAGE
    line = _one_line(capsys)
    assert line == f"ringtrain: config error: {arg}: overrides are written key=value with no dashes: {fixed}"


def test_an_option_of_a_verb_is_not_taken_for_an_override(capsys: pytest.CaptureFixture[str]) -> None:
    """Only a name with a dot or a bracket is an override: ``--data=x.npy`` stays eval's option."""
    assert cli.main(["eval", "--data=rows.npy"]) == cli.EXIT_USAGE
    assert _one_line(capsys) == "ringtrain: config error: SOURCE: is missing: give a run directory, a checkpoint URI or a Hugging Face model folder"


def test_an_unknown_key_gets_did_you_mean_in_its_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["plan", str(QUICKSTART), "mesh.dpp=2"]) == cli.EXIT_USAGE
    assert _one_line(capsys) == "ringtrain: config error: mesh.dpp: unknown key (did you mean mesh.dp?)"


def test_an_unknown_key_in_a_job_file_gets_did_you_mean(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text("train:\n  setps: 3\n")
    with pytest.raises(ConfigError, match=r"^train\.setps: unknown key \(did you mean train\.steps\?\)$"):
        config.load(path)
