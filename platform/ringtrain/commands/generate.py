"""`ringtrain generate SOURCE --prompts FILE.jsonl --max-new-tokens N`: continue each prompt on a
dp x cp mesh of workers, decoding with a KV cache sharded over each replica's CP group.

SOURCE is what ``eval`` takes (a run directory, a checkpoint URI or a Hugging Face model folder);
``key=value`` overrides choose the mesh (``mesh.cp=4 attention.impl=ring``), ``data.seq_len`` the
longest sequence (prompt and new tokens) the job takes, and ``train.micro_batch`` how many such
sequences' worth of padded tokens decode together. The prompt file's lines are read and
tokenized here (``prompt_file``); each output line, in input order, holds the new token ids and
their text, cut before a ``--stop`` string. Greedy unless ``--temperature`` is above 0.
Progress (prompts done, tokens a second) goes to stderr.

Exit codes: 0 done, 1 the generation failed, 2 bad input: one line naming the option, file and
line, before any cluster is started.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any, Optional

from ringtrain.commands.destination import check_writable
from ringtrain.commands.eval import _IntermixedParser
from ringtrain.commands.eval_source import KEY as SOURCE_KEY
from ringtrain.commands.eval_source import EvalSource, resolve_source
from ringtrain.commands.prompt_file import ChatTemplate, read_prompts
from ringtrain.commands.workers import checked, inference_job, started_workers, workers_job
from ringtrain.config import JobConfig
from ringtrain.errors import EXIT_OK, ConfigError
from ringtrain.evaluation.generation import GenerationRequest, Sampling
from ringtrain.evaluation.stops import StopRule
from ringtrain.evaluation.text import ByteTokenizer, Tokenizer
from ringtrain.jsonfile import JsonFileError, read_json

# Prompts a call to the workers takes, per replica: progress is reported between calls.
PROMPTS_PER_REPLICA_CALL = 4


@dataclasses.dataclass(frozen=True)
class GeneratePlan:
    source: EvalSource
    job: JobConfig
    request: GenerationRequest
    tokenizer: Optional[Tokenizer]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``generate`` subcommand's arguments."""
    parser.__class__ = _IntermixedParser  # options and overrides in any order, as eval takes them
    parser.add_argument("source", nargs="?", metavar="SOURCE", help="a run directory, a checkpoint URI or a Hugging Face model folder")
    parser.add_argument("--prompts", metavar="FILE.jsonl", help='one JSON object a line: {"prompt": "text"}, {"messages": [...]} or {"ids": [...]}')
    parser.add_argument("--max-new-tokens", type=int, metavar="N", help="tokens to generate at most for each prompt")
    parser.add_argument("--out", metavar="FILE.jsonl", help='write {"ids": [...], "text": "..."} lines here (default: stdout)')
    parser.add_argument("--temperature", type=float, default=0.0, help="0 (the default) is greedy; above, sample")
    parser.add_argument("--top-p", type=float, default=1.0, help="sample from the likeliest tokens holding this much probability")
    parser.add_argument("--seed", type=int, default=0, help="draws the sampled tokens")
    parser.add_argument("--stop", action="append", default=[], metavar="TEXT", help="stop a prompt's continuation at this text (repeatable)")
    parser.add_argument("overrides", nargs="*", help="key=value job overrides, e.g. mesh.cp=4 attention.impl=ring data.seq_len=131072")


def run(args: argparse.Namespace) -> int:
    """Execute ``ringtrain generate``; ConfigError (exit 2) for bad input, before any cluster starts."""
    plan = prepare(args)
    job, request = plan.job, plan.request
    total = len(request.prompts)

    def banner(device: str) -> None:
        _stderr(f"ringtrain generate: {plan.source.where}: {total} prompts, up to {request.max_new} new tokens each, "
                f"dp {job.topology.dp} x cp {job.topology.cp} ({job.cp_layout.runs}), ZeRO-{job.zero.stage}, {device}")

    results: list[Optional[list[int]]] = [None] * total
    # Longest first, so each call's batches are of like length; written back in input order.
    order = sorted(range(total), key=lambda i: -len(request.prompts[i]))
    step = PROMPTS_PER_REPLICA_CALL * job.topology.dp
    with started_workers(job, plan.source, banner) as group:
        started, made = time.perf_counter(), 0
        for at in range(0, total, step):
            chosen = order[at : at + step]
            part = dataclasses.replace(request, prompts=tuple(request.prompts[i] for i in chosen))
            for i, ids in zip(chosen, group.generate(part)):
                results[i] = ids
                made += len(ids)
            done = min(at + step, total)
            _stderr(f"ringtrain generate: {done}/{total} prompts, {made / (time.perf_counter() - started):.1f} tokens/s")
    _write(args.out, [_line(ids or [], plan.tokenizer, request.stop) for ids in results])
    return EXIT_OK


