"""Training data: token sources, the global sample order, and each rank's shard of a step.

What is read is a function of the seed and the global sample index only; who reads it is a
function of the mesh. Step ``s`` trains on global samples ``[s * global_batch, (s + 1) *
global_batch)``; replica ``d`` of ``dp`` takes a contiguous ``global_batch / dp`` of them and
splits those into micro-batches; inside the replica, each CP rank takes its token positions
(``topology.sequence_positions``) of every sample. So a dp change moves samples between
replicas but never changes the set a step trains on.

Three shapes of source: a 1-D token stream cut into windows of ``seq_len + 1`` tokens (the
input and its next-token labels); a 2-D ``.npy`` array whose rows are the samples, each of
``seq_len`` tokens, trained on as transformers does with ``labels=input_ids``: the last token
of a row has no label (``IGNORE_INDEX``); or a ``SampleSource`` (prepared datasets, mixed:
``mixture.py``) whose windows may carry document ids.

Document packing (``data.packing: doc``): a window's documents stay apart. Each token carries
its document's index within the sample, attention is confined to the document, and position
ids restart at 0 at every document start (the window's first, cut-off document starts at 0
too). The last token of a document (its EOS) would predict the next document's first token:
that label is ignored, as transformers' packing with flash-attention does, so no document is
predicted from another. A sample's number of labels then depends on its documents.

Chat datasets (rows of whole conversations, ``conversations.py``): a sample also carries its
loss mask, and the label of position i is token i + 1 only when mask[i + 1] is 1 and token
i + 1 is in the same conversation, else IGNORE_INDEX. Labels are made on the whole sample and
only then split over CP ranks, so no label is lost or counted twice at a shard boundary (zigzag
included). Under ``train.loss_norm: sequence`` each label also gets the weight 1 / N_i of its
conversation's N_i labels in the row (``MicroBatch.weights``).

Pure numpy: tensors are made by the caller, on its device.
"""

from __future__ import annotations

import os
import sysconfig
import time
from collections.abc import Collection, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Optional, Protocol, Union

import numpy as np

from ringtrain.config import STDLIB_CORPUS
from ringtrain.errors import ConfigError, DataError
from ringtrain.links import check_folder
from ringtrain.topology import sequence_positions
from ringtrain.train.conversations import conversation_weights

if TYPE_CHECKING:
    from ringtrain.train.pairs import PairRows

# The label of a position that predicts nothing (the last token of a row sample), as
# torch.nn.functional.cross_entropy's default ignore_index.
IGNORE_INDEX = -100
_SKIPPED_STDLIB_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


