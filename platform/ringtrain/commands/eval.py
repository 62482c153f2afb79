"""`ringtrain eval SOURCE --data PATH`: a model's next-token loss by position, and optionally
passkey retrieval, computed on a dp x cp mesh of workers; `--tasks T1,T2`: lm-evaluation-harness
tasks with the workers as lm-eval's model (``eval_tasks``, ``lm_eval_model``), alone or besides;
`--data PREFERENCE_DATASET train.objective=dpo ...`: a preference objective's loss, log-probs and
rewards over the dataset's pairs (``eval_pairs``), scored after the rest.

SOURCE is a run directory, a checkpoint URI or a Hugging Face model folder (``commands.eval_source``).
The workers are the ones training uses (WorkerGroup, TrainWorker, Trainer), so any layout
training runs evaluates too: ``mesh.dp=2 mesh.cp=4 attention.impl=ring`` and a 128K-token
``--seq-len`` put each sequence on a ring of 4. ``key=value`` overrides change the job as in
``ringtrain run``; a run directory's mesh is the default, its cluster never is (the user's
``cluster.address`` override, else RAY_ADDRESS, else an embedded one: ``eval_source``).

Exit codes: 0 done, 1 the evaluation failed, 2 bad input: one line naming the option or key
to change, before any cluster is started.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Sequence

from ringtrain.commands.eval_source import EvalSource, resolve_source
from ringtrain.commands.workers import checked, inference_job, started_workers, workers_job
from ringtrain.config import STDLIB_CORPUS, CPLayout, JobConfig
from ringtrain.errors import EXIT_OK, ConfigError

if TYPE_CHECKING:
    from ringtrain.actors.evaluation import EvalPlan
    from ringtrain.commands.eval_pairs import PairsEval
    from ringtrain.commands.eval_tasks import TaskPlan
    from ringtrain.evaluation.tokenizer import HFTokenizer
    from ringtrain.prepared import Manifest

# eval.* keys -> the option that sets them, so an error names what the user typed.
FLAGS = {
    "eval.data": "--data",
    "eval.seq_len": "--seq-len",
    "eval.max_rows": "--max-rows",
    "eval.bucket_tokens": "--bucket-tokens",
    "eval.passkey": "--passkey",
    "eval.passkey_depths": "--passkey-depths",
    "eval.passkey_trials": "--passkey-trials",
    "eval.seed": "--seed",
}


class _IntermixedParser(argparse.ArgumentParser):
    """Options and key=value overrides in any order (``SOURCE --data X mesh.cp=2 --json``):
    plain argparse stops filling positionals at the first option and rejects the rest."""

    _inner = False

    def parse_known_args(self, args: Optional[Sequence[str]] = None, namespace: Any = None) -> Any:  # type: ignore[override]
        if self._inner:  # parse_known_intermixed_args calls back in here
            return super().parse_known_args(args, namespace)
        self._inner = True
        try:
            return self.parse_known_intermixed_args(args, namespace)
        finally:
            self._inner = False


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``eval`` subcommand's arguments."""
    parser.__class__ = _IntermixedParser  # the subparser was made by add_subparsers' class
    parser.add_argument("source", nargs="?", metavar="SOURCE", help="a run directory, a checkpoint URI or a Hugging Face model folder")
    parser.add_argument("--data", help="stdlib, text files, a .bin or .npy token stream, a 2-D .npy of token rows, or a prepared dataset (chat; preference, with train.objective=dpo, ipo, simpo or orpo)")
    parser.add_argument("--seq-len", type=int, help="the length scored: a stream's windows, the longest conversation, a row of "
                        "preference pairs, lm-eval's max_length (default: the job's eval.seq_len, else its data.seq_len)")
    parser.add_argument("--max-rows", type=int, help="sequences to score (default: every row of a 2-D .npy, every conversation of a chat dataset that fits --seq-len, 64 windows of a stream)")
    parser.add_argument("--bucket-tokens", type=int, help="the first position bucket's size; each next one doubles (default 1024)")
    parser.add_argument("--passkey", metavar="LEN[,LEN...]", help="passkey retrieval at these prompt lengths in tokens")
    parser.add_argument("--passkey-depths", metavar="D[,D...]", help="where the key hides, 0 (start) to 1 (end); default 0,0.25,0.5,0.75,1")
    parser.add_argument("--passkey-trials", type=int, help="keys per length and depth (default 1)")
    parser.add_argument("--seed", type=int, help="draws the passkeys (default 0)")
    parser.add_argument("--tasks", metavar="T[,T...]", help="lm-evaluation-harness tasks, groups or tags (e.g. ruler, or local YAML tasks with --include-path)")
    parser.add_argument("--include-path", metavar="DIR", help="a folder of lm-eval task YAML files")
    parser.add_argument("--limit", type=int, help="examples per task at most (lm-eval's --limit)")
    parser.add_argument("--num-fewshot", type=int, help="few-shot examples in each prompt (lm-eval's --num_fewshot)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.add_argument("overrides", nargs="*", help="key=value job overrides, e.g. mesh.dp=2 mesh.cp=2 attention.impl=ring")


def run(args: argparse.Namespace) -> int:
    """Execute ``ringtrain eval``; ConfigError (exit 2) for bad input, before any cluster starts."""
    source, job, plan, tasks, pairs = prepare(args)

    from ringtrain.actors.evaluation import evaluate

    scored = [f"tasks {', '.join(tasks.names)}"] if tasks is not None else []
    evalset = plan.evalset
    if evalset is not None:
        coverage = evalset.coverage
        scored.insert(0, f"{evalset.num_rows} sequences of {evalset.seq_len} tokens" if coverage is None
                      else coverage.line(job.eval.seq_len or job.data.seq_len))  # fmt: skip
    if pairs is not None:
        scored.insert(0, f"{pairs.pairs.num_scored} preference pairs in {pairs.pairs.num_rows} rows of {pairs.pairs.seq_len} tokens")

    def banner(device: str) -> None:
        _stderr(
            f"ringtrain eval: {source.where}: {'; '.join(scored)}, "
            f"dp {job.topology.dp} x cp {job.topology.cp} ({job.cp_layout.runs}), ZeRO-{job.zero.stage}, {device}"
        )

    with started_workers(job, source, banner, pairs.before_restore if pairs is not None else None) as group:
        result = evaluate(group, plan) if evalset is not None or plan.prompts else None
        task_results = _run_tasks(tasks, group, source) if tasks is not None else None
        # Last: a reference model's pass leaves its weights in the workers.
        preference = pairs.score(group) if pairs is not None else None
    if args.json:
        out: dict[str, Any] = {"source": source.where}
        if result is not None:
            out.update(data=job.eval.data, **result.to_dict())
        if preference is not None:
            out.update(data=job.eval.data, preference=preference)
        if task_results is not None:
            from ringtrain.commands.eval_tasks import results_json

            out.update(results_json(task_results))
        print(json.dumps(out, default=str))
        return EXIT_OK
    if result is not None:
        print(result.table())
    if preference is not None:
        print("  ".join(f"{k} {v:.6g}" if isinstance(v, float) else f"{k} {v}" for k, v in preference.items()))
    if task_results is not None:
        from lm_eval.utils import make_table

        print(make_table(task_results))
    return EXIT_OK


def _run_tasks(tasks: "TaskPlan", group: Any, source: EvalSource) -> dict[str, Any]:
    from ringtrain.commands.eval_tasks import hf_tokenizer, run_tasks

    return run_tasks(tasks, group, hf_tokenizer(source.tokenizer_folder))


def prepare(args: argparse.Namespace) -> tuple[EvalSource, JobConfig, "EvalPlan", Optional["TaskPlan"], Optional["PairsEval"]]:
    """The source, the workers' job, the eval plan (``--data``, ``--passkey``), the lm-eval
    tasks (``--tasks``) and a preference dataset's pairs with their objective and reference:
    every input check, no cluster."""
    from ringtrain.actors.evaluation import plan_for
    from ringtrain.evaluation.tokenizer import find_tokenizer

    if not args.source:
        raise ConfigError("SOURCE", "is missing: give a run directory, a checkpoint URI or a Hugging Face model folder")
    if not args.data and not args.tasks:
        raise ConfigError("--data", "is missing: give stdlib, text files, a .bin or .npy token stream, a 2-D .npy of rows or "
                                    "a prepared dataset (or --tasks for lm-evaluation-harness tasks)")
    if not args.tasks:
        _check_no_task_options(args)
    from ringtrain.train.evalset import content_in, manifest_of

    try:
        source = resolve_source(args.source)
        # Read once: what --data holds (text, chat or preference) and, prepared, its tokenizer.
        manifest = manifest_of(args.data, "--data") if args.data else None
        content = content_in(manifest) if args.data else None
        job = _eval_job(source, args, content)
        for note in _data_tokenizer_notes(source, job.eval.data, manifest):
            _stderr(f"ringtrain: warning: {note}")
        tokenizer = find_tokenizer(source.tokenizer_folder)
        # The pairs' rows are --seq-len long (the job's eval.seq_len, else data.seq_len, its default).
        plan = plan_for(job, tokenizer=tokenizer, pairs=True, content=content, length_key="--seq-len")
        _check_objective(job, content)  # once the data is known to be there
        evalset = plan.evalset
        tasks = _task_plan(args, source, job.eval.seq_len or job.data.seq_len, tokenizer) if args.tasks else None
        pairs = _pairs_plan(job, source, plan)
        # The workers' own data source is never read; it only has to be valid at this length,
        # which holds the eval set's rows, the pairs' rows and the longest sequence a task's
        # request may have. They score, and train nothing: the objective is the driver's.
        longest = max(evalset.seq_len if evalset is not None else 0, tasks.max_length if tasks is not None else 0,
                      plan.pairs.seq_len if plan.pairs is not None else 0)  # fmt: skip
        seq_len = job.cp_layout.padded_length(max(longest, 1))
        path = _worker_data(job.eval.data, evalset, seq_len) if evalset is not None else STDLIB_CORPUS
        job = workers_job(job, seq_len, path)
    except ConfigError as exc:
        raise ConfigError(_flag(exc.key), exc.reason) from None
    return source, job, plan, tasks, pairs


def _check_no_task_options(args: argparse.Namespace) -> None:
    """lm-eval's options shape --tasks' run alone: given without it, they would do nothing."""
    from ringtrain.commands.eval_tasks import JOB_KEYS, OPTION

    for flag in JOB_KEYS:
        if flag != OPTION and getattr(args, flag.lstrip("-").replace("-", "_")) is not None:
            raise ConfigError(flag, f"applies to {OPTION} only")


def _check_objective(job: JobConfig, content: Optional[str]) -> None:
    """``--data`` (holding ``content``) and ``train.objective`` agree, as ``ringtrain run`` asks of
    its data: a preference dataset is scored by a preference objective, any other data by ``lm``."""
    from ringtrain.train.mixture import check_objective

    if not job.eval.data or content is None:
        return
    try:
        check_objective(job, job.eval.data, content)
    except ConfigError as exc:
        hint = "; to score its next-token loss, pass train.objective=lm" if job.train.objective != "lm" else ""
        raise ConfigError(exc.key, exc.reason + hint) from None


def _pairs_plan(job: JobConfig, source: EvalSource, plan: "EvalPlan") -> Optional["PairsEval"]:
    if plan.pairs is None:
        return None
    from ringtrain.commands.eval_pairs import plan_pairs

    return plan_pairs(job, source, plan.pairs, job.eval.seq_len or job.data.seq_len)


def _task_plan(args: argparse.Namespace, source: EvalSource, max_length: int,
               tokenizer: Optional["HFTokenizer"]) -> "TaskPlan":  # fmt: skip
    """``--tasks`` found and their data loaded; ``tokenizer``: the source's (``find_tokenizer``)."""
    from ringtrain.commands.eval_tasks import plan_tasks

    if tokenizer is None:
        raise ConfigError("--tasks", "lm-eval's tasks need the model's tokenizer: give a Hugging Face model folder "
                                     "(or a run of one)")
    return plan_tasks(args.tasks, include_path=args.include_path, limit=args.limit, num_fewshot=args.num_fewshot,
                      max_length=max_length, tokenizer_folder=source.tokenizer_folder)


def _data_tokenizer_notes(source: EvalSource, data: str, manifest: Optional["Manifest"]) -> list[str]:
    """A prepared --data (``data``, whose manifest is ``manifest``) must hold the model's token
    ids, as `ringtrain run` asks of its data: ConfigError (--data) when its tokenizer is another;
    the warning when the model's folder has no tokenizer to compare it with."""
    from ringtrain.train.dataset_tokenizer import check_same, folder_tokenizer, trained_tokenizer, unchecked_note
    from ringtrain.train.mixture import source_specs

    if manifest is None:
        return []
    tok = manifest.tokenizer
    model = folder_tokenizer(source.tokenizer_folder, "SOURCE")
    if model is None and source.kind == "run":  # its config.yaml names the data it trained on
        model = trained_tokenizer(source_specs(source.job)[0].path)
    if model is not None:
        check_same(data, tok, model, "eval.data", source.tokenizer_folder)
        return []
    return [unchecked_note(source.tokenizer_folder, data, tok, "SOURCE")] if source.tokenizer_folder else []


def _eval_job(source: EvalSource, args: argparse.Namespace, content: Optional[str] = None) -> JobConfig:
    """The source's job with the user's overrides and options, shaped for evaluation
    (``workers.inference_job``): one sequence per forward. ``content``: what --data holds."""
    job = inference_job(source, list(args.overrides))
    if not _names_objective(args.overrides) and content != "preference":
        # A preference run's objective scores pairs alone: its text, chat data or tasks are scored
        # by their next-token loss, unless the command line asks for an objective.
        job.train = dataclasses.replace(job.train, objective="lm")
    e = job.eval
    job.eval = dataclasses.replace(
        e,
        every=0,
        data=args.data,
        seq_len=args.seq_len if args.seq_len is not None else (e.seq_len or job.data.seq_len),
        max_rows=args.max_rows if args.max_rows is not None else e.max_rows,
        bucket_tokens=args.bucket_tokens if args.bucket_tokens is not None else e.bucket_tokens,
        passkey=_ints(args.passkey, "--passkey") if args.passkey else e.passkey,
        passkey_depths=_floats(args.passkey_depths, "--passkey-depths") if args.passkey_depths else e.passkey_depths,
        passkey_trials=args.passkey_trials if args.passkey_trials is not None else e.passkey_trials,
        seed=args.seed if args.seed is not None else e.seed,
    )
    job.train = dataclasses.replace(job.train, micro_batch=1, global_batch=job.mesh.dp)
    # A length every CP layout of mesh.cp ranks shards, until the eval set says how long its
    # sequences are (the job is unchecked here: its layout is built, and named if wrong, by checked).
    job.data = dataclasses.replace(job.data, seq_len=CPLayout.sequence_multiple_of(job.mesh.cp))
    return checked(job)


def _names_objective(overrides: Sequence[str]) -> bool:
    """Whether ``overrides`` set train.objective (by its key, or through the train section's mapping)."""
    from ringtrain.config.destinations import override_value
    from ringtrain.config.overrides import parse

    return override_value(parse(list(overrides)), "train.objective") is not None


def _worker_data(path: str, evalset: Any, seq_len: int) -> str:
    """A data source the workers' Trainer accepts at ``seq_len``: the eval data itself when it
    fits (rows of that length, or a stream with windows that long), else the stdlib corpus. A
    prepared dataset (a chat one) is never read by the workers' Trainer: the token rows stand in."""
    from ringtrain.train.corpus import is_prepared_path

    if is_prepared_path(path):
        return STDLIB_CORPUS
    if Path(path).suffix == ".npy":
        import numpy as np

        shape = np.load(path, mmap_mode="r").shape
        if len(shape) == 2:
            return path if shape[1] == seq_len else STDLIB_CORPUS
    return path if evalset.seq_len == seq_len else STDLIB_CORPUS


def _flag(key: str) -> str:
    """The option behind an eval.* key (``eval.passkey[1]`` -> ``--passkey[1]``); other keys as they are."""
    base, bracket, index = key.partition("[")
    return FLAGS[base] + bracket + index if base in FLAGS else key


def _ints(text: str, flag: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(flag, f"{text!r} is not a comma-separated list of whole numbers") from None


def _floats(text: str, flag: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(flag, f"{text!r} is not a comma-separated list of numbers") from None


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
