"""`ringtrain prepare`: its flags, the run from checks to published manifest, progress and summary.

Every input is checked before a cluster starts (sources expand and are cut into pieces, which
reads Parquet footers; the tokenizer loads; the output is free), so bad input exits 2 within a
second; what only reading the records can tell (a bad line, a corrupt stream, no documents) is
found by the actors and reported by the driver in document order. Exit codes follow the other
commands: 2 for bad input (one line naming the file, line or flag), 1 for anything else.

``--format chat`` reads conversations instead of texts and renders each with the tokenizer's
chat template, keeping a loss mask beside the tokens (``prepare/chat_render``); the template is
found and tried on a probe conversation before the cluster starts.

A local corpus of one piece's work or less (``--split-bytes``, 64 MiB) is tokenized in this
process by the actors' own code, in the same order, so the bytes written are the same: starting
a cluster would take longer than the work (``pipeline.in_process`` says when).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Sequence, TextIO

from ringtrain.errors import EXIT_OK, ConfigError, DataError
from ringtrain.prepare.chat_records import DEFAULT_MESSAGES_FIELD, MESSAGES_FLAG
from ringtrain.prepare.render_budget import (
    DEFAULT_MAX_MESSAGES,
    DEFAULT_MAX_RECORD_TOKENS,
    DEFAULT_RENDER_MEMORY_MIB,
    DEFAULT_RENDER_TIMEOUT_S,
    MAX_MESSAGES_FLAG,
    MAX_TOKENS_FLAG,
    MEMORY_FLAG,
    TIMEOUT_FLAG,
    RenderBudget,
)
from ringtrain.prepare.sources import DEFAULT_MAX_RECORD_BYTES, MAX_RECORD_FLAG
from ringtrain.prepared import (
    CHAT_ROLES,
    CHAT_TRAIN_ON,
    CHAT_TRAIN_ON_EOS,
    CONTENTS,
    PAIR_DOCUMENTS,
    ChatInfo,
    Manifest,
    PreferenceInfo,
    SkippedRecord,
    SourceInfo,
    token_dtype_for,
)

if TYPE_CHECKING:
    from ringtrain.prepare.chat_render import ChatSpec
    from ringtrain.prepare.sources import SourceFile

DEFAULT_SHARD_TOKENS = 1 << 27  # 256 MiB of uint16 tokens: large reads, few files
# Work per actor call: seconds of tokenizing, so Ray's per-piece cost is noise, and a 1 GB file
# already keeps 16 actors busy.
DEFAULT_SPLIT_BYTES = 64 << 20
PROGRESS_EVERY_S = 0.5
# Flags that change where or how fast prepare runs, never what it writes: left out of the
# manifest's command so that the manifest, too, is the same bytes at any parallelism.
_EXECUTION_FLAGS = {
    "--address": True, "--parallelism": True, "--num-cpus": True, "--split-bytes": True, "--overwrite": False, "--quiet": False,
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("sources", nargs="+", metavar="SRC", help="files, folders, globs or s3:// prefixes: .jsonl[.gz|.zst], .ndjson, .parquet, .txt, .md")
    parser.add_argument("--tokenizer", required=True, help="a folder with tokenizer.json (a model folder), a tokenizer.json, or 'bytes'")
    parser.add_argument("--out", required=True, help="output folder, file:// or s3:// prefix")
    parser.add_argument("--format", choices=CONTENTS, default="text", help="text: a document per record; chat: a conversation per record, rendered with the tokenizer's chat template and stored with a loss mask; preference: a prompt and a chosen and a rejected completion per record, in TRL's layouts (conversational, implicit prompt, plain texts), rendered so (default: text)")
    parser.add_argument("--text-field", default="text", help="the JSONL field / Parquet column holding the text (default: text)")
    parser.add_argument(MESSAGES_FLAG, default=None, help=f"--format chat: the JSONL field / Parquet list<struct> column holding the messages, OpenAI-style (role, content) or ShareGPT (from, value); a record without it but with Alpaca's instruction and output is read as a user and an assistant turn (default: {DEFAULT_MESSAGES_FIELD}; the format in docs/data.md)")
    parser.add_argument("--train-on", choices=CHAT_TRAIN_ON, default=None, help="--format chat: the turns trained: every turn of --roles-to-train (assistant, the default), the last of them only (last), or every token but the first (all); a message's own \"weight\": 0|1 or \"train\": false|true overrides its role")
    parser.add_argument("--roles-to-train", default=None, metavar="ROLES", help=f"--format chat: the comma-separated roles whose turns train, of {', '.join(CHAT_ROLES)} (default: assistant)")
    parser.add_argument("--train-on-eos", choices=CHAT_TRAIN_ON_EOS, default=None, help="--format chat and preference: whether a trained turn's end-of-turn token trains: every turn's (turn, the default), the last trained turn's only (last), or none")
    # argparse %-formats help texts: a literal % is written %%.
    parser.add_argument("--chat-template", default=None, metavar="FILE", help="--format chat and preference: render with this Jinja file, or a template that ships by name (qwen3: Qwen3's with {%% generation %%} markers), instead of the tokenizer's")
    parser.add_argument("--on-bad-record", choices=("fail", "skip"), default="fail", help="a malformed, text-less or too long record stops the run (fail) or is counted and listed in the manifest (skip)")
    parser.add_argument(MAX_MESSAGES_FLAG, type=int, default=None, help=f"--format chat and preference: the most messages a conversation (a pair) may hold (default {DEFAULT_MAX_MESSAGES:,}); a longer one is a bad record, found before it is rendered")
    parser.add_argument(MAX_TOKENS_FLAG, type=int, default=None, help=f"--format chat and preference: the most tokens a rendered conversation (a pair) may hold (default {DEFAULT_MAX_RECORD_TOKENS:,}); a longer one is a bad record")
    parser.add_argument(TIMEOUT_FLAG, type=float, default=None, metavar="SECONDS", help=f"--format chat and preference: the longest one conversation (pair) may take to render and tokenize (default {DEFAULT_RENDER_TIMEOUT_S:g} s); a slower one is a bad record")
    parser.add_argument(MEMORY_FLAG, type=int, default=None, metavar="MIB", help=f"--format chat and preference: the most memory rendering one conversation (pair) may add (default {DEFAULT_RENDER_MEMORY_MIB:,} MiB); a hungrier one is a bad record")
    parser.add_argument(
        "--max-record-bytes", type=int, default=DEFAULT_MAX_RECORD_BYTES,
        help=f"the longest record read, a JSONL line, a Parquet value or a whole text file (default {DEFAULT_MAX_RECORD_BYTES >> 20} MiB); "
        "a longer one is a bad record, found without holding it in memory",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace an existing output")
    parser.add_argument("--shard-tokens", type=int, default=DEFAULT_SHARD_TOKENS, help=f"tokens per shard at most (a longer document gets a shard alone; default {DEFAULT_SHARD_TOKENS})")
    parser.add_argument(
        "--split-bytes", type=int, default=DEFAULT_SPLIT_BYTES,
        help=f"the work of one actor call (default {DEFAULT_SPLIT_BYTES >> 20} MiB): plain JSONL is split into byte ranges at line "
        "boundaries and Parquet into runs of row groups of about this size, so one big file uses every actor; .gz/.zst "
        "files (not seekable), .txt/.md files (one document) and s3:// Parquet are read whole by one actor; never changes the output",
    )
    parser.add_argument("--parallelism", type=int, default=0, help="tokenizer actors (default: the cluster's CPUs); never changes the output")
    parser.add_argument("--num-cpus", type=int, default=0, help="CPUs of the embedded cluster (default: all)")
    parser.add_argument("--address", default=None, help="a running Ray cluster (default: RAY_ADDRESS, else an embedded local one; a local corpus of --split-bytes or less in all, with neither --parallelism nor --num-cpus, is tokenized in this process, no cluster started)")
    parser.add_argument("--quiet", action="store_true", help="no progress line")


def recorded_command(argv: Sequence[str]) -> list[str]:
    """``argv`` without the execution-only flags (and their values)."""
    out: list[str] = []
    skip_value = False
    for arg in argv:
        if skip_value:
            skip_value = False
            continue
        name = arg.split("=", 1)[0]
        if name in _EXECUTION_FLAGS:
            skip_value = _EXECUTION_FLAGS[name] and "=" not in arg
            continue
        out.append(arg)
    return out


class Progress:
    """One line of documents/s and tokens/s, redrawn in place on a terminal, every few seconds otherwise."""

    def __init__(self, stream: TextIO, num_sources: int, enabled: bool) -> None:
        self.stream, self.num_sources, self.enabled = stream, num_sources, enabled
        self.tty = stream.isatty()
        self.start = time.monotonic()
        self._last = 0.0
        self._every = PROGRESS_EVERY_S if self.tty else 10.0

    def update(self, documents: int, tokens: int, source: int, *, final: bool = False) -> None:
        now = time.monotonic()
        if not self.enabled or (not final and now - self._last < self._every):
            return
        self._last = now
        elapsed = max(now - self.start, 1e-9)
        line = (
            f"prepare: file {source + 1}/{self.num_sources}  {documents:,} docs  {tokens:,} tokens  "
            f"{documents / elapsed:,.0f} docs/s  {tokens / elapsed / 1e6:,.2f}M tokens/s"
        )
        self.stream.write(("\r" + line + "\033[K" + ("\n" if final else "")) if self.tty else line + "\n")
        self.stream.flush()


@dataclass
class Summary:
    manifest: Manifest
    seconds: float  # the pipeline, from the first row asked for to the manifest published
    cluster_start_s: Optional[float]  # None: tokenized in this process, no cluster started


def run(args: argparse.Namespace, argv: Sequence[str], stream: TextIO = sys.stderr) -> Summary:
    import numpy as np

    from ringtrain.prepare import first_pass, pipeline, sources, tokenize, writer

    if args.shard_tokens < 1:
        raise ConfigError("--shard-tokens", f"must be positive, got {args.shard_tokens}")
    if args.max_record_bytes < 1:
        raise ConfigError(MAX_RECORD_FLAG, f"must be positive, got {args.max_record_bytes}")
    files = sources.expand(list(args.sources))
    spec = tokenize.resolve(args.tokenizer)
    chat = chat_spec(args, files, spec.info.vocab_size)
    output = writer.open_output(args.out, args.overwrite)
    pieces = sources.plan(sources.absolute(files), args.split_bytes)
    dtype = token_dtype_for(spec.info.vocab_size)
    field = chat.messages_field if chat is not None else args.text_field
    job = pipeline.Job(tokenize.absolute(spec), dtype, field, args.on_bad_record == "skip", args.max_record_bytes, chat)

    import ray

    local = pipeline.in_process(
        address=args.address or os.environ.get("RAY_ADDRESS"),
        connected=ray.is_initialized(),
        chosen_workers=bool(args.parallelism or args.num_cpus),
        corpus_bytes=sources.local_bytes(files),
        split_bytes=args.split_bytes,
    )
    if chat is not None and not local and args.on_bad_record == "fail":
        # Before the cluster: a malformed record is found in a second, not after the actors start.
        first_pass.check_records(files, chat.content, chat.messages_field, chat.template.variables, args.max_record_bytes)
    started = time.monotonic()
    handle = None if local else pipeline.connect(args.address, args.num_cpus or None)
    cluster_start_s = time.monotonic() - started
    try:
        if local:
            rows = pipeline.chunks_in_process(pieces, job)
        else:
            # One actor per piece at most: a piece is the unit of work.
            parallelism = min(len(pieces), args.parallelism or max(1, int(ray.cluster_resources().get("CPU", 1))))
            rows = pipeline.chunks(pieces, job, parallelism)
        folder = output.begin()
        packer = writer.Packer(folder, np.dtype(dtype), args.shard_tokens, output.shard_written, chat is not None)
        num_trained = 0
        tally = pipeline.Tally(len(files), [f.uri for f in files])
        progress = Progress(stream, len(files), not args.quiet)
        t0 = time.monotonic()
        try:
            for row in rows:
                got = pipeline.consume(row, job, tally)
                if got is not None:
                    packer.add(*got)
                    num_trained += int(np.count_nonzero(got[2])) if got[2] is not None else 0
                progress.update(tally.num_documents, tally.num_tokens, tally.last_source)
            if tally.num_documents == 0:
                raise DataError(f"{', '.join(args.sources)}: no documents (every record was empty or skipped)")
            shards = packer.finish()
            progress.update(tally.num_documents, tally.num_tokens, tally.last_source, final=True)
            manifest = Manifest(
                dtype=dtype,
                num_documents=tally.num_documents,
                num_tokens=tally.num_tokens,
                tokenizer=spec.info,
                sources=[SourceInfo(f.uri, *tally.per_source.get(f.index, [0, 0])) for f in files],
                shards=shards,
                skipped=[SkippedRecord(files[s].uri, line, reason) for s, line, reason in tally.skipped],
                num_skipped=tally.num_skipped,
                command=["ringtrain", "prepare", *recorded_command(argv)],
                content=args.format,
                chat=None if chat is None else ChatInfo(chat.template.sha256, chat.template.file, chat.train_on,
                                                        chat.template.mask_source, chat.messages_field, num_trained,
                                                        chat.roles, chat.eos),  # fmt: skip
                preference=PreferenceInfo(tally.num_documents // PAIR_DOCUMENTS) if args.format == "preference" else None,
            )
            output.publish(manifest)
        except BaseException:
            packer.discard()
            output.abort()
            raise
        return Summary(manifest, time.monotonic() - t0, None if local else cluster_start_s)
    finally:
        if handle is not None:
            handle.close()


def chat_spec(args: argparse.Namespace, files: "list[SourceFile]", vocab_size: int) -> "Optional[ChatSpec]":
    """``--format chat``'s ChatSpec (the template found and tried on a probe conversation), None
    for text; the chat flags without it, or a plain-text source with it, are refused."""
    from ringtrain.prepare import chat_render, chat_template

    chat_flags = {MESSAGES_FLAG: args.messages_field, "--train-on": args.train_on, "--roles-to-train": args.roles_to_train,
                  "--train-on-eos": args.train_on_eos, chat_template.OVERRIDE_KEY: args.chat_template}  # fmt: skip
    budget_flags = {MAX_MESSAGES_FLAG: args.max_messages, MAX_TOKENS_FLAG: args.max_record_tokens,
                    TIMEOUT_FLAG: args.render_timeout, MEMORY_FLAG: args.render_memory}  # fmt: skip
    if args.format == "text":
        for flag, value in {**chat_flags, **budget_flags}.items():
            if value is not None:
                raise ConfigError(flag, "applies to --format chat and preference only")
        return None
    if args.format == "preference":
        # A pair's trained turns are its completions' assistant turns, by the chat mask rules.
        for flag in (MESSAGES_FLAG, "--train-on", "--roles-to-train"):
            if chat_flags[flag] is not None:
                raise ConfigError(flag, "applies to --format chat only: a pair trains its completions' assistant turns")
    for flag, value in budget_flags.items():
        if value is not None and not 0 < value < math.inf:
            raise ConfigError(flag, f"must be a positive number, got {value}")
    text_files = [f.uri for f in files if f.kind == "text"]
    if text_files:
        what = "preference pairs" if args.format == "preference" else "conversations"
        raise ConfigError("SRC", f"{text_files[0]}: a .txt or .md file holds one text, not {what} (--format {args.format} reads "
                                 "JSONL or Parquet)")
    template = chat_template.find(args.tokenizer, args.format)
    if args.chat_template is not None:
        template = chat_template.override(template, args.chat_template)
    budget = RenderBudget(
        max_messages=args.max_messages or DEFAULT_MAX_MESSAGES,
        max_tokens=args.max_record_tokens or DEFAULT_MAX_RECORD_TOKENS,
        timeout_s=args.render_timeout or DEFAULT_RENDER_TIMEOUT_S,
        memory_mib=args.render_memory or DEFAULT_RENDER_MEMORY_MIB,
    )
    spec = chat_render.ChatSpec(template, args.train_on or "assistant", args.messages_field or DEFAULT_MESSAGES_FIELD,
                                vocab_size, roles_to_train(args.roles_to_train), args.train_on_eos or "turn", args.format,
                                budget)  # fmt: skip
    chat_render.check(spec)
    return spec


def roles_to_train(value: Optional[str]) -> tuple[str, ...]:
    """``--roles-to-train``'s roles, in the conversation's role order; the assistant's by default."""
    if value is None:
        return ("assistant",)
    named = {r.strip() for r in value.split(",") if r.strip()}
    unknown = sorted(named - set(CHAT_ROLES))
    if unknown or not named:
        raise ConfigError("--roles-to-train", f"{value!r}: name some of {', '.join(CHAT_ROLES)}"
                          + (f" ({', '.join(unknown)} is not a role)" if unknown else ""))  # fmt: skip
    return tuple(r for r in CHAT_ROLES if r in named)


