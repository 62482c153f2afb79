"""The input of `ringtrain prepare`: SRC arguments expanded to files, and each file read as documents.

A source file is JSONL (``.jsonl``/``.ndjson``, plain, ``.gz`` or ``.zst``), Parquet, or plain
text (``.txt``/``.md``: the whole file is one document). Folders, globs and ``s3://`` prefixes
expand to the files of those kinds under them, sorted, so the document order is a function of
the arguments alone. A record that cannot be used (malformed JSON, no text field, longer than
``--max-record-bytes``) is a ``BadRecord``: the caller fails on it or skips it. A file that
cannot be read at all (corrupt compressed stream, unreadable Parquet) raises ``DataError``
naming it. Reading holds at most one record (of at most the limit) and a bounded chunk of the
file in memory, however the file is compressed or laid out (``streams``).

The unit of parallel work is a ``Piece`` of a file, so one huge file is read by many actors:
plain JSONL is cut into byte ranges by the line-split rule (below), Parquet into runs of whole
row groups; compressed JSONL (no seeking into a gzip or zstd stream), text documents (one
document per file) and S3 Parquet stay one piece. A piece numbers its lines (rows) from 1; the
driver, which sees the pieces of a file in order, adds the lines of the pieces before it.
"""

from __future__ import annotations

import contextlib
import functools
import glob
import gzip
import json
import os
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import IO, Any, Optional, Union

from ringtrain.errors import ConfigError, DataError
from ringtrain.links import check_inside
from ringtrain.prepare.chat_records import Conversation, parquet_conversations
from ringtrain.prepare.record_bounds import (
    DEFAULT_MAX_RECORD_BYTES,
    MAX_RECORD_FLAG,
    PARQUET_BATCH_BYTES,
    PARQUET_BATCH_ROWS,
    PARQUET_PAGE_BYTES,
    BadRecord,
    too_long,
)
from ringtrain.prepare.streams import READ_CHUNK, LongLine, decompressed_chunks, lines

JSONL_SUFFIXES = (".jsonl", ".ndjson")
COMPRESSED_SUFFIXES = ("", ".gz", ".zst")
PARQUET_SUFFIXES = (".parquet",)
TEXT_SUFFIXES = (".txt", ".md")
SRC_KEY = "SRC"


@dataclass(frozen=True)
class SourceFile:
    index: int  # position in the expanded, ordered list: the first key of the document order
    uri: str  # a local path (as the user spelled it) or s3://bucket/key
    kind: str  # "jsonl" | "parquet" | "text"


@dataclass(frozen=True)
class Piece:
    """Part of one source file, read by one actor call.

    Plain JSONL: bytes [start, end) by the line-split rule; Parquet: row groups [start, end);
    otherwise the whole file (start 0, end None).
    """

    number: int  # position in the plan: pieces of a file are consecutive, in file order
    source: SourceFile
    start: int = 0
    end: Optional[int] = None


# A document's text, a chat record's messages field (``chat_records``), or a bad record.
Record = Union[str, Conversation, BadRecord]


def kind_of(name: str) -> str | None:
    """The format of a file by its name, None when prepare does not read it."""
    lower = name.lower()
    for suffix in JSONL_SUFFIXES:
        if any(lower.endswith(suffix + c) for c in COMPRESSED_SUFFIXES):
            return "jsonl"
    if lower.endswith(PARQUET_SUFFIXES):
        return "parquet"
    if lower.endswith(TEXT_SUFFIXES):
        return "text"
    return None


def _known(names: list[str]) -> list[str]:
    return sorted(n for n in names if kind_of(n) is not None)


