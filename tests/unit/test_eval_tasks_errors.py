"""`ringtrain eval --tasks` on bad input: exit 2, one stderr line naming the option, before Ray
or DeepSpeed is imported (lm-eval itself imports torch): an unknown task with the closest names,
a task whose data cannot be loaded offline with its dataset, a missing include path, a bad
--limit, a model without a tokenizer."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.hf.lm_eval_tasks import require_lm_eval, write_tasks
from ringtrain_dev.tiny_tokenizer import save_tokenizer
from tests.unit.test_eval_cli_errors import LLAMA, run_cli

pytestmark = [pytest.mark.slow]  # lm-eval indexes its thousands of task files at each start

CASES = {
    "unknown-task": (["--tasks", "tiny_mcq", "--include-path", "{tasks}"],
                     "--tasks: unknown task 'tiny_mcq' (closest: tiny_mc"),
    "not-offline": (["--tasks", "hub_only", "--include-path", "{tasks}"],
                    "--tasks: task 'hub_only': its data cannot be loaded offline (dataset 'nobody/no-such-dataset')"),
    "no-include-path": (["--tasks", "tiny_mc", "--include-path", "{tmp}/nowhere"], "--include-path: {tmp}/nowhere is not a folder"),
    "bad-limit": (["--tasks", "tiny_mc", "--include-path", "{tasks}", "--limit", "0"], "--limit: must be at least 1"),
    "no-tokenizer": (["--tasks", "tiny_mc", "--include-path", "{tasks}", "--source-without-tokenizer"],
                     "--tasks: lm-eval's tasks need the model's tokenizer"),
}


@pytest.mark.parametrize(("args", "expected"), CASES.values(), ids=CASES.keys())
def test_bad_task_input_exits_2_with_one_line(tmp_path: Path, args: list[str], expected: str) -> None:
    require_lm_eval()
    tasks = write_tasks(tmp_path / "tasks")
    (tasks / "hub_only.yaml").write_text(
        "task: hub_only\ndataset_path: nobody/no-such-dataset\ntest_split: test\noutput_type: multiple_choice\n"
        "doc_to_text: '{{q}}'\ndoc_to_choice: '{{c}}'\ndoc_to_target: 0\n")
    model = save_tokenizer(tmp_path / "model")
    (model / "config.json").write_text(json.dumps(LLAMA))
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text(json.dumps(LLAMA))
    names = {"tasks": tasks, "tmp": tmp_path}
    argv = [a.format(**names) for a in args if a != "--source-without-tokenizer"]
    source = bare if "--source-without-tokenizer" in args else model
    proc = run_cli(tmp_path, "eval", str(source), *argv, refused=("ray", "deepspeed"),
                   env_extra={"HF_DATASETS_CACHE": str(tmp_path / "cache"), "PYTHONPATH": os.environ.get("PYTHONPATH", "")})
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr[-2000:]
    assert expected.format(**names) in lines[0], lines[0]
    assert "Traceback" not in proc.stderr and proc.stdout == ""


def test_training_tasks_errors_name_the_eval_keys(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``ringtrain run``'s eval.tasks checks, before its cluster: the same errors, named by key."""
    require_lm_eval()
    from ringtrain.commands.eval_tasks import training_tasks
    from ringtrain.errors import ConfigError
    from ringtrain.evaluation.tokenizer import find_tokenizer

    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    tasks = write_tasks(tmp_path / "tasks")
    model = save_tokenizer(tmp_path / "model")
    options = dict(include_path=str(tasks), limit=None, num_fewshot=None, max_length=64)
    with pytest.raises(ConfigError) as unknown:
        training_tasks(["tiny_mcq"], tokenizer_folder=str(model), tokenizer=find_tokenizer(str(model)), **options)  # type: ignore[arg-type]
    assert unknown.value.key == "eval.tasks" and "closest: tiny_mc" in unknown.value.reason
    with pytest.raises(ConfigError) as no_tokenizer:
        training_tasks(["tiny_mc"], tokenizer_folder=str(tmp_path), tokenizer=find_tokenizer(str(tmp_path)), **options)  # type: ignore[arg-type]
    assert no_tokenizer.value.key == "eval.tasks"
    with pytest.raises(ConfigError) as no_folder:
        training_tasks(["tiny_mc"], tokenizer_folder=str(model), tokenizer=find_tokenizer(str(model)), **{**options, "include_path": str(tmp_path / "x")})  # type: ignore[arg-type]
    assert no_folder.value.key == "eval.include_path"