def stdlib_source_files() -> list[Path]:
    """The standard library's own ``.py`` files, sorted: real text present on every machine."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIPPED_STDLIB_DIRS)
        files.extend(Path(dirpath) / f for f in sorted(filenames) if f.endswith(".py"))
    return files


def check_data(path: str, vocab_size: int, seq_len: Optional[int] = None) -> None:
    """Raise a ConfigError naming the key when the data cannot feed the model."""
    check_data_path(path)
    if is_byte_corpus(path) and vocab_size < 256:
        raise ConfigError("model.vocab_size", f"{vocab_size} is too small for a byte-level corpus (needs 256)")
    if Path(path).suffix == ".npy":
        tokens = load_tokens(path)
        # A .npy holds a test or small job's samples: small enough to scan before step 1.
        top = int(tokens.max()) if tokens.size else 0
        if top >= vocab_size or (tokens.size and int(tokens.min()) < 0):
            raise ConfigError("data.path", f"{path} holds token id {top if top >= vocab_size else int(tokens.min())}, "
                              f"outside the model's vocabulary [0, {vocab_size})")
        if tokens.ndim == 2 and seq_len is not None and tokens.shape[1] != seq_len:
            raise ConfigError("data.seq_len", f"{seq_len}, but the rows of {path} hold {tokens.shape[1]} tokens each")


def check_data_path(path: str) -> None:
    """Raise a ConfigError naming ``data.path`` when it cannot be a data source."""
    if path == STDLIB_CORPUS:
        return
    p = Path(path)
    if not p.exists():
        raise ConfigError("data.path", f"no such file or directory: {path}")
    if p.is_dir() and not any(f.is_file() for f in p.rglob("*")):
        raise ConfigError("data.path", f"directory {path} holds no files")
    if p.is_dir():
        check_folder(p, "data.path")  # every file of it is read as text


def load_tokens(path: str, token_dtype: str = "uint16") -> np.ndarray:
    """Bytes of text files, a memory-mapped ``.bin`` of ``token_dtype`` (1-D), or a ``.npy`` of
    token ids: 1-D a stream, 2-D one sample per row."""
    check_data_path(path)
    if path == STDLIB_CORPUS:
        return _read_bytes(_fingerprint(stdlib_source_files()))
    p = Path(path)
    if p.is_file() and p.suffix == ".npy":
        try:
            array = np.load(p, mmap_mode="r")
        except (ValueError, OSError) as exc:
            raise ConfigError("data.path", f"{path} is not a readable .npy array: {exc}") from None
        if array.ndim not in (1, 2) or not np.issubdtype(array.dtype, np.integer):
            raise ConfigError("data.path", f"{path} must be a 1-D or 2-D array of integer token ids (got {array.ndim}-D {array.dtype})")
        return array
    if p.is_file() and p.suffix == ".bin":
        itemsize = np.dtype(token_dtype).itemsize
        if p.stat().st_size % itemsize:
            raise DataError(f"{path}: size {p.stat().st_size} is not a multiple of data.token_dtype={token_dtype}")
        return np.memmap(p, dtype=token_dtype, mode="r")
    files = sorted(f for f in p.rglob("*") if f.is_file()) if p.is_dir() else [p]
    return _read_bytes(_fingerprint(files))


def _fingerprint(files: list[Path]) -> tuple[tuple[Path, int, int], ...]:
    """Paths with size and mtime, so the cache below never serves a corpus that changed."""
    return tuple((f, f.stat().st_size, f.stat().st_mtime_ns) for f in files)


@lru_cache(maxsize=2)
def _read_bytes(files: tuple[tuple[Path, int, int], ...]) -> np.ndarray:
    # Files are joined with a newline so no sample glues the end of one file to the next word.
    blob = b"\n".join(f.read_bytes() for f, _, _ in files)
    return np.frombuffer(blob, dtype=np.uint8)


def is_byte_corpus(path: str) -> bool:
    return not (path != STDLIB_CORPUS and Path(path).suffix in (".bin", ".npy"))


class WindowOrder:
    """The k-th draw from a set of windows -> its window, reshuffled every epoch."""

    def __init__(self, num_windows: int, key: Sequence[int], counts: Optional[np.ndarray] = None) -> None:
        """``key`` seeds the shuffles; ``counts[w]`` is how often window w comes per epoch (1 if None)."""
        self.key = list(key)
        self.windows = np.arange(num_windows, dtype=np.int64) if counts is None else np.repeat(np.arange(num_windows), counts)
        if len(self.windows) == 0:
            raise DataError("no window is left to draw after data.sources[*].long_doc_upsample")
        self._epoch = -1
        self._perm = np.empty(0, dtype=np.int64)

    @property
    def epoch_size(self) -> int:
        return len(self.windows)

    def window(self, k: int) -> int:
        epoch, pos = divmod(k, len(self.windows))
        if epoch != self._epoch:
            rng = np.random.Generator(np.random.PCG64([*self.key, epoch]))
            self._perm = self.windows[rng.permutation(len(self.windows))]
            self._epoch = epoch
        return int(self._perm[pos])

    def epoch_of(self, k: int) -> int:
        return k // len(self.windows)


class SampleOrder(WindowOrder):
    """Global sample index -> window of ``seq_len + 1`` tokens of a token file, reshuffled every
    epoch by the seed alone."""

    def __init__(self, num_tokens: int, seq_len: int, seed: int, *, num_rows: Optional[int] = None) -> None:
        """Windows of a ``num_tokens`` stream, or ``num_rows`` row samples when given."""
        self.seq_len = seq_len
        self.seed = seed
        self.num_windows = num_rows if num_rows is not None else (num_tokens - 1) // seq_len
        if self.num_windows < 1:
            raise DataError(f"the corpus has {num_tokens} tokens, fewer than data.seq_len + 1 = {seq_len + 1}")
        super().__init__(self.num_windows, [seed])


@dataclass(frozen=True)
class BatchPlan:
    """Which global samples one replica trains on at one step, split into micro-batches."""

    global_batch: int
    dp: int
    micro_batch: int

    @property
    def per_replica(self) -> int:
        return self.global_batch // self.dp

    def replica_samples(self, step: int, replica: int) -> list[int]:
        start = step * self.global_batch + replica * self.per_replica
        return list(range(start, start + self.per_replica))

    def micro_batches(self, step: int, replica: int) -> list[list[int]]:
        samples = self.replica_samples(step, replica)
        return [samples[i : i + self.micro_batch] for i in range(0, len(samples), self.micro_batch)]


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch as this CP rank sees it: ``[micro_batch, seq_local]`` arrays."""

    samples: tuple[int, ...]
    input_ids: np.ndarray
    labels: np.ndarray
    position_ids: np.ndarray
    doc_ids: Optional[np.ndarray] = None  # document index within the sample, under doc packing
    weights: Optional[np.ndarray] = None  # float32 per-label loss weights (train.loss_norm: sequence)
    origins: tuple[tuple[int, int], ...] = ()  # (source, document of its first token) per sample
    # Preference pairs (train/pairs.py): each label's completion slot in the micro-batch (2 k:
    # the k-th pair's chosen, 2 k + 1 its rejected; -1: none), the pairs' dataset indices by
    # slot, and the documents' families (a pair's prompt shared: pairs.PAIR_FAMILY; else 0).
    completions: Optional[np.ndarray] = None
    pairs: tuple[int, ...] = ()
    family: int = 0


