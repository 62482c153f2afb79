"""EvalSet: the sequences an evaluation scores, as input ids and next-token labels.

Two shapes of source, as in training (``train/data.py``): a 2-D ``.npy`` whose rows are the
sequences (each row's inputs are the row, its labels the row shifted by one with the last
ignored: transformers' ``labels=input_ids``), or a stream (a ``.bin`` or 1-D ``.npy`` of token
ids, a prepared text dataset's tokens, local or on ``s3://``, or text: its bytes for a
byte-level model, its tokens when the model brings a tokenizer) cut into ``seq_len + 1``-token
windows spread evenly over the whole stream, so the score stands for the corpus rather than its
first files. A chat dataset (``prepare --format chat``) gives
whole conversations, one per row, padded to the longest scored: labels are the next tokens its
loss mask trains on, so the loss and the count are over trained tokens, by position in the
conversation. Every conversation of at most ``seq_len`` tokens is scored, or ``max_rows`` of
them spread evenly; longer ones are left out (never cut: the score is of whole ones), and the
set says how many of each (``ChatCoverage``).

Padding for a mesh happens here too, so that every rank pads alike: each sequence to a multiple
of ``2 x cp`` (the zigzag layout's chunks) with ignored labels, and the rows to a multiple of
``dp`` with rows that are all padding, so every replica runs the same number of forwards (ZeRO-3
gathers parameters over the whole world in each one).

Pure numpy, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from ringtrain.checkpoint.s3_access import check_reachable
from ringtrain.config import STDLIB_CORPUS
from ringtrain.errors import ConfigError, DataError
from ringtrain.evaluation.result import ChatCoverage
from ringtrain.evaluation.text import Tokenizer
from ringtrain.prepared import Manifest
from ringtrain.topology import round_up
from ringtrain.train.corpus import PreparedCorpus, is_prepared_path, read_manifest
from ringtrain.train.data import IGNORE_INDEX, is_byte_corpus, load_tokens

DEFAULT_WINDOWS = 64  # windows of a stream scored when no max_rows is given
PAD_ID = 0  # what padding positions hold; their labels are ignored, so any valid id does


@dataclass(frozen=True)
class EvalSet:
    inputs: np.ndarray  # [rows, length] int64
    labels: np.ndarray  # [rows, length] int64; IGNORE_INDEX where nothing is predicted
    coverage: Optional[ChatCoverage] = None  # a chat dataset's: which conversations the rows are

    @property
    def num_rows(self) -> int:
        return int(self.inputs.shape[0])

    @property
    def seq_len(self) -> int:
        return int(self.inputs.shape[1])

    @property
    def num_labels(self) -> int:
        return int((self.labels != IGNORE_INDEX).sum())

    def padded(self, *, multiple: int, rows_multiple: int) -> "EvalSet":
        """Sequences padded to a multiple of ``multiple`` tokens and the rows to a multiple of
        ``rows_multiple``; padding predicts nothing."""
        rows, length = round_up(self.num_rows, rows_multiple), round_up(self.seq_len, multiple)
        inputs = np.full((rows, length), PAD_ID, dtype=np.int64)
        labels = np.full((rows, length), IGNORE_INDEX, dtype=np.int64)
        inputs[: self.num_rows, : self.seq_len] = self.inputs
        labels[: self.num_rows, : self.seq_len] = self.labels
        return EvalSet(inputs, labels, self.coverage)

    def replica_rows(self, replica: int, dp: int) -> range:
        """The rows replica ``replica`` of ``dp`` scores: a contiguous share (rows divide by dp)."""
        share = self.num_rows // dp
        return range(replica * share, (replica + 1) * share)


def rows_set(rows: np.ndarray) -> EvalSet:
    """Each row a sequence, labelled as transformers labels ``input_ids``."""
    inputs = np.asarray(rows, dtype=np.int64)
    labels = np.full_like(inputs, IGNORE_INDEX)
    labels[:, :-1] = inputs[:, 1:]
    return EvalSet(inputs, labels)


def windows_set(windows: np.ndarray) -> EvalSet:
    """Windows of ``seq_len + 1`` tokens: inputs the first ``seq_len``, labels the last."""
    w = np.asarray(windows, dtype=np.int64)
    return EvalSet(np.ascontiguousarray(w[:, :-1]), np.ascontiguousarray(w[:, 1:]))


def load_eval_set(
    path: str,
    *,
    seq_len: int,
    vocab_size: int,
    max_rows: Optional[int] = None,
    token_dtype: str = "uint16",
    tokenizer: Optional[Tokenizer] = None,
    key: str = "eval.data",
    content: Optional[str] = None,
) -> EvalSet:
    """The sequences of ``path``; errors name ``key``. ``content``: what ``path`` holds, where
    the caller read it already (``content_of``)."""
    if (content or content_of(path, key)) == "chat":
        found = chat_set(path, seq_len=seq_len, max_rows=max_rows, key=key)
    elif is_prepared_path(path):  # a prepared text dataset: its token stream, not its files' bytes
        found = windows_set(_prepared_windows(path, seq_len, max_rows or DEFAULT_WINDOWS, key))
    else:
        found = _file_set(path, seq_len=seq_len, max_rows=max_rows, token_dtype=token_dtype, tokenizer=tokenizer, key=key)
    top, low = int(found.inputs.max(initial=0)), int(found.inputs.min(initial=0))
    if top >= vocab_size or low < 0:
        raise ConfigError(key, f"{path} holds token id {top if top >= vocab_size else low}, outside the model's vocabulary [0, {vocab_size})")
    return found


def _file_set(path: str, *, seq_len: int, max_rows: Optional[int], token_dtype: str, tokenizer: Optional[Tokenizer],
              key: str) -> EvalSet:  # fmt: skip
    """The sequences of what ``data.path`` takes: text, a token stream or a 2-D ``.npy`` of rows."""
    if path != STDLIB_CORPUS and not Path(path).exists():
        raise ConfigError(key, f"no such file or directory: {path}")
    try:
        tokens = load_tokens(path, token_dtype)
    except ConfigError as exc:  # it names data.path; here the data came from elsewhere
        raise ConfigError(key, exc.reason) from None
    if tokens.ndim == 2:
        if tokens.shape[1] < 2:
            raise ConfigError(key, f"the rows of {path} hold {tokens.shape[1]} token(s): nothing to predict")
        return rows_set(tokens[: max_rows or len(tokens)])
    if tokenizer is not None and is_byte_corpus(path):
        return windows_set(_token_windows(tokens, tokenizer, seq_len, max_rows or DEFAULT_WINDOWS, path, key))
    return windows_set(_windows(tokens, seq_len, max_rows or DEFAULT_WINDOWS, path, key))


def manifest_of(path: str, key: str = "eval.data") -> Optional[Manifest]:
    """The manifest of prepared dataset ``path`` (its manifest alone read), or None where ``path``
    is text files, a token stream or the stdlib corpus; errors name ``key``."""
    if path == STDLIB_CORPUS or not is_prepared_path(path):
        return None
    check_reachable(path, key)  # one quick request names a bad endpoint or grant before reads retry
    try:
        return read_manifest(path)
    except (DataError, ValueError, OSError) as exc:
        raise ConfigError(key, str(exc)) from None


def content_in(manifest: Optional[Manifest]) -> str:
    """What a dataset of ``manifest`` holds (text, chat or preference); text where it has none."""
    return "text" if manifest is None else manifest.content


def content_of(path: str, key: str = "eval.data") -> str:
    """What ``path`` holds: a prepared dataset's content (text, chat or preference), else text."""
    return content_in(manifest_of(path, key))


