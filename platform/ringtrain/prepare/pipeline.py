"""The Ray Data pipeline of `ringtrain prepare`: file pieces -> tokenizer actors -> ordered shards.

Each piece of a source file (``sources.plan``: a byte range of plain JSONL, a run of Parquet row
groups, or a whole file) is one input row, so one huge file is spread over every actor. A pool
of tokenizer actors reads a piece and tokenizes its documents in batches (reading and
tokenizing in one stage keeps the text itself off the object store: only token ids travel). The
actors run single-threaded (TOKENIZERS_PARALLELISM=false) so N actors use N cores without
oversubscribing them. Ray Data keeps the output in input order (``preserve_order``), and every
chunk carries its documents in piece order, so the driver sees the documents in (source file
index, record index) order whatever the number of actors or the split size, and cuts shards
from that stream (``writer.Packer``): the bytes depend on neither.

With ``--format chat`` a record is a conversation, rendered and masked in the actor by the
tokenizer's chat template (``chat_render``): its tokens travel with a loss mask, a byte a token.

Bad records are not raised inside the actors: they travel in order with the tokens, numbered
from their piece's first line, so the driver reports (or, with ``--on-bad-record skip``, lists)
the first one in document order at its true line in the file. Line numbers cost no extra pass
over the data: each chunk also says how many lines its piece has consumed so far, and the
driver, which sees a file's pieces in order, adds up those of the pieces before (a pre-pass
counting newlines would read a multi-GB file, or download an S3 object, on the driver before
any work starts: the serial step splitting exists to remove).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from ringtrain.errors import DataError
from ringtrain.prepare.chat_records import Conversation
from ringtrain.prepare.chat_render import ChatEncoder, ChatSpec
from ringtrain.prepare.preference_render import PreferenceEncoder
from ringtrain.prepare.sources import (
    DEFAULT_MAX_RECORD_BYTES,
    BadRecord,
    LineCounter,
    Piece,
    SourceFile,
    fetch,
    needs_fetch,
    read_records,
)
from ringtrain.prepare.tokenize import Encoder, TokenizerSpec

# A chunk (one output row) closes at this many documents (or skipped records) or characters of
# text, whichever comes first: enough work per call to hide Ray's per-row cost, small enough to
# stream.
CHUNK_DOCUMENTS = 512
CHUNK_CHARS = 4 << 20
# Skipped records listed in the manifest; the count covers them all.
MAX_LISTED_SKIPS = 1000


@dataclass(frozen=True)
class Job:
    """What every tokenizer actor needs; picklable."""

    tokenizer: TokenizerSpec
    dtype: str
    text_field: str
    skip_bad: bool
    max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES
    chat: Optional[ChatSpec] = None  # --format chat: text_field names the messages field


def _row(
    piece: Piece, lines: int, tokens: np.ndarray, lengths: np.ndarray, bad: list[tuple[int, str]], fatal: bool = False, error: str = "",
    mask: Optional[np.ndarray] = None,
) -> dict[str, np.ndarray]:
    """One output row. ``bad`` lines count from the piece's first line; ``lines``: the lines the
    piece has consumed so far; ``fatal``: the last bad record stops the run; ``error``: the piece
    could not be read; ``mask``: chat conversations' loss mask, a byte a token."""
    return {
        "src": np.array([piece.source.index], dtype=np.int64),
        "piece": np.array([piece.number], dtype=np.int64),
        "lines": np.array([lines], dtype=np.int64),
        "tokens": np.array([tokens.tobytes()], dtype=object),
        "lengths": np.array([lengths.astype(np.int64).tobytes()], dtype=object),
        "bad": np.array([json.dumps(bad)], dtype=object),
        "fatal": np.array([fatal], dtype=bool),
        "error": np.array([error], dtype=object),
        "mask": np.array([b"" if mask is None else mask.astype(np.uint8).tobytes()], dtype=object),
    }


def encoder_for(spec: ChatSpec, dtype: str) -> ChatEncoder:
    """The encoder of ``spec``'s records: conversations, or preference pairs."""
    return (PreferenceEncoder if spec.content == "preference" else ChatEncoder)(spec, dtype)


