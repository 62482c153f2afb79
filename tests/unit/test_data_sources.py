"""Prepared datasets as training data: the reader, mixing, long-document upsampling, document
packing, the S3 cache, and the checks ``ringtrain run`` makes before any cluster starts."""

from __future__ import annotations

import dataclasses
import hashlib
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from ringtrain import config
from ringtrain.errors import ConfigError, DataError
from ringtrain.train.corpus import PreparedCorpus
from ringtrain.train.data import IGNORE_INDEX, BatchPlan, BatchPrefetcher, SampleOrder, ShardedData, pack_documents
from ringtrain.train.mixture import MixedSamples, SourceSpec, check_sources, quotas
from ringtrain_dev.prepared_data import random_documents, write_prepared

VOCAB, EOS, SEQ = 300, 7, 16


def _dataset(root: Path, num_docs: int = 24, seed: int = 0, max_len: int = 30) -> Path:
    write_prepared(root, random_documents(num_docs, vocab_size=VOCAB, eos_id=EOS, min_len=3, max_len=max_len, seed=seed),
                   vocab_size=VOCAB, eos_id=EOS)
    return root


def _mixture(paths: list[Path], weights: list[float], packing: str = "concat", **spec: float) -> MixedSamples:
    specs = [SourceSpec(str(p), w, **spec) for p, w in zip(paths, weights)]  # type: ignore[arg-type]
    return MixedSamples([PreparedCorpus(str(p)) for p in paths], specs, seq_len=SEQ, seed=3, packing=packing)


def _job(*overrides: str) -> config.JobConfig:
    return config.load(None, ["model.vocab_size=512", f"data.seq_len={SEQ}", "mesh.cp=1", *overrides])


def test_the_reader_joins_shards_into_one_stream(tmp_path: Path) -> None:
    docs = random_documents(10, vocab_size=VOCAB, eos_id=EOS, min_len=3, max_len=9)
    write_prepared(tmp_path, docs, vocab_size=VOCAB, eos_id=EOS, docs_per_shard=3)
    corpus = PreparedCorpus(str(tmp_path))
    stream = np.concatenate(docs)
    assert corpus.num_tokens == len(stream) and len(corpus.shards) == 4
    assert np.array_equal(corpus.tokens(5, len(stream)), stream[5:])  # across every shard boundary
    starts = np.cumsum([0] + [len(d) for d in docs])
    assert np.array_equal(corpus.doc_starts_in(0, len(stream)), starts[1:-1])
    assert [corpus.document_at(int(s)) for s in starts[:-1]] == list(range(10))
    assert np.array_equal(corpus.document_lengths(), [len(d) for d in docs])


def test_a_lone_source_reads_the_windows_a_token_file_would(tmp_path: Path) -> None:
    stream = np.concatenate(random_documents(24, vocab_size=VOCAB, eos_id=EOS, min_len=3, max_len=30))
    _dataset(tmp_path)
    kw = dict(seq_len=SEQ, seed=3, plan=BatchPlan(4, 1, 2), ring=1, ulysses=1, ring_idx=0, ulysses_idx=0, vocab_size=VOCAB)
    prepared = ShardedData(_mixture([tmp_path], [1.0]), **kw)  # type: ignore[arg-type]
    plain = ShardedData(stream, **kw)  # type: ignore[arg-type]
    for step in range(3):
        for a, b in zip(prepared.step_batches(step, 0), plain.step_batches(step, 0)):
            assert np.array_equal(a.input_ids, b.input_ids) and np.array_equal(a.labels, b.labels)
            assert a.doc_ids is None and len(a.origins) == len(a.samples)


def test_mixing_keeps_the_weights_per_block_and_every_window_once_per_epoch(tmp_path: Path) -> None:
    a, b = _dataset(tmp_path / "a"), _dataset(tmp_path / "b", seed=1)
    mix = _mixture([a, b], [3.0, 1.0])
    located = [mix.locate(i) for i in range(2048)]
    assert Counter(j for j, _ in located) == {0: 1536, 1: 512}
    for j in (0, 1):
        windows = [w for s, w in located if s == j]
        size = mix.orders[j].epoch_size
        assert sorted(windows[:size]) == list(range(size))  # the first epoch of j: each window once
    # A function of the index alone: read out of order, or by another object, the same.
    again = _mixture([a, b], [3.0, 1.0])
    assert [again.locate(i) for i in (2047, 5, 1024, 0)] == [located[i] for i in (2047, 5, 1024, 0)]
    assert list(quotas([1.0, 1.0, 1.0], 10)) == [4, 3, 3]


