"""lm-evaluation-harness tasks for ``ringtrain eval --tasks``: found and their data loaded on the
driver before any cluster starts, then run by lm-eval with the workers as its model
(``lm_eval_model.RingtrainLM``).

Tasks, groups and tags are lm-eval's own, and ``--include-path`` adds local YAML tasks, as with
``lm_eval``. Datasets load offline (``HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1`` unless the user
set them): a task whose data is not in the local cache, or not a local file, is named with its
dataset. Synthetic tasks (RULER's) are given the model folder's tokenizer and the model's
``max_length`` as their one length (lm-eval's task metadata ``pretrained`` and
``max_seq_lengths``): eval's ``--seq-len``, a training job's ``eval.seq_len``, else its
``data.seq_len``.
"""

from __future__ import annotations

import difflib
import functools
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

from ringtrain.errors import ConfigError, first_line

if TYPE_CHECKING:
    from ringtrain.evaluation.text import Tokenizer

OPTION = "--tasks"
OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
EXTRA = "ringtrain[eval]"  # pyproject.toml's extra that installs lm-eval


@dataclass(frozen=True)
class TaskPlan:
    """What lm-eval runs: the task names, how many examples and shots, and its task objects."""

    names: tuple[str, ...]
    limit: Optional[int]
    num_fewshot: Optional[int]
    max_length: int
    manager: Any = field(compare=False)


def plan_tasks(text: str, *, include_path: Optional[str], limit: Optional[int], num_fewshot: Optional[int],
               max_length: int, tokenizer_folder: str) -> TaskPlan:
    """The tasks ``text`` names (comma-separated), each found and its data loaded; a
    ConfigError naming ``--tasks`` (or the option at fault) otherwise."""
    for name, value in OFFLINE.items():
        os.environ.setdefault(name, value)
    if include_path is not None and not os.path.isdir(include_path):
        raise ConfigError("--include-path", f"{include_path} is not a folder")
    if limit is not None and limit < 1:
        raise ConfigError("--limit", f"must be at least 1 (got {limit})")
    if num_fewshot is not None and num_fewshot < 0:
        raise ConfigError("--num-fewshot", f"must be at least 0 (got {num_fewshot})")
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    if not names:
        raise ConfigError(OPTION, "names no task")

    try:
        from lm_eval.tasks import TaskManager, get_task_dict
    except ImportError:  # an edge dependency: the eval extra
        raise ConfigError(OPTION, f"needs lm-evaluation-harness: pip install {EXTRA!r}") from None

    metadata = {"max_seq_lengths": [max_length], **({"pretrained": tokenizer_folder} if tokenizer_folder else {})}
    manager = TaskManager(include_path=include_path, metadata=metadata)
    for name in names:
        if name not in manager.all_tasks:
            closest = difflib.get_close_matches(name, manager.all_tasks, n=3)
            hint = f" (closest: {', '.join(closest)})" if closest else ""
            raise ConfigError(OPTION, f"unknown task {name!r}{hint}")
    for name in names:
        try:
            get_task_dict([name], manager)
        except Exception as exc:  # datasets' and lm-eval's own errors, of many types
            raise ConfigError(OPTION, f"task {name!r}: its data cannot be loaded offline "
                                      f"(dataset {_dataset_of(manager, name)}): {first_line(exc)}") from None
    return TaskPlan(names, limit, num_fewshot, max_length, manager)


def hf_tokenizer(tokenizer_folder: str) -> Any:
    """The transformers tokenizer of model folder ``tokenizer_folder``, as lm-eval's model speaks."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_folder)


def run_tasks(plan: TaskPlan, group: Any, tokenizer: Any) -> dict[str, Any]:
    """lm-eval's results object for ``plan`` with the workers of ``group`` as the model, whose
    text ``tokenizer`` (``hf_tokenizer``) makes."""
    from lm_eval import simple_evaluate

    from ringtrain.commands.lm_eval_model import RingtrainLM

    lm = RingtrainLM(group, tokenizer, plan.max_length)
    results: dict[str, Any] = simple_evaluate(model=lm, tasks=list(plan.names), num_fewshot=plan.num_fewshot,
                                              limit=plan.limit, task_manager=plan.manager)
    return results


@dataclass(frozen=True)
class TrainingTasks:
    """``eval.tasks`` as the Controller runs them between steps (``actors.evaluation.TaskRun``):
    lm-eval's results by task, for the step's ``"eval"`` record."""

    plan: TaskPlan
    tokenizer_folder: str

    @functools.cached_property
    def tokenizer(self) -> Any:
        """The model folder's tokenizer, loaded at the first evaluation and kept for the run's others."""
        return hf_tokenizer(self.tokenizer_folder)

    def __call__(self, group: Any) -> dict[str, dict[str, Any]]:
        results: dict[str, dict[str, Any]] = run_tasks(self.plan, group, self.tokenizer)["results"]
        return results


# eval.* keys -> the option plan_tasks names, so a job's error names the key to change.
JOB_KEYS = {"--tasks": "eval.tasks", "--include-path": "eval.include_path", "--limit": "eval.limit",
            "--num-fewshot": "eval.num_fewshot"}


def training_tasks(names: list[str], *, include_path: str, limit: Optional[int], num_fewshot: Optional[int],
                   max_length: int, tokenizer_folder: str, tokenizer: Optional[Tokenizer]) -> TrainingTasks:
    """``eval.tasks`` found and their data loaded before any cluster starts; errors name the key.
    ``tokenizer``: the one in ``tokenizer_folder`` as the caller read it (``find_tokenizer``), None
    where it has none."""
    if tokenizer is None:
        raise ConfigError("eval.tasks", "lm-eval's tasks need the model's tokenizer: set model.hf to a Hugging Face "
                                        "folder with its tokenizer")
    try:
        plan = plan_tasks(",".join(names), include_path=include_path or None, limit=limit, num_fewshot=num_fewshot,
                          max_length=max_length, tokenizer_folder=tokenizer_folder)
    except ConfigError as exc:
        raise ConfigError(JOB_KEYS.get(exc.key, exc.key), exc.reason) from None
    return TrainingTasks(plan, tokenizer_folder)


def results_json(results: dict[str, Any]) -> dict[str, Any]:
    """The parts of lm-eval's results object that say what scored what: per task and group
    metrics under lm-eval's names, shots, samples, versions, and which way is better."""
    keys = ("results", "groups", "group_subtasks", "n-shot", "n-samples", "higher_is_better", "versions")
    return {key: results[key] for key in keys if key in results}


def _dataset_of(manager: Any, name: str) -> str:
    entry = manager.task_index.get(name)
    cfg = getattr(entry, "cfg", None) or {}
    return repr(cfg.get("dataset_path", name))
