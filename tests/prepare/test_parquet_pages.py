"""Parquet read in bounded memory whatever its pages state: the page headers walked before Arrow
decodes a page agree with pyarrow's own metadata for every layout pyarrow writes, and a page that
decodes past the limit is never decoded (Arrow's allocations, counted in a fresh process, stay
small), its row group's rows bad records, the row groups around it read.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ringtrain.prepare import pages, sources

REPO = Path(__file__).resolve().parents[2]
MiB = 1 << 20


def text_column(values: list[str], big_at: int = -1, big_bytes: int = 0) -> pa.Array:
    """A string array of ``values`` with, at ``big_at``, ``big_bytes`` of 'a' built in one buffer
    (no Python string of it: the test itself stays small)."""
    sizes = [big_bytes if i == big_at else len(v.encode()) for i, v in enumerate(values)]
    data = np.full(sum(sizes), ord("a"), dtype=np.uint8)
    at = 0
    for i, v in enumerate(values):
        if i != big_at:
            data[at : at + sizes[i]] = np.frombuffer(v.encode(), dtype=np.uint8)
        at += sizes[i]
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    return pa.LargeStringArray.from_buffers(len(values), pa.py_buffer(offsets), pa.py_buffer(data)).cast(pa.string())


@pytest.mark.parametrize("page_version", ["1.0", "2.0"])
@pytest.mark.parametrize("dictionary", [True, False])
@pytest.mark.parametrize("statistics", [True, False])
def test_the_page_walk_agrees_with_the_metadata(tmp_path: Path, page_version: str, dictionary: bool, statistics: bool) -> None:
    """Every column chunk of every row group, a nested column's too: headers and pages add up to
    the chunk's stored and decoded sizes exactly, and the data pages' values to its rows."""
    rng = np.random.default_rng(0)
    n = 5000
    texts = [("x" * int(rng.integers(0, 2000)) + str(i)) if i % 7 else None for i in range(n)]
    table = pa.table({"id": pa.array(range(n)), "nest": pa.array([{"a": i, "b": [1, 2]} for i in range(n)]), "text": texts})
    path = tmp_path / "t.parquet"
    pq.write_table(table, path, compression="zstd", use_dictionary=dictionary, write_statistics=statistics,
                   data_page_version=page_version, row_group_size=2000, data_page_size=50_000)  # fmt: skip
    meta = pq.ParquetFile(path).metadata
    with open(path, "rb") as raw:
        for group in range(meta.num_row_groups):
            for leaf in range(meta.num_columns):
                column = meta.row_group(group).column(leaf)
                start = column.dictionary_page_offset if column.has_dictionary_page else column.data_page_offset
                found = list(pages.pages(raw, start, column.total_compressed_size))
                assert sum(p.header_bytes + p.stored_bytes for p in found) == column.total_compressed_size
                assert sum(p.header_bytes + p.decoded_bytes for p in found) == column.total_uncompressed_size
                assert [p.kind == pages.DICTIONARY_PAGE for p in found] == [column.has_dictionary_page] + [False] * (len(found) - 1)
                data = [p for p in found if p.is_data]
                if meta.schema.column(leaf).max_repetition_level == 0:
                    assert sum(p.values for p in data) == meta.row_group(group).num_rows
                # pyarrow writes codes while the dictionary stays under 1 MiB, then plain pages
                coded = [p.coded for p in data]
                assert coded == sorted(coded, reverse=True) and coded[0] == column.has_dictionary_page
                chunk = pages.chunk(raw, column)
                assert chunk.largest == max(p.decoded_bytes for p in found)
                assert chunk.dictionary_bytes == (found[0].decoded_bytes if column.has_dictionary_page else 0)
                assert chunk.density == max([-(-p.decoded_bytes // p.values) for p in data if not p.coded] or [1])
                assert chunk.values == sum(p.values for p in data)
                assert chunk.all_coded == all(coded)


def test_a_header_cut_short_or_a_page_past_its_chunk_is_a_page_error(tmp_path: Path) -> None:
    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"text": ["a", "b"]}), path)
    column = pq.ParquetFile(path).metadata.row_group(0).column(0)
    with open(path, "rb") as raw:
        whole = pages.chunk(raw, column)
        assert whole.values == 2
        start = column.dictionary_page_offset if column.has_dictionary_page else column.data_page_offset
        with pytest.raises(pages.PageError, match="runs past its column chunk"):
            list(pages.pages(raw, start, column.total_compressed_size - 1))
        raw.seek(start)
        header = raw.read(64)
    with pytest.raises(pages.PageError):
        pages._header(b"\x1e" + header[1:])  # its first field of a type Thrift does not have


READ = """
import json, sys
import pyarrow as pa
from ringtrain.prepare import sources
records = list(sources.read_records(sources.Piece(0, sources.SourceFile(0, sys.argv[1], "parquet")), "text"))
print(json.dumps({"records": [(r if len(r) < 100 else len(r)) if isinstance(r, str) else [r.line, r.reason] for r in records],
                  "arrow_peak": pa.default_memory_pool().max_memory()}))