def _expand_local(arg: str) -> list[str]:
    path = Path(arg.removeprefix("file://"))
    if glob.has_magic(arg):
        matches = glob.glob(str(path), recursive=True)
        if not matches:
            raise ConfigError(SRC_KEY, f"{arg} matches no file")
        found: list[str] = []
        for match in sorted(matches):
            if Path(match).is_dir() or kind_of(match) is not None:
                # A match is a file of the folder the pattern starts in, which it must not leave.
                check_inside(_glob_root(path), match, SRC_KEY)
            found += _expand_local(match) if Path(match).is_dir() else _known([match])
        return found
    if path.is_dir():
        files = _known([str(p) for p in path.rglob("*") if p.is_file()])
        for file in files:
            check_inside(path, file, SRC_KEY)
        return files
    if not path.exists():
        raise ConfigError(SRC_KEY, f"{arg} does not exist")
    if kind_of(path.name) is None:
        raise ConfigError(SRC_KEY, f"{arg}: unknown format (expected .jsonl[.gz|.zst], .ndjson, .parquet, .txt or .md)")
    return [str(path)]


def _glob_root(pattern: Path) -> Path:
    """The folder a glob pattern searches: its path up to the first part with a wildcard."""
    parts = []
    for part in pattern.parts:
        if glob.has_magic(part):
            break
        parts.append(part)
    return Path(*parts) if parts else Path(".")


def _expand_s3(arg: str) -> list[str]:
    from ringtrain.checkpoint.options import S3Options
    from ringtrain.checkpoint.s3 import S3Backend, parse_s3_uri
    from ringtrain.checkpoint.s3_access import check_reachable

    try:
        bucket, prefix = parse_s3_uri(arg)
    except ValueError:
        raise ConfigError(SRC_KEY, f"{arg}: expected s3://bucket/prefix") from None
    check_reachable(arg, SRC_KEY)
    backend = S3Backend(bucket, "", S3Options())
    keys = [info.key for info in backend.list(prefix)]
    # A prefix names a "folder" (key/...) or one object exactly; never a key that merely starts alike.
    keys = [k for k in keys if k == prefix or not prefix or k.startswith(prefix.rstrip("/") + "/")]
    if len(keys) == 1 and keys[0] == prefix and kind_of(prefix) is None:
        raise ConfigError(SRC_KEY, f"{arg}: unknown format (expected .jsonl[.gz|.zst], .ndjson, .parquet, .txt or .md)")
    return [f"s3://{bucket}/{k}" for k in _known(keys)]


def expand(args: list[str]) -> list[SourceFile]:
    """Every file the SRC arguments name, in argument order then sorted path order, each once."""
    if not args:
        raise ConfigError(SRC_KEY, "give at least one file, folder, glob or s3:// prefix")
    seen: set[str] = set()
    files: list[SourceFile] = []
    for arg in args:
        found = _expand_s3(arg) if arg.startswith("s3://") else _expand_local(arg)
        if not found:
            raise ConfigError(SRC_KEY, f"{arg} holds no .jsonl, .parquet, .txt or .md file")
        for uri in found:
            if uri not in seen:
                seen.add(uri)
                kind = kind_of(uri)
                assert kind is not None  # _known kept only these
                files.append(SourceFile(len(files), uri, kind))
    return files


def absolute(files: list[SourceFile]) -> list[SourceFile]:
    """``files`` as tasks on the cluster read them: local paths made absolute, since a task's
    working directory is this process's only on a cluster this process started. The manifest
    keeps the paths as the user spelled them."""
    return [f if f.uri.startswith("s3://") else replace(f, uri=os.path.abspath(f.uri.removeprefix("file://")))
            for f in files]


def local_bytes(files: list[SourceFile]) -> Optional[int]:
    """The size of ``files`` on local disk in all; None when any is on S3 (a size there is a
    request per object, and an S3 corpus is the cluster's work anyway)."""
    if any(f.uri.startswith("s3://") for f in files):
        return None
    return sum(_size(f.uri) for f in files)


def splittable(source: SourceFile) -> bool:
    """Plain JSONL on local disk or S3 (ranged reads), and local Parquet (its footer is read here)."""
    if source.kind == "jsonl":
        return kind_of(source.uri) == "jsonl" and source.uri.lower().endswith(JSONL_SUFFIXES)
    return source.kind == "parquet" and not source.uri.startswith("s3://")