@dataclass(frozen=True)
class Sample:
    """One window of ``seq_len + 1`` tokens from a SampleSource."""

    tokens: np.ndarray  # int64
    doc_ids: Optional[np.ndarray]  # int64 document index within the window (doc packing), else None
    origin: tuple[int, int]  # (source index, document index in that source) of the first token
    targets: Optional[np.ndarray] = None  # uint8 loss mask of a chat row: 1 where a token is a trained target
    # A row of preference pairs (train/pairs.py): each token's position (a completion's continue
    # its prompt's), the completion slot each token is a trained target of (-1: none), the pairs'
    # dataset indices by slot, and the documents' families.
    positions: Optional[np.ndarray] = None
    completions: Optional[np.ndarray] = None
    pairs: tuple[int, ...] = ()
    family: int = 0


class PairSource(Protocol):
    """A source of preference pairs' rows (``mixture.MixedSamples`` of a preference dataset)."""

    def pair_rows(self) -> "PairRows": ...
    def pair_sample(self, row: int) -> Sample: ...


class SampleSource(Protocol):
    """Global sample index -> window; a function of the index and the seed only."""

    packing: str  # "doc" when samples carry document ids

    def sample(self, sample: int) -> Sample: ...

    def close(self) -> None:
        """Release what reading holds (shard readers, fetch threads)."""
        ...


def pack_documents(tokens: np.ndarray, doc_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(inputs, labels, position ids) of a ``seq_len + 1`` window under document packing."""
    inputs, labels = tokens[:-1], tokens[1:].copy()
    doc_in = doc_ids[:-1]
    labels[doc_ids[1:] != doc_in] = IGNORE_INDEX  # a document's EOS predicts nothing of the next
    index = np.arange(len(inputs))
    starts = np.ones(len(inputs), dtype=bool)
    starts[1:] = doc_in[1:] != doc_in[:-1]
    first = np.maximum.accumulate(np.where(starts, index, 0))
    return inputs, labels, index - first


def _pair_fields(samples: list[Optional[Sample]], positions: np.ndarray) -> dict[str, object]:
    """A micro-batch's preference fields from its rows of pairs (none where the rows are not):
    each label's completion slot (the token it predicts is a target of; the shift on the whole
    row, before the split), numbered across the micro-batch's rows."""
    if not samples or samples[0] is None or samples[0].completions is None:
        return {}
    slots, pairs, offset = [], [], 0
    for s in samples:
        assert s is not None and s.completions is not None
        owner = s.completions[1:]
        slots.append(np.where(owner >= 0, owner + offset, -1))
        pairs.extend(s.pairs)
        offset += 2 * len(s.pairs)
    return {"completions": np.stack(slots)[:, positions], "pairs": tuple(pairs), "family": samples[0].family}


