"""A source file's bytes in bounded pieces: decompressed chunks, and the lines of a byte range.

Whatever a corpus holds, a reader's memory stays bounded:

- zstd: a 1 MiB chunk of a zstd stream can decompress to about 32 GiB (each 4-byte RLE block is
  128 KiB of output), and the decompressor returns everything one input chunk yields at once.
  So the input goes in ``ZSTD_FEED`` bytes at a time: 1 KiB completes at most a few hundred
  blocks, tens of MiB of output. The window a frame may ask for is capped too
  (``ZSTD_MAX_WINDOW``, zstd's own default limit, set explicitly); a frame wanting more is corrupt.
- gzip: ``read(n)`` already returns at most n bytes.
- lines: a line is held only up to ``max_bytes``; past that it is reported as a ``LongLine``
  (the caller makes it a bad record) and the rest of its bytes are dropped as they come. A
  line's pieces are joined once, when it ends (joining on every chunk would copy a long line
  over and over).
"""

from __future__ import annotations

import gzip
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO, Optional, Union

READ_CHUNK = 1 << 20
ZSTD_FEED = 1 << 10
ZSTD_MAX_WINDOW = 1 << 27


@dataclass(frozen=True)
class LongLine:
    """A line that grew past the limit: reported when it does, before its end is read."""


Line = Union[bytes, LongLine]


def zstd_chunks(raw: IO[bytes]) -> Iterator[bytes]:
    """Decompressed chunks of a zstd file of one or more frames; a frame cut short raises ZstdError
    (zstandard's stream reader would end quietly, losing the rest of a truncated file)."""
    import zstandard

    decompressor = zstandard.ZstdDecompressor(max_window_size=ZSTD_MAX_WINDOW)
    dobj = decompressor.decompressobj()
    pending = False  # input fed to a frame that has not ended
    while block := raw.read(READ_CHUNK):
        view = memoryview(block)
        for at in range(0, len(view), ZSTD_FEED):
            data: bytes | memoryview = view[at : at + ZSTD_FEED]
            while data:
                out = dobj.decompress(data)
                pending = not dobj.eof
                if out:
                    yield out
                data = dobj.unused_data if dobj.eof else b""
                if dobj.eof:
                    dobj = decompressor.decompressobj()
    if pending:
        raise zstandard.ZstdError("the file ends inside a frame (truncated)")


def decompressed_chunks(raw: IO[bytes], name: str) -> Iterator[bytes]:
    """The decompressed bytes of the stream ``raw`` of file ``name`` (plain, .gz or .zst by its
    suffix), in bounded chunks: read as they are needed, never whole."""
    lower = name.lower()
    if lower.endswith(".zst"):
        yield from zstd_chunks(raw)
        return
    stream = gzip.GzipFile(fileobj=raw, mode="rb") if lower.endswith(".gz") else raw
    while chunk := stream.read(READ_CHUNK):
        yield chunk


def lines(chunks: Iterator[bytes], start: int = 0, end: Optional[int] = None, max_bytes: Optional[int] = None) -> Iterator[Line]:
    """The lines of the byte range [start, end) of a file whose bytes from ``start`` are ``chunks``;
    a line over ``max_bytes`` comes as a ``LongLine`` as soon as it passes the limit.

    The line-split rule (Hadoop's LineRecordReader): a range that does not begin the file skips
    through the first newline at or after ``start`` (that line belongs to the range before), and
    reads every line that starts at or before ``end``, the last one to its newline past ``end``.
    So adjacent ranges meet at one newline and each line is read exactly once. ``end`` None: to
    the end of the file.

    A range stops reading once no line can start in it any more: when the line it skips, or a
    long line it has reported, runs past ``end``. So a 1 GiB line is read once, by the range it
    starts in, up to the limit, not to its end by every range it spans.
    """
    pos = start  # file offset of the line being gathered
    parts: list[bytes] = []  # its bytes so far, while it fits the limit
    size = 0  # its length so far
    skipping = start > 0
    reported = False  # the line passed the limit and was reported
    for chunk in chunks:
        segments = chunk.split(b"\n")
        for piece in segments[:-1]:  # each of these ends a line
            size += len(piece)
            if skipping:
                skipping = False
            elif not reported:
                if end is not None and pos > end:
                    return
                yield _ended(parts, piece, size, max_bytes)
            pos += size + 1
            parts, size, reported = [], 0, False
        tail = segments[-1]
        if tail:
            size += len(tail)
            if skipping or reported:
                pass  # bytes of a line that is not this range's, or already reported
            elif max_bytes is not None and size > max_bytes:
                if end is not None and pos > end:
                    return
                yield LongLine()
                parts, reported = [], True
            else:
                parts.append(tail)
        if end is not None and (pos > end or ((skipping or reported) and pos + size >= end)):
            return  # no line of the rest of the file starts in this range: do not read it
    if size and not skipping and not reported and (end is None or pos <= end):
        yield _ended(parts, b"", size, max_bytes)


def _ended(parts: list[bytes], last: bytes, size: int, max_bytes: Optional[int]) -> Line:
    if max_bytes is not None and size > max_bytes:
        return LongLine()
    return b"".join((*parts, last)) if parts else last