def test_dp_changes_who_reads_not_what_is_read(tmp_path: Path) -> None:
    a, b = _dataset(tmp_path / "a"), _dataset(tmp_path / "b", seed=1)
    origins: dict[int, set[tuple[int, ...]]] = {}
    for dp in (1, 2, 4):
        data = [ShardedData(_mixture([a, b], [1.0, 2.0]), seq_len=SEQ, seed=3, plan=BatchPlan(8, dp, 1), ring=1,
                            ulysses=1, ring_idx=0, ulysses_idx=0, vocab_size=VOCAB) for _ in range(dp)]
        seen = {(s, o, tuple(mb.input_ids[0])) for r in range(dp) for mb in data[r].step_batches(2, r)
                for s, o in zip(mb.samples, mb.origins)}
        origins[dp] = seen  # type: ignore[assignment]
    assert origins[1] == origins[2] == origins[4] and len(origins[1]) == 8


def test_long_doc_upsample_favours_long_documents_within_the_source(tmp_path: Path) -> None:
    docs = [np.append(np.full(n - 1, 9), EOS) for n in [200] + [10] * 40]  # one long document, many short
    write_prepared(tmp_path, docs, vocab_size=VOCAB, eos_id=EOS, docs_per_shard=8)
    plain = _mixture([tmp_path], [1.0])
    boosted = _mixture([tmp_path], [1.0], long_doc_upsample=3.0, long_doc_tokens=100)
    long_windows = {w for w in range(plain.orders[0].epoch_size) if (w * SEQ + SEQ // 2) < 200}
    assert plain.orders[0].epoch_size == 37 and boosted.orders[0].epoch_size == 37 + 2 * len(long_windows)
    share = np.mean([boosted.locate(i)[1] in long_windows for i in range(boosted.orders[0].epoch_size)])
    assert share == pytest.approx(3 * len(long_windows) / boosted.orders[0].epoch_size)


def test_doc_packing_restarts_positions_and_drops_the_label_across_documents() -> None:
    tokens = np.array([11, 12, EOS, 21, 22, 23, EOS, 31, 32])
    doc_ids = np.array([0, 0, 0, 1, 1, 1, 1, 2, 2])
    inputs, labels, positions = pack_documents(tokens, doc_ids)
    assert inputs.tolist() == tokens[:-1].tolist()
    assert labels.tolist() == [12, EOS, IGNORE_INDEX, 22, 23, EOS, IGNORE_INDEX, 32]
    assert positions.tolist() == [0, 1, 2, 0, 1, 2, 3, 0]


def test_doc_packing_gives_each_cp_rank_its_positions_of_the_documents(tmp_path: Path) -> None:
    _dataset(tmp_path)
    full = ShardedData(_mixture([tmp_path], [1.0], "doc"), seq_len=SEQ, seed=3, plan=BatchPlan(2, 1, 2), ring=1,
                       ulysses=1, ring_idx=0, ulysses_idx=0, vocab_size=VOCAB)
    mb = full.step_batches(0, 0)[0]
    assert full.packed_documents and mb.doc_ids is not None
    starts = mb.input_ids == EOS
    assert (mb.labels[starts] == IGNORE_INDEX).all()  # every EOS inside a window ends a document
    ring = ShardedData(_mixture([tmp_path], [1.0], "doc"), seq_len=SEQ, seed=3, plan=BatchPlan(2, 1, 2), ring=2,
                       ulysses=1, ring_idx=1, ulysses_idx=0, vocab_size=VOCAB)
    part = ring.step_batches(0, 0)[0]
    assert np.array_equal(part.doc_ids, mb.doc_ids[:, ring.positions])
    assert np.array_equal(part.position_ids, mb.position_ids[:, ring.positions])


def test_the_prefetcher_hands_out_the_same_batches(tmp_path: Path) -> None:
    _dataset(tmp_path)
    data = ShardedData(_mixture([tmp_path], [1.0], "doc"), seq_len=SEQ, seed=3, plan=BatchPlan(2, 1, 1), ring=1,
                       ulysses=1, ring_idx=0, ulysses_idx=0, vocab_size=VOCAB)
    prefetcher = BatchPrefetcher(data)
    try:
        for batch in (0, 1, 3, 2):  # 3 and 2: guesses that miss
            got, waited = prefetcher.get(batch, 0, skip={2})
            want = data.step_batches(batch, 0)
            assert waited >= 0 and [g.samples for g in got] == [w.samples for w in want]
            assert all(np.array_equal(g.input_ids, w.input_ids) for g, w in zip(got, want))
    finally:
        prefetcher.close()


def test_a_corrupt_shard_is_named(tmp_path: Path) -> None:
    _dataset(tmp_path)
    path = tmp_path / "shards" / "00001.tokens.npy"
    blob = bytearray(path.read_bytes())
    blob[-1] ^= 1
    path.write_bytes(bytes(blob))
    corpus = PreparedCorpus(str(tmp_path))
    corpus.shard(0)
    with pytest.raises(DataError, match="shards/00001.tokens.npy: shard 1 fails its sha256"):
        corpus.shard(1)


def test_s3_shards_are_cached_verified_and_fetched_again_when_the_copy_is_bad(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    boto3 = pytest.importorskip("boto3")
    moto = pytest.importorskip("moto")
    for key, value in {"AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "x", "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    local = _dataset(tmp_path / "local")
    with moto.mock_aws():
        s3 = boto3.client("s3")
        s3.create_bucket(Bucket="data")
        for f in local.rglob("*"):
            if f.is_file():
                s3.put_object(Bucket="data", Key=f"ds/{f.relative_to(local)}", Body=f.read_bytes())
        cache = tmp_path / "cache"
        corpus = PreparedCorpus("s3://data/ds", cache_dir=str(cache))
        want = PreparedCorpus(str(local))
        assert not list(cache.rglob("*.npy"))  # opening fetches nothing
        assert np.array_equal(corpus.tokens(0, 10), want.tokens(0, 10))
        cached = next(cache.rglob("00000.tokens.npy"))
        cached.write_bytes(b"garbage")
        again = PreparedCorpus("s3://data/ds", cache_dir=str(cache))
        assert np.array_equal(again.tokens(0, 10), want.tokens(0, 10))
        assert hashlib.sha256(cached.read_bytes()).hexdigest() == corpus.shards[0].tokens_sha256


# --- checks at `ringtrain run` -------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (["data.sources=[{path: /a, weight: 0}]"], "data.sources[0].weight"),
        (["data.sources=[{path: /a}, {path: /b, weight: -1}]"], "data.sources[1].weight"),
        (["data.sources=[{path: ''}]"], "data.sources[0].path"),
        (["data.sources=[{path: /a, long_doc_upsample: 0}]"], "data.sources[0].long_doc_upsample"),
        (["data.packing=docs"], "data.packing"),
        (["data.sources=[{path: /a}]", "data.path=/b"], "data.sources"),
    ],
)
def test_bad_data_config_names_the_key(overrides: list[str], key: str) -> None:
    with pytest.raises(ConfigError) as err:
        config.validate(_job(*overrides))
    assert err.value.key == key


def test_run_checks_name_the_dataset_key(tmp_path: Path) -> None:
    good = _dataset(tmp_path / "good")
    check_sources(_job(f"data.path={good}", "data.packing=doc"))
    with pytest.raises(ConfigError, match="doc needs prepared datasets") as err:
        check_sources(_job("data.packing=doc"))
    assert err.value.key == "data.packing"
    with pytest.raises(ConfigError, match="vocabulary of 300 tokens") as err:
        check_sources(_job(f"data.path={good}", "model.vocab_size=256"))
    assert err.value.key == "data.path"
    (tmp_path / "half" / "shards").mkdir(parents=True)
    with pytest.raises(ConfigError, match="no manifest") as err:
        check_sources(_job(f"data.sources=[{{path: {good}}}, {{path: {tmp_path / 'half'}}}]"))
    assert err.value.key == "data.sources[1].path"
    bad = _dataset(tmp_path / "bad")
    (bad / "manifest.json").write_text('{"format": "ringtrain-dataset/1", "dtype": "uint16"}')
    with pytest.raises(ConfigError, match="num_documents is missing") as err:
        check_sources(_job(f"data.path={bad}"))
    assert err.value.key == "data.path"
    corrupt = _dataset(tmp_path / "corrupt")
    (corrupt / "shards" / "00000.docs.npy").write_bytes(b"x")
    with pytest.raises(ConfigError, match="00000.docs.npy: shard 0 fails its sha256"):
        check_sources(_job(f"data.path={corrupt}"))


def test_a_dataset_of_another_tokenizer_than_model_hf_is_refused(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "tokenizer.json").write_text('{"model": "other"}')
    job = _job(f"data.path={_dataset(tmp_path / 'd')}")
    job = dataclasses.replace(job, model=dataclasses.replace(job.model, hf=str(model)))
    with pytest.raises(ConfigError, match="not with the model's tokenizer") as err:
        check_sources(job)
    assert err.value.key == "data.path" and f"prepare it again with --tokenizer {model}" in err.value.reason


def test_a_model_hf_without_a_tokenizer_says_the_data_is_unchecked(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    data = _dataset(tmp_path / "d")
    job = _job(f"data.path={data}")
    (note,) = check_sources(dataclasses.replace(job, model=dataclasses.replace(job.model, hf=str(model))))
    assert note.startswith(f"model.hf: {model} has no tokenizer.json, so whether {data} (tokenized with 'test'")
    assert check_sources(job) == []  # a model trained from scratch takes the data's tokens