def chat_set(path: str, *, seq_len: int, max_rows: Optional[int] = None, key: str = "eval.data") -> EvalSet:
    """Whole conversations of chat dataset ``path`` that fit ``seq_len``, one per row: all of
    them, or ``max_rows`` spread evenly over them."""
    try:
        corpus = PreparedCorpus(path)
    except (DataError, ValueError, OSError) as exc:
        raise ConfigError(key, str(exc)) from None
    try:
        lengths = corpus.document_lengths()
        fits = np.flatnonzero(lengths <= seq_len)
        if not len(fits):
            raise ConfigError(key, f"no conversation of {path} fits in seq_len={seq_len} tokens")
        chosen = fits[_starts(len(fits), 1, min(len(fits), max_rows or len(fits)))]
        coverage = ChatCoverage(total=len(lengths), too_long=len(lengths) - len(fits), not_scored=len(fits) - len(chosen))
        width = int(lengths[chosen].max())
        inputs = np.full((len(chosen), width), PAD_ID, dtype=np.int64)
        labels = np.full((len(chosen), width), IGNORE_INDEX, dtype=np.int64)
        for row, conversation in enumerate(chosen):
            start, stop = corpus.document_span(int(conversation))
            tokens, mask = corpus.tokens(start, stop), corpus.mask(start, stop)
            inputs[row, : len(tokens)] = tokens
            labels[row, : len(tokens) - 1] = np.where(mask[1:] == 1, tokens[1:], IGNORE_INDEX)
        return EvalSet(inputs, labels, coverage)
    except DataError as exc:
        raise ConfigError(key, str(exc)) from None
    finally:
        corpus.close()


