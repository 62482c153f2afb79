"""The pieces of `ringtrain prepare` without Ray: the format, sources, tokenizer, packing and staging."""

from __future__ import annotations

import gzip
import io
import json
from pathlib import Path

import numpy as np
import pytest

from ringtrain.commands.prepare import recorded_command
from ringtrain.errors import ConfigError, DataError
from ringtrain.prepare import sources, streams, tokenize, writer
from ringtrain.prepare.pipeline import Job, PieceTokenizer
from ringtrain.prepared import (
    Manifest,
    ShardInfo,
    SourceInfo,
    TokenizerInfo,
    is_prepared,
    shard_paths,
    token_dtype_for,
)
from ringtrain_dev.corpus import write_jsonl, write_parquet


def _manifest(**changes: object) -> dict[str, object]:
    m = Manifest("uint16", 3, 12, TokenizerInfo("bytes", "bytes", 256, 0), [SourceInfo("a.jsonl", 3, 12)],
                 [ShardInfo(*shard_paths(0), 3, 12, "t" * 64, "d" * 64)], [], 0, ["ringtrain", "prepare"])
    return m.to_json() | changes


def test_manifest_round_trips_and_checks_its_totals() -> None:
    text = json.dumps(_manifest())
    assert Manifest.loads(text).to_json() == _manifest()
    with pytest.raises(DataError, match=r"x/manifest.json: shards add up to 3 documents and 12 tokens"):
        Manifest.loads(json.dumps(_manifest(num_tokens=13)), "x/manifest.json")
    with pytest.raises(DataError, match="format 'other/1'"):
        Manifest.loads(json.dumps(_manifest(format="other/1")))
    with pytest.raises(DataError, match="dtype uint32 does not match vocab_size 256"):
        Manifest.loads(json.dumps(_manifest(dtype="uint32")))
    shard = _manifest()["shards"][0] | {"tokens": "../escape.npy"}  # type: ignore[index]
    with pytest.raises(DataError, match=r"shards\[0\].tokens must be a path inside"):
        Manifest.loads(json.dumps(_manifest(shards=[shard])))
    with pytest.raises(DataError, match="field tokenizer.eos_id is missing"):
        Manifest.loads(json.dumps(_manifest(tokenizer={"name": "b", "sha256": "b", "vocab_size": 256})))


def test_a_manifest_too_large_or_too_deep_is_refused_unread(tmp_path: Path) -> None:
    """A dataset may come from elsewhere: a 300 MiB manifest.json (sparse here) is not read, and
    one nested past the parser's depth is a DataError, not a RecursionError."""
    huge = tmp_path / "huge"
    huge.mkdir()
    with open(huge / "manifest.json", "wb") as f:
        f.truncate(300 << 20)
    with pytest.raises(DataError, match=r"manifest.json: over 268,435,456 bytes, not a manifest"):
        Manifest.load(huge)
    with pytest.raises(DataError, match="nests too deeply to be a manifest"):
        Manifest.loads("[" * 100_000, "deep/manifest.json")


def test_token_dtype_and_names() -> None:
    assert token_dtype_for(65536) == "uint16" and token_dtype_for(65537) == "uint32"
    assert shard_paths(7) == ("shards/00007.tokens.npy", "shards/00007.docs.npy")


def test_is_prepared_is_a_local_stat(tmp_path: Path) -> None:
    assert not is_prepared(tmp_path) and not is_prepared("s3://b/p")
    (tmp_path / "manifest.json").write_text("{}")
    assert is_prepared(tmp_path) and is_prepared(f"file://{tmp_path}")