class PieceTokenizer:
    """A Ray Data actor: one piece of a source file in, its documents' tokens out in ordered chunks."""

    def __init__(self, job: Job) -> None:
        # Before the tokenizer is loaded: its Rust thread pool reads this once.
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
        self.job = job
        self.encoder = Encoder(job.tokenizer, job.dtype)
        self.chat = encoder_for(job.chat, job.dtype) if job.chat is not None else None

    def __call__(self, batch: dict[str, np.ndarray]) -> Iterator[dict[str, np.ndarray]]:
        for i in range(len(batch["number"])):
            source = SourceFile(int(batch["index"][i]), str(batch["uri"][i]), str(batch["kind"][i]))
            end = int(batch["end"][i])
            yield from self.piece(Piece(int(batch["number"][i]), source, int(batch["start"][i]), None if end < 0 else end))

    def piece(self, piece: Piece) -> Iterator[dict[str, np.ndarray]]:
        folder = tempfile.mkdtemp(prefix="rt-src-") if needs_fetch(piece) else None
        counter = LineCounter()
        texts: list[Any] = []  # texts, or with --format chat rendered conversations
        bad: list[tuple[int, str]] = []
        chars = 0
        try:
            local = fetch(piece.source.uri, folder) if folder else None
            chat = self.chat
            context = chat.renderer.context_fields if chat is not None else frozenset()
            pair_fields = self.job.chat.record_fields if self.job.chat is not None else ()
            max_messages = chat.budget.max_messages if chat is not None else 0
            for record in read_records(piece, self.job.text_field, local, counter, self.job.max_record_bytes,
                                       chat is not None, context, pair_fields, max_messages):  # fmt: skip
                if isinstance(record, Conversation) and chat is not None:
                    record = chat.convert(record, counter.lines)
                if isinstance(record, BadRecord):
                    bad.append((record.line, record.reason))
                    if not self.job.skip_bad or record.fatal:
                        yield self._chunk(piece, counter, texts, bad, fatal=True)
                        return
                    if len(bad) >= CHUNK_DOCUMENTS:
                        # Else a file of nothing but bad records would have them all held here:
                        # 17 KB of zstd holds 100 million bad lines, some 20 GB as Python tuples.
                        yield self._chunk(piece, counter, texts, bad)
                        texts, bad, chars = [], [], 0
                    continue
                if not record:
                    continue  # an empty text makes no document (it would be a lone EOS)
                # A preference pair is its prompt's and completions' documents, in order.
                docs = record if isinstance(record, tuple) else (record,)
                texts.extend(docs)
                chars += sum(len(doc) for doc in docs)
                if len(texts) >= CHUNK_DOCUMENTS or chars >= CHUNK_CHARS:
                    yield self._chunk(piece, counter, texts, bad)
                    texts, bad, chars = [], [], 0
            yield self._chunk(piece, counter, texts, bad)
        except DataError as exc:
            yield self._chunk(piece, counter, texts, bad, error=str(exc))
        finally:
            if folder:
                shutil.rmtree(folder, ignore_errors=True)

    def _chunk(
        self, piece: Piece, counter: LineCounter, texts: list[Any], bad: list[tuple[int, str]], fatal: bool = False, error: str = ""
    ) -> dict[str, np.ndarray]:
        if self.chat is not None:
            tokens, lengths, mask = self.chat.encode(texts)
            return _row(piece, counter.lines, tokens, lengths, bad, fatal, error, mask)
        tokens, lengths = self.encoder.encode(texts)
        return _row(piece, counter.lines, tokens, lengths, bad, fatal, error)


def piece_items(pieces: list[Piece]) -> list[dict[str, Any]]:
    """The pipeline's input rows (plain columns: Ray Data builds blocks of them)."""
    return [
        {"number": p.number, "index": p.source.index, "uri": p.source.uri, "kind": p.source.kind,
         "start": p.start, "end": -1 if p.end is None else p.end}
        for p in pieces
    ]


@dataclass
class Tally:
    """What the driver has seen so far: totals, per source, the skipped records, and where in
    the piece sequence it is (to number a piece's lines from the file's first line)."""

    num_sources: int
    uris: list[str] = field(default_factory=list)  # by source index: bad-record messages name the file
    num_documents: int = 0
    num_tokens: int = 0
    num_skipped: int = 0
    per_source: dict[int, list[int]] = field(default_factory=dict)  # index -> [documents, tokens]
    skipped: list[tuple[int, int, str]] = field(default_factory=list)  # (source, line, reason)
    last_source: int = 0
    piece: int = -1  # the piece of the rows seen last
    line_base: int = 0  # lines of the current file before the current piece
    piece_lines: int = 0  # lines the current piece has consumed so far