class ShardedData:
    """One rank's view of the data: its replica's samples, its CP positions of each."""

    def __init__(
        self,
        tokens: Union[np.ndarray, SampleSource],
        *,
        seq_len: int,
        seed: int,
        plan: BatchPlan,
        ring: int,
        ulysses: int,
        ring_idx: int,
        ulysses_idx: int,
        vocab_size: int,
        loss_norm: str = "token",
    ) -> None:
        self.vocab_size = vocab_size
        self.loss_norm = loss_norm
        self.source: Optional[SampleSource] = None
        if not isinstance(tokens, np.ndarray):
            # A sample source orders its own windows; the token-file fields below stay idle.
            self.source, tokens = tokens, np.zeros(seq_len + 1, dtype=np.int64)
        # Whether samples carry document ids (and so a number of labels the trainer must count).
        self.packed_documents = self.source is not None and self.source.packing == "doc"
        self.tokens = tokens
        self.rows = tokens.ndim == 2
        if self.rows and tokens.shape[1] != seq_len:
            raise DataError(f"data.seq_len is {seq_len}, but the rows of the data hold {tokens.shape[1]} tokens each")
        self.order = SampleOrder(tokens.size, seq_len, seed, num_rows=len(tokens) if self.rows else None)
        # Next-token predictions per sample: a row's last token predicts nothing. Under document
        # packing this is an upper bound: the trainer counts the labels of each step.
        self.labels_per_sample = seq_len - 1 if self.rows else seq_len
        self.plan = plan
        self.positions = np.asarray(sequence_positions(seq_len, ring, ulysses, ring_idx, ulysses_idx), dtype=np.int64)

    def sample_tokens(self, sample: int) -> np.ndarray:
        """A window's ``seq_len + 1`` tokens, or a row's ``seq_len``."""
        if self.rows:
            return np.asarray(self.tokens[self.order.window(sample)], dtype=np.int64)
        start = self.order.window(sample) * self.order.seq_len
        return np.asarray(self.tokens[start : start + self.order.seq_len + 1], dtype=np.int64)

    def _sample_parts(self, sample: int) -> tuple[np.ndarray, np.ndarray, Optional[np.ndarray], Optional[np.ndarray],
                                                  tuple[int, int], Optional[Sample]]:  # fmt: skip
        """(inputs, labels, position ids or None, doc ids or None, origin) of one sample, and the
        source's sample (None for a token file)."""
        if self.source is not None:
            return self._parts_of(self.source.sample(sample))
        tokens = self.sample_tokens(sample)
        if self.rows:
            return tokens, np.append(tokens[1:], IGNORE_INDEX), None, None, (0, -1), None
        return tokens[:-1], tokens[1:], None, None, (0, -1), None

    @staticmethod
    def _parts_of(s: Sample) -> tuple[np.ndarray, np.ndarray, Optional[np.ndarray], Optional[np.ndarray],
                                      tuple[int, int], Optional[Sample]]:  # fmt: skip
        """``_sample_parts`` of a source's sample."""
        if s.doc_ids is None:
            return s.tokens[:-1], s.tokens[1:], None, None, s.origin, s
        inputs, labels, positions = pack_documents(s.tokens, s.doc_ids)
        if s.targets is not None:
            labels[s.targets[1:] == 0] = IGNORE_INDEX  # the shift on the whole sample, before any split
        if s.positions is not None:
            positions = s.positions[:-1]  # a pair's completions continue its prompt's positions
        return inputs, labels, positions, s.doc_ids[:-1], s.origin, s

    def micro_batch(self, samples: list[int]) -> MicroBatch:
        return self._assemble(tuple(samples), [self._sample_parts(s) for s in samples])

    def preference_rows(self) -> int:
        """How many rows of pairs the (one) preference dataset packs into."""
        return self._pairs_source().pair_rows().num_rows

    def num_pairs(self) -> int:
        """The pairs of the (one) preference dataset, dropped ones included (table indices)."""
        return self._pairs_source().pair_rows().total

    def row_batch(self, row: int) -> MicroBatch:
        """A micro-batch of the preference dataset's row ``row`` alone, as training lays it out
        (for a pass over the whole dataset, whatever the sample order)."""
        return self._assemble((), [self._parts_of(self._pairs_source().pair_sample(row))])

    def _pairs_source(self) -> "PairSource":
        if self.source is None or not hasattr(self.source, "pair_rows"):
            raise DataError("the data holds no preference pairs")
        return self.source  # type: ignore[return-value]

    def _assemble(self, samples: tuple[int, ...], parts: list[tuple[np.ndarray, np.ndarray, Optional[np.ndarray],
                                                                     Optional[np.ndarray], tuple[int, int], Optional[Sample]]]
                  ) -> MicroBatch:  # fmt: skip
        inputs, labels = np.stack([p[0] for p in parts]), np.stack([p[1] for p in parts])
        # A token file is not scanned up front (it may be terabytes); each batch is checked instead.
        if inputs.max() >= self.vocab_size:
            raise DataError(f"token id {int(inputs.max())} in samples {samples} is >= model.vocab_size={self.vocab_size}")
        pos = self.positions
        doc_ids = position_ids = weights = None
        if parts[0][3] is not None:
            whole_docs = np.stack([p[3] for p in parts])
            doc_ids = whole_docs[:, pos]
            position_ids = np.stack([p[2] for p in parts])[:, pos]
            if self.loss_norm == "sequence":
                # Counted over the whole sample: a conversation's weight is the same on every CP rank.
                weights = np.stack([conversation_weights(l, d, IGNORE_INDEX) for l, d in zip(labels, whole_docs)])[:, pos]
        return MicroBatch(
            samples=samples,
            input_ids=inputs[:, pos],
            labels=labels[:, pos],
            position_ids=np.broadcast_to(pos, (len(samples), len(pos))).copy() if position_ids is None else position_ids,
            doc_ids=doc_ids,
            weights=weights,
            origins=tuple(p[4] for p in parts) if self.source is not None else (),
            **_pair_fields([p[5] for p in parts], pos),
        )

    def step_batches(self, step: int, replica: int) -> list[MicroBatch]:
        return [self.micro_batch(mb) for mb in self.plan.micro_batches(step, replica)]

    def close(self) -> None:
        if self.source is not None:
            self.source.close()


