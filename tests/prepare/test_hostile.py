"""Corpora built to exhaust `ringtrain prepare`: a zstd bomb, a 1 GiB line, a long text file, a
frame asking for a huge window. Each is a bad record (or a corrupt file) named by file and line,
read in bounded memory: the big cases run prepare in a child process and read its peak RSS.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import zstandard

from ringtrain import cli
from ringtrain.errors import DataError
from ringtrain.prepare import sources, streams
from ringtrain.prepare.streams import LongLine
from ringtrain.prepared import Manifest

REPO = Path(__file__).resolve().parents[2]
GiB = 1 << 30
LIMIT = sources.DEFAULT_MAX_RECORD_BYTES
# A reader holds a bounded chunk and at most one record of LIMIT bytes; the process itself
# (Python, numpy, pyarrow, the tokenizer) takes a few hundred MB.
PEAK_BOUND = GiB
TOO_LONG = f"the line is over the {LIMIT:,}-byte limit (--max-record-bytes)"


def prepare(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = cli.main(["prepare", "--quiet", "--parallelism", "1", "--tokenizer", "bytes", *args])
    return code, capsys.readouterr().err


def prepare_in_child(args: list[str], tmp_path: Path) -> tuple[int, str, int]:
    """(exit code, stderr, peak resident bytes) of prepare in a fresh process."""
    peak_file = tmp_path / "peak"
    env = {**os.environ, "PEAK_FILE": str(peak_file), "HOME": str(tmp_path)}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "platform"), str(REPO), env.get("PYTHONPATH", "")])
    result = subprocess.run(
        [sys.executable, "-m", "tests.prepare.peak", "--quiet", "--parallelism", "1", "--tokenizer", "bytes", *args],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    return result.returncode, result.stderr, int(peak_file.read_text())


def zstd_bomb(path: Path, line_bytes: int) -> Path:
    """A JSONL zstd file: one good record, then a line of ``line_bytes`` 'a's (a few hundred KB
    on disk for several GiB), then a good record. Written in streaming mode, so the frame does
    not state its size and the reader cannot size a buffer from it."""
    block = b"a" * (8 << 20)
    with open(path, "wb") as raw, zstandard.ZstdCompressor(level=1).stream_writer(raw) as out:
        out.write(b'{"text": "first"}\n')
        for _ in range(line_bytes // len(block)):
            out.write(block)
        out.write(b'\n{"text": "last"}\n')
    return path


def sparse_long_line(path: Path, line_bytes: int) -> Path:
    """Plain JSONL whose second line is ``line_bytes`` NUL bytes: a hole in a sparse file, so
    a 1 GiB line costs no disk, yet a reader must go through every byte of it."""
    with open(path, "wb") as f:
        f.write(b'{"text": "first"}\n')
        f.truncate(f.tell() + line_bytes)
        f.seek(0, os.SEEK_END)
        f.write(b'\n{"text": "last"}\n')
    return path


# --- the line reader ----------------------------------------------------------------------------

LINES = [b"short", b"x" * 50, b"", b"y" * 9, b"z" * 10, b"q" * 200, b"last"]


@pytest.mark.parametrize("max_bytes", [9, 10, 49, 1000])
def test_long_lines_are_reported_once_in_place_by_every_split(max_bytes: int) -> None:
    data = b"\n".join(LINES) + b"\n"
    expected: list[object] = [LongLine() if len(line) > max_bytes else line for line in LINES]
    for split in range(1, len(data) + 2, 3):
        for chunk in (1, 4, 64):
            got: list[object] = []
            for start in range(0, len(data), split):
                tail = data[start:]
                pieces = (tail[i : i + chunk] for i in range(0, len(tail), chunk))
                got += list(streams.lines(pieces, start, min(start + split, len(data)), max_bytes))
            assert got == expected, (split, chunk)


def test_a_range_stops_reading_where_no_line_of_it_can_start() -> None:
    """A long line spanning many ranges is read by the range it starts in up to the limit, and
    by the others not past their end: the file is read about once, not once per range."""
    data = b"a\n" + b"b" * 100_000 + b"\nc\n"
    split, chunk, max_bytes = 1000, 100, 500
    total = 0
    for start in range(0, len(data), split):
        read = 0

        def pieces(begin: int = start) -> Iterator[bytes]:
            nonlocal read
            for i in range(begin, len(data), chunk):
                read += chunk
                yield data[i : i + chunk]

        list(streams.lines(pieces(), start, min(start + split, len(data)), max_bytes))
        assert read <= split + max_bytes + 2 * chunk, start
        total += read
    assert total < 1.1 * len(data)


def test_a_zstd_bomb_comes_out_in_bounded_chunks() -> None:
    buffer = io.BytesIO()
    with zstandard.ZstdCompressor(level=1).stream_writer(buffer, closefd=False) as out:
        for _ in range(64):
            out.write(b"\0" * (8 << 20))  # 512 MiB from about 16 KB
    assert len(buffer.getvalue()) < 64 << 10
    sizes = [len(c) for c in streams.zstd_chunks(io.BytesIO(buffer.getvalue()))]
    assert sum(sizes) == 512 << 20
    assert max(sizes) <= 48 << 20  # 1 KiB of input holds at most a few hundred 128 KiB blocks


def test_a_frame_asking_for_a_huge_window_is_corrupt(tmp_path: Path) -> None:
    params = zstandard.ZstdCompressionParameters.from_level(3, window_log=30)  # a 1 GiB window
    path = tmp_path / "wide.jsonl.zst"
    with open(path, "wb") as raw, zstandard.ZstdCompressor(compression_params=params).stream_writer(raw) as out:
        out.write(b'{"text": "x"}\n' * 100)
    source = sources.SourceFile(0, str(path), "jsonl")
    with pytest.raises(DataError, match=rf"{path}: corrupt compressed data .*too much memory"):
        list(sources.read_records(sources.Piece(0, source), "text"))


def test_a_long_text_file_or_parquet_value_is_a_bad_record_read_no_further(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = tmp_path / "big.txt"
    with open(text, "wb") as f:
        f.truncate(LIMIT + 1)  # sparse
    source = sources.SourceFile(0, str(text), "text")
    (record,) = list(sources.read_records(sources.Piece(0, source), "text", max_bytes=LIMIT))
    assert isinstance(record, sources.BadRecord) and record.line == 1
    assert record.reason == f"the file ({LIMIT + 1:,} bytes) is over the {LIMIT:,}-byte limit (--max-record-bytes)"
    from ringtrain_dev.corpus import write_parquet

    parquet = write_parquet(tmp_path / "p.parquet", [{"id": str(i), "text": t} for i, t in enumerate(["ok", "é" * 600, "fine"])], row_group_size=2)
    got = list(sources.read_records(sources.Piece(0, sources.SourceFile(0, str(parquet), "parquet")), "text", max_bytes=1000))
    assert got[0] == "ok" and got[2] == "fine"
    assert isinstance(got[1], sources.BadRecord) and got[1].line == 2 and "1,200 bytes" in got[1].reason


def test_the_record_limit_is_a_flag(serial: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "a.jsonl"
    src.write_text(json.dumps({"text": "x" * 100}) + "\n")
    code, err = prepare([str(src), "--out", str(tmp_path / "o"), "--max-record-bytes", "50"], capsys)
    assert (code, err) == (2, f"ringtrain: data error: {src}:1: the line is over the 50-byte limit (--max-record-bytes)\n")
    code, err = prepare([str(src), "--out", str(tmp_path / "o"), "--max-record-bytes", "0"], capsys)
    assert (code, err) == (2, "ringtrain: config error: --max-record-bytes: must be positive, got 0\n")


# --- whole runs in bounded memory ---------------------------------------------------------------


@pytest.fixture(scope="module")
def bomb(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """4 GiB of one line in a zstd file of about 130 KB."""
    path = zstd_bomb(tmp_path_factory.mktemp("bomb") / "bomb.jsonl.zst", 4 * GiB)
    assert path.stat().st_size < 1 << 20
    return path


@pytest.mark.slow
def test_a_zstd_bomb_is_refused_in_bounded_memory(bomb: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    code, err, peak = prepare_in_child([str(bomb), "--out", str(out)], tmp_path)
    assert (code, err) == (2, f"ringtrain: data error: {bomb}:2: {TOO_LONG}\n")
    assert peak < PEAK_BOUND, f"peak {peak / GiB:.2f} GiB"
    assert not out.exists() and not list(tmp_path.glob(".out*"))


@pytest.mark.slow
def test_a_zstd_bomb_skipped_streams_through_in_bounded_memory(bomb: Path, tmp_path: Path) -> None:
    """With --on-bad-record skip the whole 4 GiB is decompressed, never held."""
    out = tmp_path / "out"
    code, err, peak = prepare_in_child([str(bomb), "--out", str(out), "--on-bad-record", "skip"], tmp_path)
    assert code == 0, err
    assert peak < PEAK_BOUND, f"peak {peak / GiB:.2f} GiB"
    manifest = Manifest.load(out)
    assert (manifest.num_documents, manifest.num_skipped) == (2, 1)
    assert [(s.uri, s.line, s.reason) for s in manifest.skipped] == [(str(bomb), 2, TOO_LONG)]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["fail", "skip"])
def test_a_1_gib_line_is_a_bad_record_read_in_bounded_memory(tmp_path: Path, mode: str) -> None:
    """Split into 64 MiB ranges (the default), as a real run is: the line's first range reports
    it, the others skip it without reading past their own end."""
    (tmp_path / "src").mkdir()
    src = sparse_long_line(tmp_path / "src" / "long.jsonl", GiB)
    assert src.stat().st_size > GiB
    out = tmp_path / "out"
    code, err, peak = prepare_in_child([str(src), "--out", str(out), "--on-bad-record", mode], tmp_path)
    assert peak < PEAK_BOUND, f"peak {peak / GiB:.2f} GiB"
    if mode == "fail":
        assert (code, err) == (2, f"ringtrain: data error: {src}:2: {TOO_LONG}\n")
        assert not out.exists()
        return
    assert code == 0, err
    manifest = Manifest.load(out)
    assert (manifest.num_documents, manifest.num_skipped) == (2, 1)
    assert [(s.line, s.reason) for s in manifest.skipped] == [(2, TOO_LONG)]


def parquet_bomb(path: Path, value_bytes: int, rows: int) -> Path:
    """A Parquet file whose text column names one ``value_bytes`` value in every row but the
    first: dictionary-encoded and zstd-compressed, a few KB on disk for ``rows x value_bytes``
    once decoded. Written without statistics, which would decode it to find a minimum."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    codes = np.ones(rows, dtype=np.int32)
    codes[0] = 0
    column = pa.DictionaryArray.from_arrays(pa.array(codes), pa.array(["first", "a" * value_bytes]))
    pq.write_table(pa.table({"text": column}), path, compression="zstd", use_dictionary=True,
                   dictionary_pagesize_limit=2 * value_bytes, write_statistics=False)  # fmt: skip
    return path