def chunks(pieces: list[Piece], job: Job, parallelism: int) -> Iterator[dict[str, Any]]:
    """The pipeline's output rows in document order (a Ray connection must be up)."""
    import ray.data

    # Ray Data's settings are process-wide and the connection may be a caller's: each is set
    # for this pipeline and put back when it ends.
    ctx = ray.data.DataContext.get_current()
    saved = (ctx.execution_options.preserve_order, ctx.enable_progress_bars, ctx.print_on_execution_start)
    loggers = {name: logging.getLogger(name) for name in ("ray.data", "ray.data._internal.progress")}
    levels = {name: logger.level for name, logger in loggers.items()}
    ctx.execution_options.preserve_order = True
    ctx.enable_progress_bars = False  # prepare draws its own: documents/s and tokens/s
    ctx.print_on_execution_start = False
    # Ray Data logs each execution's start and end at INFO; prepare prints its own summary.
    loggers["ray.data"].setLevel(logging.WARNING)
    loggers["ray.data._internal.progress"].setLevel(logging.ERROR)  # "bars disabled": on purpose
    try:
        items = piece_items(pieces)
        ds = ray.data.from_items(items, override_num_blocks=len(items))
        with warnings.catch_warnings():
            # max_restarts=0 is Ray Data's documented way to stop actor restarts; it warns that
            # the catch-all remote-args path will change, which is not the user's concern.
            warnings.simplefilter("ignore", DeprecationWarning)
            ds = _tokenize_stage(ds, job, parallelism)
        for batch in ds.iter_batches(batch_size=None, batch_format="numpy", prefetch_batches=2):
            for i in range(len(batch["src"])):
                yield {key: batch[key][i] for key in batch}
    finally:
        ctx.execution_options.preserve_order, ctx.enable_progress_bars, ctx.print_on_execution_start = saved
        for name, logger in loggers.items():
            logger.setLevel(levels[name])


def in_process(*, address: Optional[str], connected: bool, chosen_workers: bool, corpus_bytes: Optional[int], split_bytes: int) -> bool:
    """Whether prepare tokenizes in this process, without a cluster: for a local corpus of one
    piece's work (``split_bytes``) at most, where starting a cluster (seconds) would cost more
    than the work, unless the user named a cluster, is already connected to one, or chose its
    workers (``--parallelism``, ``--num-cpus``)."""
    if address or connected or chosen_workers or corpus_bytes is None:
        return False
    return corpus_bytes <= split_bytes


def chunks_in_process(pieces: list[Piece], job: Job) -> Iterator[dict[str, Any]]:
    """The rows ``chunks`` yields, in the same order, made here by one ``PieceTokenizer``."""
    actor = PieceTokenizer(job)
    for item in piece_items(pieces):
        for row in actor({key: np.array([value]) for key, value in item.items()}):
            yield {key: column[0] for key, column in row.items()}


def _tokenize_stage(ds: Any, job: Job, parallelism: int) -> Any:
    import ray.data

    return ds.map_batches(
        PieceTokenizer,
        fn_constructor_kwargs={"job": job},
        batch_size=1,
        batch_format="numpy",
        compute=ray.data.ActorPoolStrategy(size=parallelism),
        num_cpus=1,
        # A lost actor fails the run (nothing is published) rather than being restarted.
        max_restarts=0,
    )


def consume(row: dict[str, Any], job: Job, tally: Tally) -> Optional[tuple[np.ndarray, np.ndarray, Optional[np.ndarray]]]:
    """Account for one row; its (tokens, lengths, chat mask or None), or DataError for a bad
    record under ``fail``."""
    src, piece = int(row["src"]), int(row["piece"])
    if piece != tally.piece:
        # Every piece yields at least one row, in plan order: a gap would misnumber lines.
        if piece != tally.piece + 1:
            raise RuntimeError(f"prepare: piece {piece} arrived after piece {tally.piece}")
        tally.line_base = tally.line_base + tally.piece_lines if src == tally.last_source and tally.piece >= 0 else 0
        tally.piece = piece
    tally.last_source = src
    tally.piece_lines = int(row["lines"])
    bad = [(tally.line_base + int(line), str(reason)) for line, reason in json.loads(row["bad"])]
    if row["fatal"]:
        line, reason = bad.pop()
        raise DataError(f"{tally.uris[src]}:{line}: {reason}")
    for line, reason in bad:
        tally.num_skipped += 1
        if len(tally.skipped) < MAX_LISTED_SKIPS:
            tally.skipped.append((src, line, reason))
    tokens = np.frombuffer(row["tokens"], dtype=job.dtype)
    lengths = np.frombuffer(row["lengths"], dtype=np.int64)
    counts = tally.per_source.setdefault(src, [0, 0])
    counts[0] += int(lengths.size)
    counts[1] += int(tokens.size)
    tally.num_documents += int(lengths.size)
    tally.num_tokens += int(tokens.size)
    if row["error"]:
        raise DataError(str(row["error"]))
    mask = np.frombuffer(row["mask"], dtype=np.uint8) if job.chat is not None else None
    return (tokens, lengths, mask) if lengths.size else None


class _Borrowed:
    """The caller's own Ray connection: used as it is, and left up."""

    def close(self) -> None:
        """Not ours to close."""


def connect(address: Optional[str], num_cpus: Optional[int]) -> Any:
    """Join ``address`` (or RAY_ADDRESS), else start an embedded local cluster; the handle to close.

    A process already connected to Ray (a driver calling prepare as a library, a test with one
    cluster for many runs) keeps its connection: prepare runs there and does not shut it down.
    """
    import ray

    from ringtrain.actors.cluster import connect_to

    if ray.is_initialized():
        return _Borrowed()
    return connect_to(address, num_cpus=num_cpus)
