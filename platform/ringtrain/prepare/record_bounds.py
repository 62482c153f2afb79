"""The bounds a source reader keeps to, and what it reports past them: a ``BadRecord``, which the
caller fails on or skips (``--on-bad-record``). Shared by the readers of every format
(``sources``) and the chat reader of Parquet conversations (``chat_records``).
"""

from __future__ import annotations

from dataclasses import dataclass

# Parquet rows read per batch, at most, and the bytes a batch's rows should come to (by the
# densest page's bytes per row): bounds a reader's memory whatever the file's size. A page of
# the text column decodes to at most PARQUET_PAGE_BYTES (or twice the record limit, if more).
PARQUET_BATCH_ROWS = 1024
PARQUET_BATCH_BYTES = 64 << 20
PARQUET_PAGE_BYTES = 64 << 20
# The longest record (a JSONL line, a Parquet value, a text file) read: far beyond any context a
# model trains at (16 MiB is about 4M tokens), far below what would exhaust a reader.
DEFAULT_MAX_RECORD_BYTES = 16 << 20
MAX_RECORD_FLAG = "--max-record-bytes"


@dataclass(frozen=True)
class BadRecord:
    line: int  # 1-based line (JSONL) or row (Parquet)
    reason: str
    # Stops the run even under --on-bad-record skip: what is wrong is not the record's (a chat
    # template that cannot be masked, seen on this record).
    fatal: bool = False


def too_long(what: str, limit: int) -> str:
    """A bad record's reason: ``what`` (a line, a value, a file) is longer than ``limit``."""
    return f"{what} is over the {limit:,}-byte limit ({MAX_RECORD_FLAG})"
