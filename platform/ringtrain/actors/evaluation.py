"""Evaluation on a worker group: what to score (an EvalPlan, read once on the driver) and
running it over the group's mesh (``evaluate``), for ``ringtrain eval`` and for the Controller's
evaluations during training alike. lm-evaluation-harness tasks come as a ``TaskRun`` the command
layer makes (lm-eval is imported there alone), run on the same group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol

from ringtrain.config import JobConfig
from ringtrain.errors import ConfigError
from ringtrain.evaluation.generation import GenerationRequest
from ringtrain.evaluation.passkey import PasskeyPrompt, answer_tokens, build_prompts, score
from ringtrain.evaluation.result import EvalResult, TaskMetrics
from ringtrain.evaluation.tally import LossTally
from ringtrain.evaluation.text import ByteTokenizer, Tokenizer
from ringtrain.train.evalset import EvalSet, content_of, load_eval_set
from ringtrain.train.pairset import PairSet, load_pair_set


class EvalGroup(Protocol):
    """What evaluation needs of a worker group (``actors.group.WorkerGroup``)."""

    def evaluate(self, evalset: EvalSet, bucket_tokens: int) -> LossTally: ...
    def generate(self, request: GenerationRequest) -> list[list[int]]: ...


class TaskRun(Protocol):
    """lm-evaluation-harness tasks with ``group`` as the model: lm-eval's results by task."""

    def __call__(self, group: EvalGroup) -> TaskMetrics: ...


@dataclass(frozen=True)
class EvalPlan:
    evalset: Optional[EvalSet]  # None: no data to score (tasks alone)
    bucket_tokens: int
    tokenizer: Tokenizer
    prompts: tuple[PasskeyPrompt, ...] = ()  # passkey retrieval; empty: none
    num_new: int = 0  # tokens generated for each prompt
    loss_norm: str = "token"  # the job's train.loss_norm, which a chat dataset's loss follows
    tasks: Optional[TaskRun] = None  # eval.tasks, as the command layer runs them
    pairs: Optional[PairSet] = None  # a preference dataset's pairs (``ringtrain eval``), scored apart


def model_tokenizer(job: JobConfig) -> Optional[Tokenizer]:
    """The tokenizer of the job's Hugging Face folder, if it has one."""
    from ringtrain.evaluation.tokenizer import find_tokenizer

    return find_tokenizer(job.model.hf)


def plan_for(job: JobConfig, *, tokenizer: Optional[Tokenizer] = None, data_key: str = "eval.data",
             pairs: bool = False, content: Optional[str] = None, length_key: Optional[str] = None) -> EvalPlan:  # fmt: skip
    """Read ``job.eval.data`` and build the passkey prompts; input errors name their key
    (``data_key`` for the data) before any cluster is asked for anything. With ``pairs`` a
    preference dataset is read as its pairs (``ringtrain eval``), else refused; a length no pair
    fits is named ``length_key`` (the option the length came from; by default the key that set it). ``content``: what
    the data holds, where the caller read it already (``content_of``)."""
    e = job.eval
    vocab = job.model_int("vocab_size")
    evalset = pair_set = None
    if e.data and content is None:
        content = content_of(e.data, data_key)
    if content == "preference":
        if not pairs:
            raise ConfigError(data_key, f"{e.data} is a preference dataset: score it with `ringtrain eval SOURCE --data "
                              f"{e.data} train.objective=dpo` (or another preference objective)")
        d = job.data
        pair_set = load_pair_set(e.data, seq_len=e.seq_len or d.seq_len, multiple=job.cp_layout.sequence_multiple,
                                 vocab_size=vocab, prefix_sharing=d.prefix_sharing, overlong=d.chat_overlong,
                                 packing=d.chat_packing, max_rows=e.max_rows, key=data_key,
                                 length_key=length_key or ("eval.seq_len" if e.seq_len else "data.seq_len"))  # fmt: skip
    elif e.data:
        evalset = load_eval_set(
            e.data,
            seq_len=e.seq_len or job.data.seq_len,
            vocab_size=vocab,
            max_rows=e.max_rows,
            token_dtype=job.data.token_dtype,
            tokenizer=tokenizer,
            key=data_key,
            content=content,
        )
    # A chat dataset's loss is averaged as training averages it; a mean of windows' means would not be.
    norm = job.train.loss_norm if evalset is not None and evalset.coverage is not None else "token"
    if not e.passkey:
        return EvalPlan(evalset, e.bucket_tokens, tokenizer or ByteTokenizer(), loss_norm=norm, pairs=pair_set)
    if tokenizer is None and vocab < ByteTokenizer.vocab_size:
        raise ConfigError("eval.passkey", f"the model has no tokenizer.json and its vocabulary ({vocab}) cannot hold bytes")
    text = tokenizer or ByteTokenizer()
    prompts = build_prompts(text, e.passkey, e.passkey_depths, trials=e.passkey_trials, seed=e.seed)
    top = max(max(p.ids) for p in prompts)
    if top >= vocab:
        raise ConfigError("eval.passkey", f"the tokenizer gives token id {top}, outside the model's vocabulary [0, {vocab})")
    return EvalPlan(evalset, e.bucket_tokens, text, tuple(prompts), answer_tokens(text, prompts), norm, pairs=pair_set)


def evaluate(group: EvalGroup, plan: EvalPlan) -> EvalResult:
    """Score ``plan`` on the group's mesh; collective over every worker, between steps."""
    evalset = plan.evalset
    tally = group.evaluate(evalset, plan.bucket_tokens) if evalset is not None else None
    grid = None
    if plan.prompts:
        generated = group.generate(GenerationRequest.of([list(p.ids) for p in plan.prompts], plan.num_new))
        grid = score(plan.tokenizer, plan.prompts, generated)
    tasks = plan.tasks(group) if plan.tasks is not None else None
    return EvalResult(tally, rows=evalset.num_rows if evalset is not None else 0,
                      seq_len=evalset.seq_len if evalset is not None else 0, passkey=grid,
                      coverage=evalset.coverage if evalset is not None else None, loss_norm=plan.loss_norm, tasks=tasks)
