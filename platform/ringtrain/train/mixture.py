"""Samples drawn from prepared datasets: which source and window each global sample reads.

Everything here is a function of the seed and the global sample index, never of the mesh, so
the exactly-once ledger, exact resume and elastic resizing work as they do for a token file.

- **Mixing.** Samples are dealt in blocks of ``BLOCK``: each block holds a fixed quota of every
  source (its weight's share, by largest remainder), in an order shuffled per block. The
  ``k``-th sample drawn from source j is then ``block * quota_j + (j's earlier slots in the
  block)``: computed from the index alone in O(BLOCK), with proportions exact per block.
- **Windows.** A source is one token stream (its documents joined, each ending with EOS) cut
  into windows of ``seq_len + 1`` tokens, reshuffled every epoch, as for a token file; a lone
  unweighted source reads exactly the windows a token file of the same stream would.
- **Long documents.** Fu et al. 2024 ("Data Engineering for Scaling Language Models to 128K
  Context", per-source length upsampling) raise the share of long documents *within* each
  source so that the domain mix is unchanged. Here a window whose middle token lies in a
  document of at least ``long_doc_tokens`` is drawn ``long_doc_upsample`` times per epoch (the
  fractional part by a fixed seeded draw); the source's share of samples stays its weight.
- **Conversations.** A chat dataset's samples are rows of whole conversations
  (``conversations.py``), drawn in a per-epoch shuffled order as windows are; each carries its
  loss mask (``Sample.targets``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional, Union

import numpy as np

from ringtrain.checkpoint.s3_access import check_reachable
from ringtrain.config import PREFERENCE_OBJECTIVES, JobConfig
from ringtrain.errors import ConfigError, DataError
from ringtrain.train.conversations import ConversationRows, pack_conversations, row_sample
from ringtrain.train.corpus import PreparedCorpus, is_prepared_path
from ringtrain.train.dataset_tokenizer import check_same, folder_tokenizer, unchecked_note
from ringtrain.train.data import Sample, WindowOrder, check_data, load_tokens
from ringtrain.train.pairs import PAIR_FAMILY, STORED_DOCUMENTS, PairRow, PairRows, pack_pairs, pair_row
from ringtrain.uris import is_s3

BLOCK = 1024
# Stream keys of the generators below, so no two draws share a random stream.
_MIX_KEY = 0x6D6978
_UPSAMPLE_KEY = 0x7570


def quotas(weights: Sequence[float], block: int = BLOCK) -> np.ndarray:
    """Slots per block for each source: ``block * w / sum(w)`` rounded by largest remainder."""
    w = np.asarray(weights, dtype=np.float64)
    exact = block * w / w.sum()
    out = np.floor(exact).astype(np.int64)
    # Ties go to the earlier source (stable sort), so the quotas are a function of the weights.
    order = np.argsort(-(exact - out), kind="stable")
    out[order[: block - int(out.sum())]] += 1
    return out


class SourceSchedule:
    """Global sample index -> (source, how many samples that source gave before it)."""

    def __init__(self, weights: Sequence[float], seed: int, block: int = BLOCK) -> None:
        self.seed = seed
        self.block = block
        self.quota = quotas(weights, block)
        self._layout_base = np.repeat(np.arange(len(self.quota)), self.quota)
        self._block = -1
        self._layout = self._rank = np.empty(0, dtype=np.int64)

    def locate(self, sample: int) -> tuple[int, int]:
        block, slot = divmod(sample, self.block)
        if block != self._block:
            rng = np.random.Generator(np.random.PCG64([self.seed, _MIX_KEY, block]))
            self._layout = rng.permutation(self._layout_base)
            # Each slot's rank among its source's slots of the block.
            self._rank = np.empty(self.block, dtype=np.int64)
            for j in range(len(self.quota)):
                where = np.flatnonzero(self._layout == j)
                self._rank[where] = np.arange(len(where))
            self._block = block
        j = int(self._layout[slot])
        return j, block * int(self.quota[j]) + int(self._rank[slot])


def long_window_counts(corpus: PreparedCorpus, seq_len: int, num_windows: int, *, upsample: float,
                       long_tokens: int, key: Sequence[int]) -> np.ndarray:
    """Draws per epoch of each window: ``upsample`` (in expectation) for long ones, else 1."""
    lengths = corpus.document_lengths()
    starts = np.concatenate(([0], np.cumsum(lengths)))
    middles = np.arange(num_windows, dtype=np.int64) * seq_len + seq_len // 2
    long = lengths[np.searchsorted(starts, middles, side="right") - 1] >= long_tokens
    whole, frac = divmod(upsample, 1.0)
    extra = np.random.Generator(np.random.PCG64([*key, _UPSAMPLE_KEY])).random(num_windows) < frac
    return np.where(long, int(whole) + extra, 1).astype(np.int64)


@dataclass(frozen=True)
class SourceSpec:
    path: str
    weight: float = 1.0
    long_doc_upsample: float = 1.0
    long_doc_tokens: int = 4096


def is_packed(corpus: PreparedCorpus) -> bool:
    """Whether ``corpus`` trains in rows of whole conversations or pairs (else in windows)."""
    return corpus.is_chat or corpus.is_preference


# The rows last packed, by dataset (its manifest's digest) and packing settings: a driver checks
# the data, says how it packs and sizes the reference pass from one packing (a million
# conversations take about a second, and their offsets are read from every shard).
_PACKED: dict[tuple[object, ...], Union[ConversationRows, PairRows]] = {}
_PACKED_KEPT = 2


def pack_rows(corpus: PreparedCorpus, seq_len: int, seed: int, *, overlong: str, packing: str,
              prefix_sharing: bool, length_key: str = "data.seq_len") -> Union[ConversationRows, PairRows]:  # fmt: skip
    """A chat dataset's rows of whole conversations, or a preference dataset's of whole pairs;
    a DataError where none fits ``seq_len`` (pairs' naming ``length_key``, where the length came
    from). Packed once per process for a dataset and settings."""
    key = (corpus.manifest.digest(), seq_len, seed, overlong, packing, prefix_sharing)
    if key not in _PACKED:
        lengths = corpus.document_lengths()
        if corpus.is_preference:
            rows = pack_pairs(lengths, seq_len, seed, shared=prefix_sharing, overlong=overlong, packing=packing,
                              length_key=length_key)  # fmt: skip
        else:
            rows = pack_conversations(lengths, seq_len, seed, overlong, packing)
        while len(_PACKED) >= _PACKED_KEPT:
            del _PACKED[next(iter(_PACKED))]  # the oldest
        _PACKED[key] = rows
    return _PACKED[key]


def job_rows(corpus: PreparedCorpus, job: JobConfig) -> Union[ConversationRows, PairRows]:
    """``pack_rows`` of ``corpus`` as ``job`` trains on it."""
    d = job.data
    return pack_rows(corpus, d.seq_len, job.train.seed, overlong=d.chat_overlong, packing=d.chat_packing,
                     prefix_sharing=d.prefix_sharing)  # fmt: skip


class MixedSamples:
    """Samples of ``seq_len + 1`` tokens from weighted prepared datasets (see the module doc)."""

    def __init__(self, corpora: Sequence[PreparedCorpus], specs: Sequence[SourceSpec], *, seq_len: int, seed: int,
                 packing: str, chat_overlong: str = "drop", chat_packing: str = "next_fit",
                 prefix_sharing: bool = True, length_key: str = "data.seq_len") -> None:  # fmt: skip
        """``length_key``: the config key or option ``seq_len`` came from, which a token-stream or
        preference source too short for it names."""
        self.corpora = list(corpora)
        self.seq_len = seq_len
        self.packing = packing
        self.prefix_sharing = prefix_sharing
        self.schedule = SourceSchedule([s.weight for s in specs], seed) if len(specs) > 1 else None
        self.orders = []
        # Per source: its rows of whole conversations (a chat dataset) or pairs (a preference
        # dataset), else None (windows).
        self.rows: list[Optional[Union[ConversationRows, PairRows]]] = []
        for j, (corpus, spec) in enumerate(zip(self.corpora, specs)):
            key = [seed] if len(specs) == 1 else [seed, j + 1]
            if is_packed(corpus):
                if packing != "doc":
                    raise DataError(f"{corpus.uri} is a {corpus.manifest.content} dataset: it trains with data.packing: doc")
                rows = pack_rows(corpus, seq_len, seed, overlong=chat_overlong, packing=chat_packing,
                                 prefix_sharing=prefix_sharing, length_key=length_key)  # fmt: skip
                self.rows.append(rows)
                self.orders.append(WindowOrder(rows.num_rows, key))
                continue
            self.rows.append(None)
            num_windows = (corpus.num_tokens - 1) // seq_len
            if num_windows < 1:
                raise DataError(f"{corpus.uri} has {corpus.num_tokens} tokens, fewer than {length_key} + 1 = {seq_len + 1}")
            # A lone source keys its shuffles as a token file does, so it reads the same windows.
            counts = None
            if spec.long_doc_upsample != 1.0:
                counts = long_window_counts(corpus, seq_len, num_windows, upsample=spec.long_doc_upsample,
                                            long_tokens=spec.long_doc_tokens, key=key)
            self.orders.append(WindowOrder(num_windows, key, counts))

    def locate(self, sample: int) -> tuple[int, int]:
        """(source, window) of global sample ``sample``."""
        j, k = self.schedule.locate(sample) if self.schedule is not None else (0, sample)
        return j, self.orders[j].window(k)

    def sample(self, sample: int) -> Sample:
        j, window = self.locate(sample)
        corpus = self.corpora[j]
        rows = self.rows[j]
        if isinstance(rows, PairRows):
            return self._pair_row(j, rows, window)
        if rows is not None:
            return self._row(j, rows, window)
        start, stop = window * self.seq_len, window * self.seq_len + self.seq_len + 1
        doc_ids = None
        if self.packing == "doc":
            doc_ids = np.zeros(stop - start, dtype=np.int64)
            doc_ids[corpus.doc_starts_in(start, stop) - start] = 1
            doc_ids = np.cumsum(doc_ids)  # 0 for the first (partial) document, then 1, 2, ...
        return Sample(tokens=corpus.tokens(start, stop), doc_ids=doc_ids, origin=(j, corpus.document_at(start)))

    def _row(self, j: int, rows: ConversationRows, row: int) -> Sample:
        """Row ``row`` of chat source ``j``: its whole conversations, their masks, padding."""
        corpus = self.corpora[j]
        conversations, taken = rows.row(row)
        firsts = [corpus.document_span(int(c))[0] + int(skip) for c, skip in zip(conversations, rows.row_skips(row))]
        tokens = [corpus.tokens(first, first + int(n)) for first, n in zip(firsts, taken)]
        masks = [corpus.mask(first, first + int(n)) for first, n in zip(firsts, taken)]
        out, doc_ids, mask = row_sample(tokens, masks, self.seq_len, corpus.eos_id)
        return Sample(tokens=out, doc_ids=doc_ids, origin=(j, int(conversations[0])), targets=mask)

    def pair_rows(self) -> PairRows:
        """The rows of the preference dataset (a preference objective trains on one alone)."""
        rows = self.rows[0]
        if len(self.rows) != 1 or not isinstance(rows, PairRows):
            raise DataError("a preference objective trains on one preference dataset")
        return rows

    def pair_sample(self, row: int) -> Sample:
        """Row ``row`` of the preference dataset, whatever the sample order."""
        return self._pair_row(0, self.pair_rows(), row)

    def _pair_row(self, j: int, rows: PairRows, row: int) -> Sample:
        """Row ``row`` of preference source ``j``: its whole pairs, laid out (``pairs.pair_row``)."""
        corpus = self.corpora[j]
        pairs, cuts = rows.row(row)
        parts = []
        for pair, cut in zip(pairs.tolist(), cuts.tolist()):
            spans = [corpus.document_span(STORED_DOCUMENTS * pair + d) for d in range(STORED_DOCUMENTS)]
            (p0, p1), (c0, c1), (r0, r1) = spans
            parts.append((corpus.tokens(p0 + cut, p1), corpus.tokens(c0, c1), corpus.mask(c0, c1),
                          corpus.tokens(r0, r1), corpus.mask(r0, r1)))  # fmt: skip
        laid = pair_row(parts, self.seq_len, corpus.eos_id, self.prefix_sharing)
        return pair_sample(laid, (j, STORED_DOCUMENTS * int(pairs[0])), tuple(pairs.tolist()), self.prefix_sharing)

    def close(self) -> None:
        for corpus in self.corpora:
            corpus.close()


def pair_sample(laid: PairRow, origin: tuple[int, int], pairs: tuple[int, ...], shared: bool) -> Sample:
    """A row of ``pairs`` (dataset indices, slot order) laid out, as a SampleSource's sample whose
    first token comes from ``origin``."""
    return Sample(tokens=laid.tokens, doc_ids=laid.doc_ids, origin=origin, targets=laid.targets,
                  positions=laid.positions, completions=laid.completions, pairs=pairs,
                  family=PAIR_FAMILY if shared else 0)  # fmt: skip


def check_objective(job: JobConfig, path: str, content: str, key: str = "data.path") -> None:
    """A preference objective trains on a preference dataset, and a preference dataset on one."""
    objective = job.train.objective
    if objective != "lm" and content != "preference":
        raise ConfigError("train.objective", f"{objective} trains on preference pairs, and {path} holds {content} "
                          "(make one with `ringtrain prepare --format preference`)")
    if objective == "lm" and content == "preference":
        raise ConfigError("train.objective", f"lm, but {path} is a preference dataset: set train.objective to one of "
                          f"{', '.join(PREFERENCE_OBJECTIVES)}")


def source_specs(job: JobConfig) -> list[SourceSpec]:
    """``data.sources``, or ``data.path`` as a lone source."""
    d = job.data
    if not d.sources:
        return [SourceSpec(d.path)]
    return [SourceSpec(s.path, s.weight, s.long_doc_upsample, s.long_doc_tokens) for s in d.sources]


def open_mixture(job: JobConfig) -> MixedSamples:
    specs = source_specs(job)
    corpora = [PreparedCorpus(s.path, cache_dir=job.data.cache_dir) for s in specs]
    return MixedSamples(corpora, specs, seq_len=job.data.seq_len, seed=job.train.seed, packing=job.data.packing,
                        chat_overlong=job.data.chat_overlong, chat_packing=job.data.chat_packing,
                        prefix_sharing=job.data.prefix_sharing)


def chat_packing_counts(job: JobConfig) -> Optional[dict[str, int]]:
    """How the job's chat datasets pack into rows (``ConversationRows.counts``, added up over the
    sources), or its preference dataset (``PairRows.counts``), for the console and the run's
    summary; None when it trains on neither. The packing is a function of the data and the
    seed, so the driver computes the workers' own."""
    if not uses_prepared_data(job):
        return None
    try:
        corpora = [PreparedCorpus(s.path, cache_dir=job.data.cache_dir) for s in source_specs(job)]
    except (DataError, ValueError, OSError):
        return None  # a summary is written whatever failed; the data's error is reported elsewhere
    try:
        if not any(is_packed(c) for c in corpora):
            return None
        out: dict[str, int] = {}
        for corpus in corpora:
            if is_packed(corpus):
                for key, value in job_rows(corpus, job).counts().items():
                    out[key] = out.get(key, 0) + value
        return out
    except (DataError, OSError):
        return None  # as above: check_sources refused data that fits no row before any cluster
    finally:
        for corpus in corpora:
            corpus.close()