def test_sources_expand_in_a_fixed_order(tmp_path: Path) -> None:
    for name in ["b/2.jsonl", "b/1.parquet", "a.txt", "b/skip.csv", "c.md"]:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("x")
    got = sources.expand([str(tmp_path / "c.md"), str(tmp_path / "b"), str(tmp_path / "*.txt"), str(tmp_path / "c.md")])
    assert [Path(f.uri).name for f in got] == ["c.md", "1.parquet", "2.jsonl", "a.txt"]
    assert [f.index for f in got] == [0, 1, 2, 3] and [f.kind for f in got] == ["text", "parquet", "jsonl", "text"]
    with pytest.raises(ConfigError, match="SRC: .*missing does not exist"):
        sources.expand([str(tmp_path / "missing")])
    with pytest.raises(ConfigError, match="unknown format"):
        sources.expand([str(tmp_path / "b" / "skip.csv")])


def _records(path: Path, field: str = "text") -> list[object]:
    source = sources.SourceFile(0, str(path), sources.kind_of(path.name) or "")
    return list(sources.read_records(sources.Piece(0, source), field))


def test_bad_records_name_their_line(tmp_path: Path) -> None:
    path = tmp_path / "x.jsonl"
    path.write_text('{"text": "a"}\n\n{"text": oops\n{"body": "b"}\n[1]\n{"text": 5}\n')
    got = _records(path)
    assert got[0] == "a"
    assert [(r.line, r.reason.split(" (")[0]) for r in got[1:]] == [  # type: ignore[union-attr]
        (3, "malformed JSON"), (4, "no field 'text'"), (5, "expected a JSON object, got list"), (6, "field 'text' is int, not a string"),
    ]


