"""The pages of a Parquet column chunk as their headers state them, read before Arrow decodes any.

Arrow allocates a page's stated decoded size and decompresses it whole, whatever the batch size
it is asked for: one zstd page of a few KB can state 2 GiB (and must then decompress to exactly
that, or Arrow refuses it). The row group's metadata is no guard, since a file may state any
sizes there. So the reader walks the chunk's page headers first (Thrift compact protocol,
parquet.thrift's ``PageHeader``) and learns each page's decoded size and row count from the
same bytes Arrow will trust.

Only the fields needed are kept; every other field is skipped by its type. A header is read in
a growing window up to ``MAX_HEADER_BYTES`` (Arrow's own default cap), nested at most
``MAX_DEPTH`` structs and lists deep.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any, BinaryIO

# Arrow's default limit on one page header (statistics may make it long).
MAX_HEADER_BYTES = 16 << 20
FIRST_WINDOW = 1 << 10
MAX_DEPTH = 32

DATA_PAGE, INDEX_PAGE, DICTIONARY_PAGE, DATA_PAGE_V2 = 0, 1, 2, 3

# Thrift compact protocol type codes.
_STOP, _TRUE, _FALSE, _BYTE, _I16, _I32, _I64, _DOUBLE, _BINARY, _LIST, _SET, _MAP, _STRUCT, _UUID = range(14)
# PageHeader's fields (parquet.thrift) that are kept.
_TYPE, _UNCOMPRESSED, _COMPRESSED = 1, 2, 3
_DATA_HEADER, _DICTIONARY_HEADER, _DATA_HEADER_V2 = 5, 7, 8
# Their nested headers' fields that are kept: values (rows, for v2) and the data's encoding.
_NESTED = {
    _DATA_HEADER: {1: "values", 2: "encoding"},
    _DICTIONARY_HEADER: {1: "values"},
    _DATA_HEADER_V2: {3: "values", 4: "encoding"},
}
# PLAIN_DICTIONARY and RLE_DICTIONARY: a data page of codes into the chunk's dictionary page.
DICTIONARY_ENCODINGS = (2, 8)


class PageError(ValueError):
    """A page header that cannot be read: the file is corrupt (or built to mislead)."""


FieldReader = Callable[[int, int, int], bool]  # (field, type, depth) -> consumed it


class _Short(Exception):
    """The window ended inside the header: read a longer one."""


@dataclass(frozen=True)
class Page:
    kind: int  # DATA_PAGE, INDEX_PAGE, DICTIONARY_PAGE or DATA_PAGE_V2
    decoded_bytes: int  # what Arrow allocates to decompress it
    stored_bytes: int
    values: int  # values (for a flat column: rows) it holds; 0 for index pages
    coded: bool = False  # a data page of codes into the dictionary page
    header_bytes: int = 0

    @property
    def is_data(self) -> bool:
        return self.kind in (DATA_PAGE, DATA_PAGE_V2)


class _Reader:
    """Thrift compact protocol over a bytes window."""

    def __init__(self, data: bytes) -> None:
        self.data, self.pos = data, 0

    def byte(self) -> int:
        if self.pos >= len(self.data):
            raise _Short
        self.pos += 1
        return self.data[self.pos - 1]

    def varint(self) -> int:
        value, shift = 0, 0
        while True:
            b = self.byte()
            value |= (b & 0x7F) << shift
            if not b & 0x80:
                return value
            shift += 7
            if shift > 63:
                raise PageError("a varint longer than 10 bytes")

    def zigzag(self) -> int:
        n = self.varint()
        return (n >> 1) ^ -(n & 1)

    def skip_bytes(self, n: int) -> None:
        if n < 0:
            raise PageError("a negative length")
        if self.pos + n > len(self.data):
            raise _Short
        self.pos += n

    def skip(self, kind: int, depth: int) -> None:
        """Skip one value of compact type ``kind``."""
        if depth > MAX_DEPTH:
            raise PageError(f"nested more than {MAX_DEPTH} deep")
        if kind in (_TRUE, _FALSE):
            return  # a field's bool is in its type code
        if kind == _BYTE:
            self.skip_bytes(1)
        elif kind in (_I16, _I32, _I64):
            self.varint()
        elif kind == _DOUBLE:
            self.skip_bytes(8)
        elif kind == _UUID:
            self.skip_bytes(16)
        elif kind == _BINARY:
            self.skip_bytes(self.varint())
        elif kind in (_LIST, _SET):
            head = self.byte()
            size, elem = head >> 4, head & 0x0F
            if size == 15:
                size = self.varint()
            for _ in range(size):
                if elem in (_TRUE, _FALSE):
                    self.skip_bytes(1)  # a list's bools take a byte each
                else:
                    self.skip(elem, depth + 1)
        elif kind == _MAP:
            size = self.varint()
            if size:
                types = self.byte()
                for _ in range(size):
                    self.skip(types >> 4, depth + 1)
                    self.skip(types & 0x0F, depth + 1)
        elif kind == _STRUCT:
            self.struct(depth + 1, lambda field, kind, depth: False)
        else:
            raise PageError(f"unknown Thrift type {kind}")

    def struct(self, depth: int, read: FieldReader) -> None:
        """Read a struct's fields: ``read`` consumes those it wants (returns True), the rest are skipped."""
        field = 0
        while True:
            head = self.byte()
            kind = head & 0x0F
            if kind == _STOP:
                return
            delta = head >> 4
            field = field + delta if delta else self.zigzag()
            if not read(field, kind, depth):
                self.skip(kind, depth)