@functools.lru_cache(maxsize=None)
def _s3_client(bucket: str) -> Any:
    """One boto3 client per bucket and process: making one loads botocore's service models
    (a few hundred ms), too much to pay per piece."""
    from ringtrain.checkpoint.options import S3Options
    from ringtrain.checkpoint.s3 import S3Backend

    return S3Backend(bucket, "", S3Options()).client


def _size(uri: str) -> int:
    if not uri.startswith("s3://"):
        return os.path.getsize(uri.removeprefix("file://"))
    from ringtrain.checkpoint.s3 import parse_s3_uri

    bucket, key = parse_s3_uri(uri)
    try:
        return int(_s3_client(bucket).head_object(Bucket=bucket, Key=key)["ContentLength"])
    except Exception as exc:  # botocore's errors share no useful base beyond Exception
        raise DataError(f"{uri}: cannot stat ({exc})") from None


def _row_group_runs(source: SourceFile, split_bytes: int) -> list[tuple[int, int]]:
    """[first, end) row groups per piece: consecutive groups up to ``split_bytes`` of data each."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        meta = pq.ParquetFile(source.uri.removeprefix("file://")).metadata
    except (pa.ArrowException, OSError) as exc:
        raise DataError(f"{source.uri}: not a readable Parquet file ({exc})") from None
    runs: list[tuple[int, int]] = []
    first, size = 0, 0
    for group in range(meta.num_row_groups):
        size += meta.row_group(group).total_byte_size
        if size >= split_bytes:
            runs.append((first, group + 1))
            first, size = group + 1, 0
    if first < meta.num_row_groups or not runs:
        runs.append((first, meta.num_row_groups))
    return runs


def plan(files: list[SourceFile], split_bytes: int) -> list[Piece]:
    """The pieces of ``files`` in document order: at most ``split_bytes`` of a splittable file each."""
    if split_bytes < 1:
        raise ConfigError("--split-bytes", f"must be positive, got {split_bytes}")
    pieces: list[Piece] = []
    for source in files:
        if not splittable(source):
            pieces.append(Piece(len(pieces), source))
        elif source.kind == "parquet":
            pieces += [Piece(len(pieces) + i, source, a, b) for i, (a, b) in enumerate(_row_group_runs(source, split_bytes))]
        else:
            size = _size(source.uri)
            starts = range(0, max(size, 1), split_bytes)
            pieces += [Piece(len(pieces) + i, source, a, min(a + split_bytes, size)) for i, a in enumerate(starts)]
    return pieces


# ---- reading one piece -----------------------------------------------------------------------


def _range_chunks(path: str, uri: str, start: int) -> Iterator[bytes]:
    """The bytes of a plain file from offset ``start`` to its end, in chunks (stop early at will)."""
    with _raw(uri, path, start) as stream:
        while chunk := stream.read(READ_CHUNK):
            yield chunk


def _corrupt_errors() -> tuple[type[BaseException], ...]:
    import zstandard

    return (gzip.BadGzipFile, EOFError, zlib.error, zstandard.ZstdError)


class LineCounter:
    """How many lines (rows) a piece's reader has consumed, blank ones included: the driver adds
    a piece's total to the line numbers of the file's next piece."""

    def __init__(self) -> None:
        self.lines = 0


@contextlib.contextmanager
def _raw(uri: str, path: str, start: int = 0) -> Iterator[IO[bytes]]:
    """The bytes of a source from offset ``start`` as a stream: the local file at ``path``, or
    the S3 object ``uri`` (when ``path`` is that URI) as its GET's body, read as it is
    consumed, never downloaded whole."""
    if not path.startswith("s3://"):
        with open(path, "rb") as f:
            f.seek(start)
            yield f
        return
    from ringtrain.checkpoint.s3 import parse_s3_uri

    bucket, key = parse_s3_uri(uri)
    ranged = {"Range": f"bytes={start}-"} if start else {}
    try:
        body = _s3_client(bucket).get_object(Bucket=bucket, Key=key, **ranged)["Body"]
    except Exception as exc:  # botocore's errors share no useful base beyond Exception
        raise DataError(f"{uri}: cannot read ({exc})") from None
    try:
        yield _S3Stream(body)
    finally:
        body.close()  # unread bytes (a refused record's rest) go with the connection


class _S3Stream:
    """A GET's body whose read errors are OSErrors, as a file's are: botocore's and urllib3's
    (a connection reset or timed out mid-object) share no base with them, and the readers turn
    an OSError into one line naming the object and where it stopped."""

    def __init__(self, body: Any) -> None:
        self._body = body

    def read(self, size: int = -1) -> bytes:
        try:
            data: bytes = self._body.read(size if size >= 0 else None)
            return data
        except OSError:
            raise
        except Exception as exc:  # botocore.exceptions.ResponseStreamingError, urllib3's ProtocolError, ...
            raise OSError(f"{type(exc).__name__}: {exc}") from None


def _jsonl(piece: Piece, path: str, text_field: str, counter: LineCounter, max_bytes: int, chat: bool = False) -> Iterator[Record]:
    uri = piece.source.uri
    ranged = splittable(piece.source)
    try:
        with contextlib.ExitStack() as stack:
            chunks = _range_chunks(path, uri, piece.start) if ranged else decompressed_chunks(stack.enter_context(_raw(uri, path)), uri)
            yield from _jsonl_records(chunks, piece, ranged, text_field, counter, max_bytes, chat)
    except _corrupt_errors() as exc:
        raise DataError(f"{uri}: corrupt compressed data after line {counter.lines} ({exc or type(exc).__name__})") from None
    except OSError as exc:
        where = f"bytes {piece.start}-{piece.end}" if piece.start else f"after line {counter.lines}"
        raise DataError(f"{uri}: cannot read {where} ({exc})") from None


def _jsonl_records(
    chunks: Iterator[bytes], piece: Piece, ranged: bool, text_field: str, counter: LineCounter, max_bytes: int, chat: bool
) -> Iterator[Record]:
    for line in lines(chunks, piece.start, piece.end if ranged else None, max_bytes):
        counter.lines += 1
        if isinstance(line, LongLine):
            yield BadRecord(counter.lines, too_long("the line", max_bytes))
            continue
        if not line.strip():
            continue  # blank lines (a trailing newline too) are not records
        yield _record(line, counter.lines, text_field, chat)


def _record(line: bytes, line_no: int, text_field: str, chat: bool = False) -> Record:
    try:
        obj: Any = json.loads(line)
    except (ValueError, UnicodeDecodeError) as exc:
        return BadRecord(line_no, f"malformed JSON ({exc})")
    except RecursionError:
        # Thousands of nested brackets in one line: no record a corpus means to hold.
        return BadRecord(line_no, "JSON nested too deeply to read")
    if not isinstance(obj, dict):
        return BadRecord(line_no, f"expected a JSON object, got {type(obj).__name__}")
    if chat:
        return Conversation(obj)  # checked by the renderer's caller: chat_records.read_chat
    if text_field not in obj:
        return BadRecord(line_no, f"no field {text_field!r} (--text-field)")
    text = obj[text_field]
    if not isinstance(text, str):
        return BadRecord(line_no, f"field {text_field!r} is {type(text).__name__}, not a string")
    return text


def _parquet(piece: Piece, path: str, text_field: str, counter: LineCounter, max_bytes: int) -> Iterator[Record]:
    """A Parquet piece's values, in batches sized to a byte budget, each value's length measured
    on the Arrow array before any Python string of it exists.

    Before a row group is decoded its column chunk's page headers are read (``pages``): a page
    decoding to more than ``_page_limit`` makes every row of the row group a bad record unread
    (Arrow decompresses a page whole, so a few KB can cost 2 GiB), and the pages size the
    batches, whatever the metadata claims. A chunk of codes into its dictionary page is read as
    a dictionary array, so a value repeated over many rows (a file of a few KB can name one
    48 MiB value in every row: a hundred GiB once decoded) is held once. Any other chunk is read
    as plain values, in batches of ``PARQUET_BATCH_BYTES`` at its densest page's bytes per row
    (or its dictionary page's size, for codes among plain pages): Arrow, asked for a dictionary
    there, would keep every distinct value of the row group. A column that is not text is a
    bad record in every row, unread.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    from ringtrain.prepare import pages

    uri = piece.source.uri
    try:
        pfile = pq.ParquetFile(path)
        names = pfile.schema_arrow.names
        if text_field not in names:
            raise DataError(f"{uri}: no column {text_field!r} (--text-field); columns: {', '.join(names)}")
        meta = pfile.metadata
        end = meta.num_row_groups if piece.end is None else piece.end
        value_type = pfile.schema_arrow.field(text_field).type
        if pa.types.is_dictionary(value_type):
            value_type = value_type.value_type
        leaf = _parquet_leaf(pfile, text_field, uri)
        if leaf is None or not (pa.types.is_string(value_type) or pa.types.is_large_string(value_type)):
            for group in range(piece.start, end):
                for _ in range(meta.row_group(group).num_rows):
                    counter.lines += 1
                    yield BadRecord(counter.lines, f"field {text_field!r} is {value_type}, not a string")
            return
        # Unbuffered or pre-buffered, Arrow reads a whole column chunk's stored bytes at once.
        plain = pq.ParquetFile(path, pre_buffer=False, buffer_size=READ_CHUNK)
        coded = pq.ParquetFile(path, pre_buffer=False, buffer_size=READ_CHUNK, read_dictionary=[text_field])
        limit = _page_limit(max_bytes)
        with open(path, "rb") as raw:
            for group in range(piece.start, end):
                try:
                    chunk = pages.chunk(raw, meta.row_group(group).column(leaf))
                except pages.PageError as exc:
                    raise DataError(f"{uri}: not a readable Parquet file (row group {group}: {exc})") from None
                if chunk.largest > limit:
                    reason = (f"row group {group} holds a page of field {text_field!r} that decodes to {chunk.largest:,} "
                              f"bytes, over the {limit:,}-byte page limit (2 x {MAX_RECORD_FLAG}, 64 MiB at least): its rows are not read")  # fmt: skip
                    for _ in range(meta.row_group(group).num_rows):
                        counter.lines += 1
                        yield BadRecord(counter.lines, reason)
                    continue
                reader, row_bytes = (coded, 1) if chunk.all_coded else (plain, max(chunk.density, chunk.dictionary_bytes))
                rows = max(1, min(PARQUET_BATCH_ROWS, PARQUET_BATCH_BYTES // row_bytes))
                for batch in reader.iter_batches(batch_size=rows, row_groups=[group], columns=[text_field], use_threads=False):
                    yield from _parquet_values(batch.column(0), text_field, counter, max_bytes)
    except (pa.ArrowException, OSError) as exc:
        raise DataError(f"{uri}: not a readable Parquet file ({exc})") from None


def _parquet_values(array: Any, text_field: str, counter: LineCounter, max_bytes: int) -> Iterator[Record]:
    """A batch's records (a string or dictionary array): lengths read off the array first."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    if pa.types.is_dictionary(array.type):
        values = array.dictionary
        codes = np.asarray(array.indices.fill_null(-1).to_numpy(zero_copy_only=False), dtype=np.int64)
    else:
        values = array
        codes = np.where(array.is_null().to_numpy(zero_copy_only=False), -1, np.arange(len(array)))
    lengths = np.asarray(pc.binary_length(values).fill_null(0).to_numpy(zero_copy_only=False), dtype=np.int64)
    for code in codes.tolist():
        counter.lines += 1
        if code < 0:
            yield BadRecord(counter.lines, f"field {text_field!r} is null, not a string")
        elif lengths[code] > max_bytes:
            yield BadRecord(counter.lines, too_long(f"field {text_field!r} ({int(lengths[code]):,} bytes)", max_bytes))
        else:
            yield values[code].as_py()


def _parquet_leaf(pfile: Any, name: str, uri: str) -> Optional[int]:
    """The leaf column (its index in a row group's metadata) of top-level column ``name`` when it
    is a flat one; None for a nested column (a list, a struct)."""
    found = [j for j in range(len(pfile.schema)) if pfile.schema.column(j).path == name]
    if len(found) > 1:
        raise DataError(f"{uri}: {len(found)} Parquet columns are named {name!r} (--text-field)")
    if not found or pfile.schema.column(found[0]).max_repetition_level:
        return None
    return found[0]


def _page_limit(max_bytes: int) -> int:
    """The most a Parquet page of the text column may decode to: room for a value of the record
    limit and its neighbours, and never under the 1 MiB pages writers cut by default."""
    return max(PARQUET_PAGE_BYTES, 2 * max_bytes)


def _text(path: str, uri: str, counter: LineCounter, max_bytes: int) -> Iterator[Record]:
    """The file as one document, read no further than the limit: a bigger file is a bad record."""
    counter.lines = 1
    try:
        with _raw(uri, path) as stream:
            data = stream.read(max_bytes + 1)
    except OSError as exc:
        raise DataError(f"{uri}: cannot read ({exc})") from None
    if len(data) > max_bytes:
        yield BadRecord(1, too_long(f"the file ({_size(uri if path.startswith('s3://') else path):,} bytes)", max_bytes))
        return
    try:
        yield data.decode("utf-8")
    except UnicodeDecodeError as exc:
        yield BadRecord(1, f"not UTF-8 text ({exc})")


def read_records(
    piece: Piece,
    text_field: str,
    local: str | None = None,
    counter: LineCounter | None = None,
    max_bytes: int = DEFAULT_MAX_RECORD_BYTES,
    chat: bool = False,
    context_fields: frozenset[str] = frozenset(),
    record_fields: tuple[str, ...] = (),
    max_messages: int = 0,
) -> Iterator[Record]:
    """The records of ``piece`` in file order: a document's text (with ``chat``: the record, as a
    Conversation; from Parquet, the messages column ``text_field`` names, or Alpaca's, and the
    ``context_fields`` columns; a preference pair's ``record_fields``) or a BadRecord (its line
    counted from the piece's first line; a record over ``max_bytes`` is one, and a Parquet
    conversation of more than ``max_messages`` messages, 0 for any). ``counter`` follows the
    lines consumed.

    ``local`` is where the file's bytes are when they are not at ``piece.source.uri`` (an S3
    object downloaded first); errors still name the URI.
    """
    counter = counter or LineCounter()
    source = piece.source
    path = local or source.uri.removeprefix("file://")
    if source.kind == "jsonl":
        return _jsonl(piece, path, text_field, counter, max_bytes, chat)
    if source.kind == "parquet" and chat:
        return parquet_conversations(piece, path, text_field, counter, max_bytes, context_fields, record_fields,
                                     max_messages)
    if source.kind == "parquet":
        return _parquet(piece, path, text_field, counter, max_bytes)
    return _text(path, source.uri, counter, max_bytes)


def needs_fetch(piece: Piece) -> bool:
    """An S3 Parquet object is downloaded first (its footer and row groups are read at random);
    plain JSONL is streamed by ranged GETs, and .gz, .zst and text objects by one GET each."""
    return piece.source.uri.startswith("s3://") and piece.source.kind == "parquet"


def fetch(uri: str, folder: str) -> str:
    """A local copy of S3 object ``uri`` under ``folder``: readers see every source as a file."""
    from ringtrain.checkpoint.s3 import parse_s3_uri

    bucket, key = parse_s3_uri(uri)
    dest = os.path.join(folder, os.path.basename(key) or "object")
    try:
        _s3_client(bucket).download_file(bucket, key, dest)
    except Exception as exc:  # botocore's errors share no useful base beyond Exception
        raise DataError(f"{uri}: cannot download ({exc})") from None
    return dest
