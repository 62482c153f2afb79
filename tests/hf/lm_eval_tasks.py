"""Local lm-evaluation-harness tasks on local JSONL data (no download), and lm-eval's own Hugging
Face model run on them: the reference ``ringtrain eval --tasks`` is held to.

Three tasks, one of each kind of request: multiple choice by log-likelihood (``tiny_mc``: acc and
acc_norm), ``generate_until`` (``tiny_gen``: exact match, with a stop string and max_gen_toks) and
``loglikelihood_rolling`` (``tiny_ppl``: word and byte perplexity, bits per byte). The texts are
the tiny tokenizer's own (tests/tiny_tokenizer.py), so they tokenize into real pieces.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

from tests.tools import missing

TASKS = ("tiny_mc", "tiny_gen", "tiny_ppl")
MAX_LENGTH = 64
OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}

QUESTIONS = [
    ("The grass is", [" green.", " blue.", " yellow."], 0),
    ("The sky is", [" green.", " blue.", " yellow."], 1),
    ("The sun is", [" green.", " blue.", " yellow."], 2),
    ("What is the pass key? The pass key is", [" 12345.", " 67890."], 0),
    ("Here we go. There and", [" back again.", " the sky."], 0),
    ("Remember it. The pass key", [" is 3.", " is 4.", " is 5.", " is 6."], 3),
]
TEXTS = [
    "There is an important info hidden inside a lot of irrelevant text. Find it and memorize it.",
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.",
    "The pass key is 4321. Remember it. 4321 is the pass key.",
]


def require_lm_eval() -> None:
    """Skip (fail under CI) where lm-eval is not installed: the project's test extra brings it."""
    if importlib.util.find_spec("lm_eval") is None:
        missing("lm-eval is not installed (pip install -e '.[test]' brings it)")


def write_tasks(folder: Path) -> Path:
    """The three tasks' YAML files and data in ``folder``; returns it (lm-eval's include path)."""
    folder.mkdir(parents=True, exist_ok=True)
    mc = folder / "mc.jsonl"
    mc.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in QUESTIONS))
    gen = folder / "gen.jsonl"
    gen.write_text("".join(json.dumps({"question": q, "answer": c[a]}) + "\n" for q, c, a in QUESTIONS))
    ppl = folder / "ppl.jsonl"
    ppl.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    common = "test_split: test\ndataset_path: json\n"
    (folder / "tiny_mc.yaml").write_text(
        f"task: tiny_mc\n{common}dataset_kwargs:\n  data_files:\n    test: {mc}\noutput_type: multiple_choice\n"
        "doc_to_text: '{{question}}'\ndoc_to_choice: '{{choices}}'\ndoc_to_target: '{{answer}}'\n"
        "metric_list:\n  - metric: acc\n  - metric: acc_norm\n")
    (folder / "tiny_gen.yaml").write_text(
        f"task: tiny_gen\n{common}dataset_kwargs:\n  data_files:\n    test: {gen}\noutput_type: generate_until\n"
        "doc_to_text: '{{question}}'\ndoc_to_target: '{{answer}}'\n"
        "generation_kwargs:\n  until: ['.']\n  max_gen_toks: 12\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n")
    (folder / "tiny_ppl.yaml").write_text(
        f"task: tiny_ppl\n{common}dataset_kwargs:\n  data_files:\n    test: {ppl}\noutput_type: loglikelihood_rolling\n"
        "doc_to_text: ''\ndoc_to_target: '{{text}}'\n"
        "metric_list:\n  - metric: word_perplexity\n  - metric: byte_perplexity\n  - metric: bits_per_byte\n")
    return folder


def hf_reference(model: Path, tasks: Path) -> dict[str, Any]:
    """``lm_eval --model hf`` on the tasks, as its results object (samples logged)."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    out: dict[str, Any] = simple_evaluate(
        model="hf", model_args=f"pretrained={model},dtype=float32,max_length={MAX_LENGTH}", tasks=list(TASKS),
        device="cpu", batch_size=1, task_manager=TaskManager(include_path=str(tasks)), log_samples=True)
    return out


def assert_same_results(got: dict[str, Any], want: dict[str, Any]) -> None:
    """The same metrics, task by task, under lm-eval's names (floats to 1e-4 relative)."""
    assert set(got["results"]) == set(want["results"]) == set(TASKS)
    for task in TASKS:
        mine, theirs = got["results"][task], want["results"][task]
        assert set(mine) == set(theirs), task
        for name, value in theirs.items():
            if isinstance(value, float):
                assert abs(mine[name] - value) <= 1e-4 * max(1.0, abs(value)), (task, name, mine[name], value)
            else:
                assert mine[name] == value, (task, name)