"""


def read_in_child(path: Path) -> tuple[list[object], int]:
    """The records of ``path`` read in a fresh process (a text of 100 characters or more as its
    length), and the most Arrow held at once there."""
    env = {"PYTHONPATH": str(REPO / "platform"), "PATH": "/usr/bin:/bin"}
    result = subprocess.run([sys.executable, "-c", READ, str(path)], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    got = json.loads(result.stdout)
    return got["records"], int(got["arrow_peak"])


def test_a_page_that_decodes_past_the_limit_is_never_decoded(tmp_path: Path) -> None:
    """Three row groups; the middle one's only page is a 200 MiB value in 10 KB of zstd. Before
    the page walk, Arrow decompressed it (and copied its value): 400 MiB held for a refusal."""
    path = tmp_path / "p.parquet"
    big = 200 * MiB
    pq.write_table(pa.table({"text": text_column(["first", "", "last"], big_at=1, big_bytes=big)}), path,
                   compression="zstd", use_dictionary=False, write_statistics=False, row_group_size=1)  # fmt: skip
    assert path.stat().st_size < 64 << 10
    records, arrow_peak = read_in_child(path)
    limit = sources._page_limit(sources.DEFAULT_MAX_RECORD_BYTES)
    assert records[0] == "first" and records[2] == "last"
    line, reason = records[1]  # type: ignore[misc]
    assert line == 2 and reason.startswith("row group 1 holds a page of field 'text' that decodes to 209,7")
    assert f"over the {limit:,}-byte page limit" in reason
    assert arrow_peak < 16 * MiB, f"Arrow held {arrow_peak / MiB:.0f} MiB"


def test_values_in_pages_under_the_limit_are_measured_before_any_string(tmp_path: Path) -> None:
    """A 20 MiB value in a 20 MiB page is read (the page fits) and refused by its own length."""
    path = tmp_path / "p.parquet"
    pq.write_table(pa.table({"text": text_column(["first", "", "last"], big_at=1, big_bytes=20 * MiB)}), path,
                   compression="zstd", use_dictionary=False, write_statistics=False)  # fmt: skip
    records, arrow_peak = read_in_child(path)
    limit = sources.DEFAULT_MAX_RECORD_BYTES
    assert records == ["first", [2, f"field 'text' ({20 * MiB:,} bytes) is over the {limit:,}-byte limit (--max-record-bytes)"], "last"]
    assert arrow_peak < 100 * MiB


def test_a_column_that_is_not_text_is_bad_records_unread(tmp_path: Path) -> None:
    """A list column (or any non-string one) is refused by its type, row by row, without reading
    its pages; a flat text column beside a nested one is found by its own leaf."""
    path = tmp_path / "p.parquet"
    pq.write_table(pa.table({"nest": [{"a": 1, "b": 2}] * 3, "text": ["x", "y", "z"], "ints": [[1], [2], [3]]}), path)
    source = sources.SourceFile(0, str(path), "parquet")
    assert list(sources.read_records(sources.Piece(0, source), "text")) == ["x", "y", "z"]
    got = list(sources.read_records(sources.Piece(0, source), "ints"))
    assert got == [sources.BadRecord(i, "field 'ints' is list<element: int64>, not a string") for i in (1, 2, 3)]
    got = list(sources.read_records(sources.Piece(0, source), "nest"))
    assert got == [sources.BadRecord(i, "field 'nest' is struct<a: int64, b: int64>, not a string") for i in (1, 2, 3)]


def test_prepare_names_the_row_of_a_page_past_the_limit(serial: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Through the command line: exit 2 naming the file and row, or the row skipped."""
    from ringtrain import cli
    from ringtrain.prepared import Manifest

    (tmp_path / "src").mkdir()
    path = tmp_path / "src" / "bomb.parquet"
    pq.write_table(pa.table({"text": text_column(["first", "", "last"], big_at=1, big_bytes=100 * MiB)}), path,
                   compression="zstd", use_dictionary=False, write_statistics=False, row_group_size=1)  # fmt: skip
    args = ["prepare", "--quiet", "--parallelism", "1", "--tokenizer", "bytes", str(path), "--out", str(tmp_path / "out")]
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"ringtrain: data error: {path}:2: row group 1 holds a page of field 'text' that decodes to 104,8")
    assert err.endswith("its rows are not read\n") and err.count("\n") == 1
    assert cli.main([*args, "--on-bad-record", "skip"]) == 0
    manifest = Manifest.load(tmp_path / "out")
    assert (manifest.num_documents, manifest.num_skipped, manifest.skipped[0].line) == (2, 1, 2)


def test_a_row_group_of_distinct_values_is_read_in_batches(tmp_path: Path) -> None:
    """64 MB of distinct texts in one row group, as pyarrow writes them (a dictionary page, then
    plain pages). Read as a dictionary array, Arrow kept every distinct value of the row group
    and more: 270 MiB held; read as plain values in batches, a few MiB."""
    n, size = 64_000, 1000
    data = np.random.default_rng(0).integers(ord("a"), ord("z") + 1, size=n * size, dtype=np.uint8)
    offsets = np.arange(0, n * size + 1, size, dtype=np.int32)
    texts = pa.StringArray.from_buffers(n, pa.py_buffer(offsets), pa.py_buffer(data))
    path = tmp_path / "p.parquet"
    pq.write_table(pa.table({"text": texts}), path, row_group_size=n, compression="zstd")
    records, arrow_peak = read_in_child(path)
    assert records == [size] * n
    assert arrow_peak < 16 * MiB, f"Arrow held {arrow_peak / MiB:.0f} MiB"
