"""Training data: token sources, the global sample order, and each rank's shard of a step.

What is read is a function of the seed and the global sample index only; who reads it is a
function of the mesh. Step ``s`` trains on global samples ``[s * global_batch, (s + 1) *
global_batch)``; replica ``d`` of ``dp`` takes a contiguous ``global_batch / dp`` of them and
splits those into micro-batches; inside the replica, each CP rank takes its token positions
(``topology.sequence_positions``) of every sample. So a dp change moves samples between
replicas but never changes the set a step trains on.

Two shapes of source: a 1-D token stream cut into windows of ``seq_len + 1`` tokens (the input
and its next-token labels), or a 2-D ``.npy`` array whose rows are the samples, each of
``seq_len`` tokens, trained on as transformers does with ``labels=input_ids``: the last token
of a row has no label (``IGNORE_INDEX``).

Pure numpy: tensors are made by the caller, on its device.
"""

from __future__ import annotations

import os
import sysconfig
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Optional

import numpy as np

from ringtrain.config import STDLIB_CORPUS
from ringtrain.errors import ConfigError, DataError
from ringtrain.topology import sequence_positions

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


class SampleOrder:
    """Global sample index -> window of ``seq_len + 1`` tokens, reshuffled every epoch."""

    def __init__(self, num_tokens: int, seq_len: int, seed: int, *, num_rows: Optional[int] = None) -> None:
        """Windows of a ``num_tokens`` stream, or ``num_rows`` row samples when given."""
        self.seq_len = seq_len
        self.seed = seed
        self.num_windows = num_rows if num_rows is not None else (num_tokens - 1) // seq_len
        if self.num_windows < 1:
            raise DataError(f"the corpus has {num_tokens} tokens, fewer than data.seq_len + 1 = {seq_len + 1}")
        self._perm_epoch = -1
        self._perm = np.empty(0, dtype=np.int64)

    def window(self, sample: int) -> int:
        epoch, pos = divmod(sample, self.num_windows)
        if epoch != self._perm_epoch:
            rng = np.random.Generator(np.random.PCG64([self.seed, epoch]))
            self._perm = rng.permutation(self.num_windows)
            self._perm_epoch = epoch
        return int(self._perm[pos])

    def epoch_of(self, sample: int) -> int:
        return sample // self.num_windows


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


class ShardedData:
    """One rank's view of the data: its replica's samples, its CP positions of each."""

    def __init__(
        self,
        tokens: np.ndarray,
        *,
        seq_len: int,
        seed: int,
        plan: BatchPlan,
        ring: int,
        ulysses: int,
        ring_idx: int,
        ulysses_idx: int,
        vocab_size: int,
    ) -> None:
        self.tokens = tokens
        self.vocab_size = vocab_size
        self.rows = tokens.ndim == 2
        if self.rows and tokens.shape[1] != seq_len:
            raise DataError(f"data.seq_len is {seq_len}, but the rows of the data hold {tokens.shape[1]} tokens each")
        self.order = SampleOrder(tokens.size, seq_len, seed, num_rows=len(tokens) if self.rows else None)
        # Next-token predictions per sample: a row's last token predicts nothing.
        self.labels_per_sample = seq_len - 1 if self.rows else seq_len
        self.plan = plan
        self.positions = np.asarray(sequence_positions(seq_len, ring, ulysses, ring_idx, ulysses_idx), dtype=np.int64)

    def sample_tokens(self, sample: int) -> np.ndarray:
        """A window's ``seq_len + 1`` tokens, or a row's ``seq_len``."""
        if self.rows:
            return np.asarray(self.tokens[self.order.window(sample)], dtype=np.int64)
        start = self.order.window(sample) * self.order.seq_len
        return np.asarray(self.tokens[start : start + self.order.seq_len + 1], dtype=np.int64)

    def _inputs_labels(self, sample: int) -> tuple[np.ndarray, np.ndarray]:
        tokens = self.sample_tokens(sample)
        if self.rows:
            return tokens, np.append(tokens[1:], IGNORE_INDEX)
        return tokens[:-1], tokens[1:]

    def micro_batch(self, samples: list[int]) -> MicroBatch:
        inputs, labels = (np.stack(a) for a in zip(*(self._inputs_labels(s) for s in samples)))
        # A token file is not scanned up front (it may be terabytes); each batch is checked instead.
        if inputs.max() >= self.vocab_size:
            raise DataError(f"token id {int(inputs.max())} in samples {samples} is >= model.vocab_size={self.vocab_size}")
        pos = self.positions
        return MicroBatch(
            samples=tuple(samples),
            input_ids=inputs[:, pos],
            labels=labels[:, pos],
            position_ids=np.broadcast_to(pos, (len(samples), len(pos))).copy(),
        )

    def step_batches(self, step: int, replica: int) -> list[MicroBatch]:
        return [self.micro_batch(mb) for mb in self.plan.micro_batches(step, replica)]