def prepare(args: argparse.Namespace) -> GeneratePlan:
    """Every input check and the prompts' tokens, no cluster."""
    if not args.source:
        raise ConfigError("SOURCE", "is missing: give a run directory, a checkpoint URI or a Hugging Face model folder")
    if not args.prompts:
        raise ConfigError("--prompts", "is missing: give a JSONL file of prompts")
    if args.max_new_tokens is None or args.max_new_tokens < 1:
        raise ConfigError("--max-new-tokens", f"must be at least 1 (got {args.max_new_tokens})")
    if args.out is not None:
        check_writable(args.out, "--out")
    try:
        sampling = Sampling(args.temperature, args.top_p, args.seed)
    except ValueError as exc:
        option = "--temperature" if "temperature" in str(exc) else "--top-p"
        raise ConfigError(option, str(exc)) from None
    source = resolve_source(args.source)
    job = checked(inference_job(source, list(args.overrides)))
    vocab = job.model_int("vocab_size")
    tokenizer = text_tokenizer(source, vocab)
    template = ChatTemplate(source.tokenizer_folder) if source.tokenizer_folder else None
    prompts = read_prompts(args.prompts, tokenizer, template, vocab)
    limit = job.data.seq_len
    for where, ids in prompts:
        if len(ids) + args.max_new_tokens > limit:
            raise ConfigError("--prompts", f"{where}: {len(ids)} tokens and --max-new-tokens {args.max_new_tokens} "
                                           f"exceed data.seq_len={limit}, the longest sequence this job takes; "
                                           f"set data.seq_len higher")
    stop = StopRule(eos_ids(source.tokenizer_folder), tuple(args.stop))
    request = GenerationRequest.of([ids for _, ids in prompts], args.max_new_tokens, sampling, stop)
    # data.seq_len the longest sequence, train.micro_batch such sequences in a decoded batch.
    return GeneratePlan(source, workers_job(job, job.data.seq_len), request, tokenizer)


def text_tokenizer(source: EvalSource, vocab_size: int) -> Optional[Tokenizer]:
    """The model's tokenizer: its folder's, else bytes where the vocabulary holds them."""
    from ringtrain.evaluation.tokenizer import find_tokenizer

    found = find_tokenizer(source.tokenizer_folder)
    if found is not None:
        return found
    return ByteTokenizer() if vocab_size >= ByteTokenizer.vocab_size else None


def eos_ids(folder: str) -> frozenset[int]:
    """The end-of-sequence ids of a Hugging Face folder (generation_config.json's, else
    config.json's): one id or a list of them."""
    for name in ("generation_config.json", "config.json"):
        path = Path(folder) / name if folder else None
        if path is not None and path.is_file():
            value = _eos_entry(path)
            if value is not None:
                return frozenset(value)
    return frozenset()


def _eos_entry(path: Path) -> Optional[list[int]]:
    """The ``eos_token_id`` of a folder's JSON file ``path`` as a list of ids, None where it has
    none; a ConfigError naming SOURCE where the file or the entry is not what transformers reads."""
    try:
        found = read_json(path)
    except JsonFileError as exc:
        raise ConfigError(SOURCE_KEY, f"{path} {exc}") from None
    except OSError as exc:
        raise ConfigError(SOURCE_KEY, f"cannot read {path}: {exc.strerror}") from None
    if not isinstance(found, dict):
        raise ConfigError(SOURCE_KEY, f"{path} must hold a JSON object")
    value: Any = found.get("eos_token_id")
    if value is None:
        return None
    ids = value if isinstance(value, list) else [value]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ConfigError(SOURCE_KEY, f"{path}: eos_token_id must be a token id or a list of them (got {value!r:.80})")
    return ids


def _line(ids: list[int], tokenizer: Optional[Tokenizer], stop: StopRule) -> dict[str, Any]:
    text = stop.cut(tokenizer.decode(ids)) if tokenizer is not None else ""
    return {"ids": ids, "text": text}


def _write(out: Optional[str], lines: list[dict[str, Any]]) -> None:
    rendered = "".join(json.dumps(line) + "\n" for line in lines)
    if out is None:
        sys.stdout.write(rendered)
        return
    Path(out).write_text(rendered)


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
