"""Training data: token sources, the global sample order, and each rank's shard of a step.

What is read is a function of the seed and the global sample index only; who reads it is a
function of the mesh. Step ``s`` trains on global samples ``[s * global_batch, (s + 1) *
global_batch)``; replica ``d`` of ``dp`` takes a contiguous ``global_batch / dp`` of them and
splits those into micro-batches; inside the replica, each CP rank takes its token positions
(``topology.sequence_positions``) of every sample. So a dp change moves samples between
replicas but never changes the set a step trains on.

Pure numpy: tensors are made by the caller, on its device.
"""

from __future__ import annotations

import os
import sysconfig
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

from ringtrain.config import STDLIB_CORPUS
from ringtrain.errors import ConfigError, DataError
from ringtrain.topology import sequence_positions

_SKIPPED_STDLIB_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


def stdlib_source_files() -> list[Path]:
    """The standard library's own ``.py`` files, sorted: real text present on every machine."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIPPED_STDLIB_DIRS)
        files.extend(Path(dirpath) / f for f in sorted(filenames) if f.endswith(".py"))
    return files


def check_data(path: str, vocab_size: int) -> None:
    """Raise a ConfigError naming the key when the data cannot feed the model."""
    check_data_path(path)
    if is_byte_corpus(path) and vocab_size < 256:
        raise ConfigError("model.vocab_size", f"{vocab_size} is too small for a byte-level corpus (needs 256)")


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
    """A 1-D token array: bytes of text files, or a memory-mapped ``.bin`` of ``token_dtype``."""
    check_data_path(path)
    if path == STDLIB_CORPUS:
        return _read_bytes(_fingerprint(stdlib_source_files()))
    p = Path(path)
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
    return not (path != STDLIB_CORPUS and Path(path).suffix == ".bin")


class SampleOrder:
    """Global sample index -> window of ``seq_len + 1`` tokens, reshuffled every epoch."""

    def __init__(self, num_tokens: int, seq_len: int, seed: int) -> None:
        self.seq_len = seq_len
        self.seed = seed
        self.num_windows = (num_tokens - 1) // seq_len
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
        self.order = SampleOrder(len(tokens), seq_len, seed)
        self.plan = plan
        self.positions = np.asarray(sequence_positions(seq_len, ring, ulysses, ring_idx, ulysses_idx), dtype=np.int64)

    def sample_tokens(self, sample: int) -> np.ndarray:
        start = self.order.window(sample) * self.order.seq_len
        return np.asarray(self.tokens[start : start + self.order.seq_len + 1], dtype=np.int64)

    def micro_batch(self, samples: list[int]) -> MicroBatch:
        windows = np.stack([self.sample_tokens(s) for s in samples])
        # A token file is not scanned up front (it may be terabytes); each batch is checked instead.
        if windows.max() >= self.vocab_size:
            raise DataError(f"token id {int(windows.max())} in samples {samples} is >= model.vocab_size={self.vocab_size}")
        pos = self.positions
        return MicroBatch(
            samples=tuple(samples),
            input_ids=windows[:, pos],
            labels=windows[:, pos + 1],
            position_ids=np.broadcast_to(pos, (len(samples), len(pos))).copy(),
        )

    def step_batches(self, step: int, replica: int) -> list[MicroBatch]:
        return [self.micro_batch(mb) for mb in self.plan.micro_batches(step, replica)]