@pytest.mark.slow
def test_a_parquet_bomb_is_refused_in_bounded_memory(tmp_path: Path) -> None:
    (tmp_path / "src").mkdir()
    rows, value_bytes = 4600, 24 << 20
    bomb = parquet_bomb(tmp_path / "src" / "bomb.parquet", value_bytes, rows)
    assert bomb.stat().st_size < 64 << 10 and rows * value_bytes > 100 * GiB
    out = tmp_path / "out"
    code, err, peak = prepare_in_child([str(bomb), "--out", str(out)], tmp_path)
    too_long = f"field 'text' ({value_bytes:,} bytes) is over the {LIMIT:,}-byte limit (--max-record-bytes)"
    assert (code, err) == (2, f"ringtrain: data error: {bomb}:2: {too_long}\n")
    assert peak < PEAK_BOUND, f"peak {peak / GiB:.2f} GiB"
    assert not out.exists()
    # Skipped, every row of it streams through, and the first row is the one document.
    code, err, peak = prepare_in_child([str(bomb), "--out", str(out), "--on-bad-record", "skip"], tmp_path)
    assert code == 0, err
    assert peak < PEAK_BOUND, f"peak {peak / GiB:.2f} GiB"
    manifest = Manifest.load(out)
    assert (manifest.num_documents, manifest.num_skipped) == (1, rows - 1)