def _header(data: bytes) -> tuple[Page, int]:
    """The page header at the start of ``data`` and its length; _Short when ``data`` ends inside it."""
    reader = _Reader(data)
    top: dict[int, int] = {}  # PageHeader's kept fields by number
    nested: dict[str, int] = {}  # the kept fields of its data or dictionary page header

    def kept(names: dict[int, str]) -> FieldReader:
        def read(field: int, kind: int, depth: int) -> bool:
            if field in names and kind == _I32:
                nested[names[field]] = reader.zigzag()
                return True
            return False

        return read

    def fields(field: int, kind: int, depth: int) -> bool:
        if kind == _I32 and field in (_TYPE, _UNCOMPRESSED, _COMPRESSED):
            top[field] = reader.zigzag()
            return True
        if kind == _STRUCT and field in _NESTED:
            reader.struct(depth + 1, kept(_NESTED[field]))
            return True
        return False

    reader.struct(0, fields)
    try:
        page = Page(top[_TYPE], top[_UNCOMPRESSED], top[_COMPRESSED], nested.get("values", 0),
                    nested.get("encoding", -1) in DICTIONARY_ENCODINGS)  # fmt: skip
    except KeyError:
        raise PageError("a page header without its type or sizes") from None
    if page.decoded_bytes < 0 or page.stored_bytes < 0 or page.values < 0:
        raise PageError("a page header with a negative size or count")
    return page, reader.pos


def pages(stream: BinaryIO, start: int, length: int) -> Iterator[Page]:
    """The pages of the column chunk stored at bytes [start, start + length) of ``stream``."""
    end = start + length
    pos = start
    while pos < end:
        window = FIRST_WINDOW
        while True:
            stream.seek(pos)
            data = stream.read(min(window, end - pos))
            try:
                page, size = _header(data)
                break
            except _Short:
                if len(data) < window or window >= MAX_HEADER_BYTES:
                    raise PageError(f"a page header at byte {pos} runs past its column chunk") from None
                window *= 4
        if pos + size + page.stored_bytes > end:
            raise PageError(f"a page at byte {pos} runs past its column chunk")
        pos += size + page.stored_bytes
        yield replace(page, header_bytes=size)


@dataclass(frozen=True)
class Chunk:
    """What a reader needs to know of a column chunk's pages before decoding any."""

    largest: int  # the most bytes one page decodes to (the dictionary page included)
    dictionary_bytes: int  # what its dictionary page decodes to (0: none): no value is longer
    density: int  # the most decoded bytes per value of a data page that is not codes
    values: int  # values in the data pages
    all_coded: bool  # every data page holds codes into the dictionary (none fell back to plain)


def chunk(stream: BinaryIO, meta: Any) -> Chunk:
    """The pages of the column chunk ``meta`` (pyarrow's ``ColumnChunkMetaData``) summed up, walked
    from where Arrow starts reading it: its dictionary page when that comes first."""
    start = meta.data_page_offset
    if meta.has_dictionary_page and 0 < meta.dictionary_page_offset < start:
        start = meta.dictionary_page_offset
    largest, dictionary, density, values, all_coded = 0, 0, 1, 0, True
    for page in pages(stream, start, meta.total_compressed_size):
        largest = max(largest, page.decoded_bytes)
        if page.kind == DICTIONARY_PAGE:
            dictionary = max(dictionary, page.decoded_bytes)
        elif page.is_data:
            values += page.values
            all_coded = all_coded and page.coded
            if not page.coded:
                density = max(density, -(-page.decoded_bytes // max(page.values, 1)))
    return Chunk(largest, dictionary, density, values, all_coded and dictionary > 0)