class BatchPrefetcher:
    """Builds the next step's micro-batches on a background thread while this step trains.

    Every build runs on the one worker thread (a miss too), so sample orders, whose shuffles
    are cached per epoch, are never used from two threads. The guess for the next batch is
    the one after, past skipped ones; a wrong guess (a rollback, a resize) is only wasted work.
    """

    def __init__(self, data: ShardedData) -> None:
        self.data = data
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ringtrain-data")
        self._next: Optional[tuple[tuple[int, int, int], Future[list[MicroBatch]]]] = None

    def get(self, batch: int, replica: int, skip: Collection[int] = ()) -> tuple[list[MicroBatch], float]:
        """The micro-batches of ``batch`` for ``replica`` and the seconds spent waiting for them."""
        start = time.perf_counter()
        key = (batch, replica, self.data.plan.dp)
        if self._next is not None and self._next[0] == key:
            future = self._next[1]
        else:
            future = self._pool.submit(self.data.step_batches, batch, replica)
        batches = future.result()
        waited = time.perf_counter() - start
        following = batch + 1
        while following in skip:
            following += 1
        nxt = (following, replica, self.data.plan.dp)
        self._next = (nxt, self._pool.submit(self.data.step_batches, following, replica))
        return batches, waited

    def close(self) -> None:
        """Stop building batches and release the data's readers (each resize builds new ones)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.data.close()