def _starts(num_tokens: int, span: int, count: int) -> list[int]:
    """``count`` start offsets spread evenly so each leaves ``span`` tokens."""
    last = num_tokens - span
    if count == 1:
        return [0]
    return [round(i * last / (count - 1)) for i in range(count)]


def _window_starts(num_tokens: int, seq_len: int, count: int, path: str, key: str) -> list[int]:
    """Where ``count`` windows of ``seq_len + 1`` tokens start, spread over a stream of
    ``num_tokens`` (fewer where the stream holds fewer)."""
    span = seq_len + 1
    available = (num_tokens - 1) // seq_len
    if available < 1:
        raise ConfigError(key, f"{path} holds {num_tokens} tokens, fewer than seq_len + 1 = {span}")
    return _starts(num_tokens, span, min(count, available))


def _windows(stream: np.ndarray, seq_len: int, count: int, path: str, key: str) -> np.ndarray:
    starts = _window_starts(stream.size, seq_len, count, path, key)
    return np.stack([np.asarray(stream[s : s + seq_len + 1]) for s in starts])


def _prepared_windows(path: str, seq_len: int, count: int, key: str) -> np.ndarray:
    """Windows of a prepared dataset's token stream (its documents end to end, as training reads
    them), read shard by shard: a local folder or an ``s3://`` prefix."""
    try:
        corpus = PreparedCorpus(path)
    except (DataError, ValueError, OSError) as exc:
        raise ConfigError(key, str(exc)) from None
    try:
        starts = _window_starts(corpus.num_tokens, seq_len, count, path, key)
        return np.stack([corpus.tokens(s, s + seq_len + 1) for s in starts])
    except DataError as exc:
        raise ConfigError(key, str(exc)) from None
    finally:
        corpus.close()


def _token_windows(blob: np.ndarray, tokenizer: Tokenizer, seq_len: int, count: int, path: str, key: str) -> np.ndarray:
    """Windows of the text's tokens, each tokenized from a byte offset spread over the text."""
    data = blob.tobytes()
    span = seq_len + 1
    sample = tokenizer.encode(data[: 1 << 16].decode("utf-8", errors="ignore"))
    bytes_per_token = max(1.0, min(len(data), 1 << 16) / max(1, len(sample)))
    guess = int(span * bytes_per_token * 1.25) + 64
    windows = []
    for start in _starts(len(data), min(guess, len(data)), count):
        size = guess
        while True:
            ids = tokenizer.encode(data[start : start + size].decode("utf-8", errors="ignore"))
            if len(ids) >= span or start + size >= len(data):
                break
            size *= 2
        if len(ids) >= span:
            windows.append(ids[:span])
    if not windows:
        raise ConfigError(key, f"{path} holds fewer than seq_len + 1 = {span} tokens")
    return np.asarray(windows, dtype=np.int64)
