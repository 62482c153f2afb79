"""The input of `ringtrain prepare`: SRC arguments expanded to files, and each file read as documents.

A source file is JSONL (``.jsonl``/``.ndjson``, plain, ``.gz`` or ``.zst``), Parquet, or plain
text (``.txt``/``.md``: the whole file is one document). Folders, globs and ``s3://`` prefixes
expand to the files of those kinds under them, sorted, so the document order is a function of
the arguments alone. A record that cannot be used (malformed JSON, no text field) is a
``BadRecord``: the caller fails on it or skips it. A file that cannot be read at all (corrupt
compressed stream, unreadable Parquet) raises ``DataError`` naming it.
"""

from __future__ import annotations

import glob
import gzip
import json
import os
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Union

from ringtrain.errors import ConfigError, DataError

JSONL_SUFFIXES = (".jsonl", ".ndjson")
COMPRESSED_SUFFIXES = ("", ".gz", ".zst")
PARQUET_SUFFIXES = (".parquet",)
TEXT_SUFFIXES = (".txt", ".md")
SRC_KEY = "SRC"
# Parquet rows read per batch: bounds a reader's memory whatever the file's size.
PARQUET_BATCH_ROWS = 1024


@dataclass(frozen=True)
class SourceFile:
    index: int  # position in the expanded, ordered list: the first key of the document order
    uri: str  # a local path (as the user spelled it) or s3://bucket/key
    kind: str  # "jsonl" | "parquet" | "text"


@dataclass(frozen=True)
class BadRecord:
    line: int  # 1-based line (JSONL) or row (Parquet)
    reason: str


Record = Union[str, BadRecord]


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
            found += _expand_local(match) if Path(match).is_dir() else _known([match])
        return found
    if path.is_dir():
        files = [str(p) for p in path.rglob("*") if p.is_file()]
        return _known(files)
    if not path.exists():
        raise ConfigError(SRC_KEY, f"{arg} does not exist")
    if kind_of(path.name) is None:
        raise ConfigError(SRC_KEY, f"{arg}: unknown format (expected .jsonl[.gz|.zst], .ndjson, .parquet, .txt or .md)")
    return [str(path)]


def _expand_s3(arg: str) -> list[str]:
    from ringtrain.checkpoint.options import S3Options
    from ringtrain.checkpoint.s3 import S3Backend, parse_s3_uri

    try:
        bucket, prefix = parse_s3_uri(arg)
    except ValueError:
        raise ConfigError(SRC_KEY, f"{arg}: expected s3://bucket/prefix") from None
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


# ---- reading one file ------------------------------------------------------------------------


READ_CHUNK = 1 << 20


def _zstd_chunks(raw: IO[bytes]) -> Iterator[bytes]:
    """Decompressed chunks of a zstd file of one or more frames; a frame cut short raises ZstdError
    (zstandard's stream reader would end quietly, losing the rest of a truncated file)."""
    import zstandard

    dobj = zstandard.ZstdDecompressor().decompressobj()
    pending = False  # input fed to a frame that has not ended
    while chunk := raw.read(READ_CHUNK):
        while chunk:
            out = dobj.decompress(chunk)
            pending = not dobj.eof
            if out:
                yield out
            chunk = dobj.unused_data if dobj.eof else b""
            if dobj.eof:
                dobj = zstandard.ZstdDecompressor().decompressobj()
    if pending:
        raise zstandard.ZstdError("the file ends inside a frame (truncated)")


def _chunks(path: str) -> Iterator[bytes]:
    """The decompressed bytes of a (plain, .gz or .zst) file, in chunks."""
    lower = path.lower()
    if lower.endswith(".zst"):
        with open(path, "rb") as raw:
            yield from _zstd_chunks(raw)
        return
    with gzip.open(path, "rb") if lower.endswith(".gz") else open(path, "rb") as stream:
        while chunk := stream.read(READ_CHUNK):
            yield chunk


def _lines(chunks: Iterator[bytes]) -> Iterator[bytes]:
    rest = b""
    for chunk in chunks:
        *lines, rest = (rest + chunk).split(b"\n")
        yield from lines
    if rest:
        yield rest


def _corrupt_errors() -> tuple[type[BaseException], ...]:
    import zstandard

    return (gzip.BadGzipFile, EOFError, zlib.error, zstandard.ZstdError)


def _jsonl(path: str, uri: str, text_field: str) -> Iterator[Record]:
    line_no = 0
    try:
        for line_no, line in enumerate(_lines(_chunks(path)), start=1):
            if not line.strip():
                continue  # blank lines (a trailing newline too) are not records
            yield _record(line, line_no, text_field)
    except _corrupt_errors() as exc:
        raise DataError(f"{uri}: corrupt compressed data after line {line_no} ({exc or type(exc).__name__})") from None
    except OSError as exc:
        raise DataError(f"{uri}: cannot read after line {line_no} ({exc})") from None


def _record(line: bytes, line_no: int, text_field: str) -> Record:
    try:
        obj: Any = json.loads(line)
    except (ValueError, UnicodeDecodeError) as exc:
        return BadRecord(line_no, f"malformed JSON ({exc})")
    if not isinstance(obj, dict):
        return BadRecord(line_no, f"expected a JSON object, got {type(obj).__name__}")
    if text_field not in obj:
        return BadRecord(line_no, f"no field {text_field!r} (--text-field)")
    text = obj[text_field]
    if not isinstance(text, str):
        return BadRecord(line_no, f"field {text_field!r} is {type(text).__name__}, not a string")
    return text


def _parquet(path: str, uri: str, text_field: str) -> Iterator[Record]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pfile = pq.ParquetFile(path)
        if text_field not in pfile.schema_arrow.names:
            raise DataError(f"{uri}: no column {text_field!r} (--text-field); columns: {', '.join(pfile.schema_arrow.names)}")
        row = 0
        for batch in pfile.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=[text_field]):
            for value in batch.column(0).to_pylist():
                row += 1
                yield value if isinstance(value, str) else BadRecord(row, f"field {text_field!r} is {type(value).__name__}, not a string")
    except (pa.ArrowException, OSError) as exc:
        raise DataError(f"{uri}: not a readable Parquet file ({exc})") from None


def _text(path: str, uri: str) -> Iterator[Record]:
    try:
        yield Path(path).read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        yield BadRecord(1, f"not UTF-8 text ({exc})")
    except OSError as exc:
        raise DataError(f"{uri}: cannot read ({exc})") from None


def read_records(source: SourceFile, text_field: str, local: str | None = None) -> Iterator[Record]:
    """The records of ``source`` in file order: a document's text or a BadRecord.

    ``local`` is where the file's bytes are when they are not at ``source.uri`` (an S3 object
    downloaded first); errors still name the URI.
    """
    path = local or source.uri.removeprefix("file://")
    if source.kind == "jsonl":
        return _jsonl(path, source.uri, text_field)
    if source.kind == "parquet":
        return _parquet(path, source.uri, text_field)
    return _text(path, source.uri)


def fetch(uri: str, folder: str) -> str:
    """A local copy of S3 object ``uri`` under ``folder``: readers see every source as a file."""
    from ringtrain.checkpoint.options import S3Options
    from ringtrain.checkpoint.s3 import S3Backend, parse_s3_uri

    bucket, key = parse_s3_uri(uri)
    dest = os.path.join(folder, os.path.basename(key) or "object")
    try:
        S3Backend(bucket, "", S3Options()).client.download_file(bucket, key, dest)
    except Exception as exc:  # botocore's errors share no useful base beyond Exception
        raise DataError(f"{uri}: cannot download ({exc})") from None
    return dest