def test_json_nested_too_deeply_is_a_bad_record(tmp_path: Path) -> None:
    path = tmp_path / "deep.jsonl"
    path.write_text('{"text": "ok"}\n' + '{"text": ' + "[" * 100_000 + "]" * 100_000 + "}\n" + '{"text": "fine"}\n')
    got = list(sources.read_records(sources.Piece(0, sources.SourceFile(0, str(path), "jsonl")), "text"))
    assert got[0] == "ok" and got[2] == "fine"
    assert got[1] == sources.BadRecord(2, "JSON nested too deeply to read")


def test_bad_records_skipped_leave_the_actor_in_bounded_chunks(tmp_path: Path) -> None:
    """17 KB of zstd hold 100 million bad lines; an actor skipping them once held every one
    (some 20 GB): it sends them on at most CHUNK_DOCUMENTS at a time, in order."""
    from ringtrain.prepare import tokenize
    from ringtrain.prepare.pipeline import CHUNK_DOCUMENTS, Job, PieceTokenizer

    count = 3 * CHUNK_DOCUMENTS + 7
    path = tmp_path / "bad.jsonl.zst"
    path.write_bytes(zstandard.ZstdCompressor().compress(b"x\n" * count + b'{"text": "last"}\n'))
    piece = sources.Piece(0, sources.SourceFile(0, str(path), "jsonl"))
    rows = list(PieceTokenizer(Job(tokenize.resolve("bytes"), "uint8", "text", skip_bad=True)).piece(piece))
    bad = [json.loads(row["bad"][0]) for row in rows]
    assert max(len(b) for b in bad) <= CHUNK_DOCUMENTS
    assert [line for b in bad for line, _ in b] == list(range(1, count + 1))
    assert [int(row["lines"][0]) for row in rows][-1] == count + 1 and sum(len(row["lengths"][0]) for row in rows) == 8