def _check_rows(corpus: PreparedCorpus, job: JobConfig, path: str) -> None:
    """Raise a ConfigError naming ``data.seq_len`` when no conversation or pair of ``corpus``
    fits a row, as a worker's packing would find once the cluster had started."""
    try:
        job_rows(corpus, job)
    except DataError as exc:
        raise ConfigError("data.seq_len", f"{path}: {exc}") from None


def uses_prepared_data(job: JobConfig) -> bool:
    return bool(job.data.sources) or is_prepared_path(job.data.path)


def open_samples(job: JobConfig) -> Union[np.ndarray, MixedSamples]:
    """What the trainer reads: the mixture of prepared datasets, or data.path's tokens."""
    if uses_prepared_data(job):
        return open_mixture(job)
    return load_tokens(job.data.path, job.data.token_dtype)


def _source_keys(job: JobConfig) -> list[str]:
    return [f"data.sources[{i}].path" for i in range(len(job.data.sources))] if job.data.sources else ["data.path"]


def check_sources(job: JobConfig) -> list[str]:
    """Raise a ConfigError naming the key when the data cannot feed this model. Prepared datasets:
    a missing or malformed manifest, a tokenizer other than ``model.hf``'s (or a vocabulary
    larger than ``model.vocab_size``), datasets of different tokenizers, too few tokens, or a
    first shard that fails its checksum. Later shards are checked when first read. Returns the
    warnings for the user: a ``model.hf`` folder without a tokenizer to check the data against."""
    notes: list[str] = []
    if not uses_prepared_data(job):
        check_data(job.data.path, job.model_int("vocab_size"), job.data.seq_len)
        if job.data.packing == "doc":
            raise ConfigError("data.packing", f"doc needs prepared datasets, which record document boundaries; "
                              f"{job.data.path!r} is not one (make one with `ringtrain prepare`)")
        if job.train.loss_norm == "sequence":
            raise ConfigError("train.loss_norm", "sequence averages over conversations: it needs a chat dataset")
        check_objective(job, job.data.path, "text")
        return notes
    model_tok = folder_tokenizer(job.model.hf)
    vocab = job.model_int("vocab_size")
    first: Optional[tuple[str, str]] = None
    chat: set[bool] = set()
    kinds: set[str] = set()
    for key, spec in zip(_source_keys(job), source_specs(job)):
        check_reachable(spec.path, key)
        try:
            corpus = PreparedCorpus(spec.path, cache_dir=job.data.cache_dir)
        except (DataError, ValueError, OSError) as exc:  # a bad manifest, URI or store: the key says which
            raise ConfigError(key, str(exc)) from None
        tok = corpus.manifest.tokenizer
        try:
            if model_tok is not None:
                check_same(spec.path, tok, model_tok, key, job.model.hf)
            elif job.model.hf and not notes:
                notes.append(unchecked_note(job.model.hf, spec.path, tok, "model.hf"))
            if tok.vocab_size > vocab:
                raise ConfigError(key, f"{spec.path} has a vocabulary of {tok.vocab_size} tokens ({tok.name!r}), "
                                  f"more than model.vocab_size={vocab}")
            if first is not None and tok.sha256 != first[1]:
                raise ConfigError(key, f"{spec.path} was tokenized with {tok.name!r}, {first[0]} with another "
                                  "tokenizer; mixed datasets must share one")
            first = first or (spec.path, tok.sha256)
            content = corpus.manifest.content
            if content != "text" and job.data.packing != "doc":
                whole = "pairs" if corpus.is_preference else "conversations"
                raise ConfigError("data.packing", f"{job.data.packing}, but {spec.path} is a {content} dataset: whole "
                                  f"{whole} train with data.packing: doc")
            check_objective(job, spec.path, content, key)
            chat.add(corpus.is_chat)
            kinds.add(content)
            if corpus.num_tokens < job.data.seq_len + 1:
                raise ConfigError("data.seq_len", f"{job.data.seq_len}, but {spec.path} holds only {corpus.num_tokens} tokens")
            if is_packed(corpus):
                _check_rows(corpus, job, spec.path)
            if not is_s3(spec.path):
                corpus.shard(0)
        except DataError as exc:
            raise ConfigError(key, str(exc)) from None
        finally:
            corpus.close()
    if len(kinds) > 1:
        raise ConfigError("data.sources", f"mixes {' and '.join(sorted(kinds))} datasets; train on one kind at a time")
    if "preference" in kinds and len(source_specs(job)) > 1:
        raise ConfigError("data.sources", "a preference objective trains on one preference dataset: name it as data.path")
    if job.train.loss_norm == "sequence" and chat != {True}:
        raise ConfigError("train.loss_norm", "sequence averages over conversations: it needs a chat dataset")
    return notes
