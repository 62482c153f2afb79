"""PairSet: a preference dataset's pairs as ``ringtrain eval`` scores them, in rows laid out as
training lays them out.

The pairs are packed into rows of ``seq_len`` tokens (``pairs.pack_pairs``: whole pairs, each
prompt laid out once or twice as ``data.prefix_sharing`` says, an overlong pair dropped or its
prompt cut as ``data.chat_overlong`` says), then each row padded to a length the mesh's chunks
divide (padding is a document of its own that predicts nothing), so which pairs are scored, and
how much of each, depends on ``seq_len`` alone, never on the mesh. Read once on the driver and
sent to the workers, whose ``ShardedData`` reads it as it reads a preference dataset (it is a
``PairSource``). A warm-up's step trains on a PairSet too: one made-up pair
(``rehearsal_pairs``). Pure numpy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from ringtrain.errors import ConfigError, DataError
from ringtrain.topology import round_up
from ringtrain.train.corpus import PreparedCorpus
from ringtrain.train.data import Sample
from ringtrain.train.mixture import MixedSamples, SourceSpec, pair_sample
from ringtrain.train.pairs import STORED_DOCUMENTS, PairRows, pack_pairs, pair_row


@dataclass(frozen=True)
class PairSet:
    rows: tuple[Sample, ...]  # each of seq_len + 1 tokens
    layout: PairRows  # which pairs each of ``rows`` holds; the dataset's counts of pairs, dropped, cut
    seq_len: int
    packing: str = "doc"  # a SampleSource's: rows carry their documents

    @property
    def num_rows(self) -> int:
        return len(self.rows)

    @property
    def num_scored(self) -> int:
        """The pairs the rows hold."""
        return sum(len(row.pairs) for row in self.rows)

    def pair_rows(self) -> PairRows:
        return self.layout

    def pair_sample(self, row: int) -> Sample:
        return self.rows[row]

    def sample(self, sample: int) -> Sample:
        return self.rows[sample % self.num_rows]

    def close(self) -> None:
        """Nothing is held open: the rows are in memory."""


def load_pair_set(path: str, *, seq_len: int, multiple: int, vocab_size: int, prefix_sharing: bool, overlong: str,
                  packing: str, max_rows: Optional[int] = None, key: str = "eval.data",
                  length_key: str = "data.seq_len") -> PairSet:  # fmt: skip
    """The pairs of preference dataset ``path`` in rows of ``seq_len`` tokens, padded to a
    multiple of ``multiple``; all rows, or the first ``max_rows``. Errors name ``key``, and a
    length no pair fits ``length_key``: the config key or option ``seq_len`` came from."""
    try:
        corpus = PreparedCorpus(path)
    except (DataError, ValueError, OSError) as exc:
        raise ConfigError(key, str(exc)) from None
    try:
        samples = MixedSamples([corpus], [SourceSpec(path)], seq_len=seq_len, seed=0, packing="doc",
                               chat_overlong=overlong, chat_packing=packing, prefix_sharing=prefix_sharing,
                               length_key=length_key)  # fmt: skip
        packed = samples.pair_rows()
        # The rows scored, and the layout of those alone: a pass over the rows reads it.
        layout = packed.head(min(packed.num_rows, max_rows or packed.num_rows))
        length = round_up(seq_len, multiple)
        rows = tuple(_padded(samples.pair_sample(r), length + 1, corpus.eos_id) for r in range(layout.num_rows))
    except DataError as exc:
        raise ConfigError(key, str(exc)) from None
    finally:
        corpus.close()
    top = max(int(row.tokens.max()) for row in rows)
    if top >= vocab_size:
        raise ConfigError(key, f"{path} holds token id {top}, outside the model's vocabulary [0, {vocab_size})")
    return PairSet(rows, layout, length)


def rehearsal_pairs(seq_len: int, vocab_size: int, *, prefix_sharing: bool) -> PairSet:
    """One made-up pair in a row of ``seq_len`` tokens (at least 4): what a warm-up trains a
    preference step on, so it reads no dataset and needs no pair of the job's to fit its row."""
    part = max(1, seq_len // 8)  # tokens of the prompt, and of each completion
    ids = np.arange(3 * part, dtype=np.int64) % vocab_size
    prompt, chosen, rejected = ids[:part], ids[part : 2 * part], ids[2 * part :]
    trained = np.ones(part, dtype=np.uint8)
    laid = pair_row([(prompt, chosen, trained, rejected, trained)], seq_len, 0, prefix_sharing)
    layout = pack_pairs(np.full(STORED_DOCUMENTS, part), seq_len, 0, shared=prefix_sharing, overlong="drop")
    return PairSet((pair_sample(laid, (0, 0), (0,), prefix_sharing),), layout, seq_len)


def _padded(row: Sample, length: int, pad_id: int) -> Sample:
    """``row`` padded to ``length`` tokens with a document that predicts nothing."""
    pad = length - len(row.tokens)
    if pad == 0:
        return row

    def grow(values: Optional[np.ndarray], fill: int) -> Optional[np.ndarray]:
        return None if values is None else np.concatenate([values, np.full(pad, fill, dtype=values.dtype)])

    return Sample(tokens=grow(row.tokens, pad_id), doc_ids=grow(row.doc_ids, -1), origin=row.origin,
                  targets=grow(row.targets, 0), positions=grow(row.positions, 0), completions=grow(row.completions, -1),
                  pairs=row.pairs, family=row.family)  # fmt: skip