@pytest.mark.parametrize("suffix", [".gz", ".zst"])
def test_compressed_jsonl_reads_and_corruption_names_the_file(tmp_path: Path, suffix: str) -> None:
    records = [{"text": f"document {i}"} for i in range(2000)]
    good = write_jsonl(tmp_path / f"good.jsonl{suffix}", records)
    assert _records(good) == [r["text"] for r in records]
    data = bytearray(good.read_bytes())
    data[len(data) // 2 : len(data) // 2 + 16] = b"\xff" * 16
    bad = tmp_path / f"bad.jsonl{suffix}"
    bad.write_bytes(bytes(data))
    with pytest.raises(DataError, match=rf"{bad}: corrupt compressed data after line \d+"):
        _records(bad)
    truncated = tmp_path / f"cut.jsonl{suffix}"
    truncated.write_bytes(good.read_bytes()[: len(data) // 2])
    with pytest.raises(DataError, match=rf"{truncated}: corrupt compressed data"):
        _records(truncated)


def test_parquet_without_the_text_column_names_the_flag(tmp_path: Path, corpus: Path) -> None:
    parquet = next(corpus.glob("*.parquet"))
    assert all(isinstance(r, str) for r in _records(parquet))
    with pytest.raises(DataError, match=rf"{parquet}: no column 'body' \(--text-field\)"):
        _records(parquet, "body")
    junk = tmp_path / "junk.parquet"
    junk.write_bytes(b"not parquet at all")
    with pytest.raises(DataError, match=rf"{junk}: not a readable Parquet file"):
        _records(junk)
    with pytest.raises(DataError, match=rf"{junk}: not a readable Parquet file"):  # found before any cluster starts
        sources.plan([sources.SourceFile(0, str(junk), "parquet")], 1 << 20)


def test_tokenizer_resolves_eos_hash_and_bad_paths(tokenizer: Path, tmp_path: Path) -> None:
    spec = tokenize.resolve(str(tokenizer))
    assert (spec.info.vocab_size, spec.info.eos_id, len(spec.info.sha256)) == (1024, 2, 64)
    assert tokenize.resolve(str(tokenizer / "tokenizer.json")).info.sha256 == spec.info.sha256
    assert tokenize.resolve("bytes").info == TokenizerInfo("bytes", "bytes", 256, 0)
    with pytest.raises(ConfigError, match="--tokenizer: .*nowhere does not exist"):
        tokenize.resolve(str(tmp_path / "nowhere"))
    with pytest.raises(ConfigError, match="--tokenizer: .* has no tokenizer.json"):
        tokenize.resolve(str(tmp_path))
    tokens, lengths = tokenize.Encoder(spec, "uint16").encode(["def f():\n    pass", "x"])
    assert tokens.dtype == np.uint16 and lengths.sum() == tokens.size
    assert tokens[lengths[0] - 1] == 2 and tokens[-1] == 2
    data, byte_lengths = tokenize.Encoder(tokenize.resolve("bytes"), "uint16").encode(["hé", ""])
    assert data.tolist() == [104, 195, 169, 0, 0] and byte_lengths.tolist() == [4, 1]


def test_an_actor_reports_the_first_bad_record_in_order(tmp_path: Path) -> None:
    path = tmp_path / "x.jsonl"
    path.write_text('{"text": "ok"}\n{"text": ""}\n{"text": 1}\n{"text": "after"}\n')
    piece = sources.Piece(0, sources.SourceFile(4, str(path), "jsonl"))
    spec = tokenize.resolve("bytes")
    fail = list(PieceTokenizer(Job(spec, "uint16", "text", skip_bad=False)).piece(piece))
    assert [(r["fatal"][0], json.loads(r["bad"][0]), r["lines"][0]) for r in fail] == [(True, [[3, "field 'text' is int, not a string"]], 3)]
    skip = list(PieceTokenizer(Job(spec, "uint16", "text", skip_bad=True)).piece(piece))
    assert [(r["fatal"][0], r["error"][0], r["lines"][0]) for r in skip] == [(False, "", 4)]
    assert json.loads(skip[0]["bad"][0]) == [[3, "field 'text' is int, not a string"]]
    assert np.frombuffer(skip[0]["lengths"][0], dtype=np.int64).tolist() == [3, 6]  # "" made no document


LINES = [b'{"a": 1}', b"", b"x" * 37, b"yy", b"", b"", b"z" * 5, b"last-no-newline"]


@pytest.mark.parametrize("trailing", [b"", b"\n", b"\n\n"])
def test_the_line_split_rule_reads_every_line_once(trailing: bytes) -> None:
    """Every split size, chunk size and range: the ranges' lines, in order, are the file's lines,
    and each range's line count numbers the next range's lines from the right place."""
    data = b"\n".join(LINES) + trailing
    expected = data.split(b"\n")
    if expected[-1] == b"":
        expected.pop()  # a final newline ends the last line; it does not start one
    for split in range(1, len(data) + 2):
        for chunk in (1, 3, 64):
            got: list[bytes] = []
            for start in range(0, len(data), split):
                tail = data[start:]
                pieces = (tail[i : i + chunk] for i in range(0, len(tail), chunk))
                got += list(streams.lines(pieces, start, min(start + split, len(data))))
            assert got == expected, (split, chunk)


def test_a_big_file_is_planned_as_ranges_and_parquet_as_row_groups(tmp_path: Path) -> None:
    records = [{"id": str(i), "text": f"document {i}"} for i in range(100)]
    plain = write_jsonl(tmp_path / "a.jsonl", records)
    packed = write_jsonl(tmp_path / "b.jsonl.gz", [{"text": "x"}])
    parquet = write_parquet(tmp_path / "c.parquet", records, row_group_size=10)
    files = sources.expand([str(plain), str(packed), str(parquet)])
    size = plain.stat().st_size
    pieces = sources.plan(files, 500)
    ranges = [(p.start, p.end) for p in pieces if p.source.index == 0]
    assert ranges == [(a, min(a + 500, size)) for a in range(0, size, 500)] and len(ranges) > 3
    assert [(p.start, p.end) for p in pieces if p.source.index == 1] == [(0, None)]  # gzip: whole
    groups = [(p.start, p.end) for p in pieces if p.source.index == 2]
    assert len(groups) > 1 and groups[0][0] == 0 and all(a[1] == b[0] for a, b in zip(groups, groups[1:]))
    assert [p.number for p in pieces] == list(range(len(pieces)))
    assert [(p.start, p.end) for p in sources.plan(files, 1 << 30) if p.source.index != 1] == [(0, size), (0, groups[-1][1])]
    with pytest.raises(ConfigError, match="--split-bytes: must be positive"):
        sources.plan(files, 0)


def test_packer_cuts_by_token_budget_and_never_splits_a_document(tmp_path: Path) -> None:
    got: list[ShardInfo] = []
    packer = writer.Packer(tmp_path, np.dtype("uint16"), 10, got.append)
    lengths = [3, 4, 3, 12, 2, 5, 6]
    packer.add(np.arange(sum(lengths), dtype=np.uint16), np.array(lengths[:4]))
    packer.add(np.arange(sum(lengths[:4]), sum(lengths), dtype=np.uint16), np.array(lengths[4:]))
    shards = packer.finish()
    assert got == shards and [s.num_tokens for s in shards] == [10, 12, 7, 6]
    for shard in shards:
        tokens, docs = np.load(tmp_path / shard.tokens), np.load(tmp_path / shard.docs)
        assert docs[0] == 0 and docs[-1] == tokens.size == shard.num_tokens and docs.dtype == np.int64
        buffer = io.BytesIO()
        np.save(buffer, tokens)  # the streamed .npy is the bytes np.save writes
        assert buffer.getvalue() == (tmp_path / shard.tokens).read_bytes()
    assert np.load(tmp_path / shards[1].tokens).tolist() == list(range(10, 22))
    assert not list(tmp_path.rglob("*.raw"))


def test_local_output_is_staged_and_refuses_to_overwrite(tmp_path: Path) -> None:
    out = tmp_path / "ds"
    output = writer.open_output(str(out), overwrite=False)
    assert output.begin().name.startswith(".ds.partial-") and not out.exists()
    output.abort()
    assert list(tmp_path.iterdir()) == []
    out.mkdir()
    (out / "old").write_text("x")
    with pytest.raises(ConfigError, match=rf"--out: {out} already exists; pass --overwrite"):
        writer.open_output(str(out), overwrite=False)
    # Not a dataset of ours: --overwrite refuses it too (test_overwrite.py runs the command).
    with pytest.raises(ConfigError, match=rf"--out: {out} holds no manifest.json of a prepared dataset"):
        writer.open_output(str(out), overwrite=True)


def test_the_manifest_command_leaves_out_execution_flags() -> None:
    argv = ["src", "--tokenizer", "bytes", "--parallelism", "2", "--overwrite", "--address=auto", "--out", "o", "--quiet",
            "--split-bytes", "4096"]
    assert recorded_command(argv) == ["src", "--tokenizer", "bytes", "--out", "o"]


def test_gzip_fixture_is_deterministic(tmp_path: Path) -> None:
    a = write_jsonl(tmp_path / "a.jsonl.gz", [{"text": "x"}])
    b = write_jsonl(tmp_path / "b.jsonl.gz", [{"text": "x"}])
    assert a.read_bytes() == b.read_bytes() and gzip.decompress(a.read_bytes()) == b'{"text": "x"}\n'


def test_an_s3_body_that_fails_mid_read_is_an_os_error_the_readers_name() -> None:
    """botocore's and urllib3's streaming errors are no OSErrors: the S3 stream makes them one, so
    a connection lost mid-object is prepare's one-line data error, not an actor's traceback."""

    class Reset(Exception):
        pass

    class Body:
        def __init__(self) -> None:
            self.reads = 0

        def read(self, size: object = None) -> bytes:
            self.reads += 1
            if self.reads > 1:
                raise Reset("connection reset by peer")
            return b'{"text": "a"}\n'

    stream = sources._S3Stream(Body())
    assert stream.read(16) == b'{"text": "a"}\n'
    with pytest.raises(OSError, match="Reset: connection reset by peer"):
        stream.read(16)