def print_summary(summary: Summary, out_uri: str, stream: TextIO) -> None:
    m = summary.manifest
    rate = m.num_tokens / max(summary.seconds, 1e-9)
    count, what = m.num_documents, "conversations" if m.chat is not None else "documents"
    if m.preference is not None:
        count, what = m.preference.num_pairs, "preference pairs"
    where = (
        "in this process: a corpus of one piece's work (--split-bytes) starts no cluster"
        if summary.cluster_start_s is None
        else f"cluster start {summary.cluster_start_s:.1f} s not included"
    )
    trained = ""
    if m.chat is not None:  # a pair trains its completions' assistant turns: it takes no --train-on
        rule = "the completions' assistant turns" if m.preference is not None else f"--train-on {m.chat.train_on}"
        trained = f", {m.chat.num_trained_tokens:,} trained ({rule})"
    stream.write(
        f"prepared {count:,} {what}, {m.num_tokens:,} tokens{trained} ({m.dtype}) from {len(m.sources)} files "
        f"into {len(m.shards)} shards at {out_uri}\n"
        f"  tokenizer {m.tokenizer.name} (vocab {m.tokenizer.vocab_size}, eos {m.tokenizer.eos_id}); "
        f"{m.num_skipped} records skipped\n"
        f"  {summary.seconds:.1f} s: {count / max(summary.seconds, 1e-9):,.0f} {what}/s, "
        f"{rate / 1e6:.2f}M tokens/s ({where})\n"
    )


def main(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """Run and print the summary. Errors end the command in cli.main by their class: a bad
    record or unreadable file (DataError) exits 2 like a bad flag (ConfigError)."""
    print_summary(run(args, argv), args.out, sys.stdout)
    return EXIT_OK


def argv_after(command: str, argv: Optional[Sequence[str]]) -> list[str]:
    """The arguments after the subcommand's name (what the manifest records)."""
    full = list(sys.argv[1:] if argv is None else argv)
    return full[full.index(command) + 1 :] if command in full else full

