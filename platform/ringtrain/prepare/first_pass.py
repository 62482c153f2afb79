"""A chat or preference corpus's first pass: a bad record's line found on the driver before any
cluster starts.

Under ``--on-bad-record fail`` a malformed record stops ``prepare``; on Ray it is found only once
the cluster and its actors have started and tokenized up to it (10-20 s on two cores, however
early the line). What a record's own fields can tell (its JSON, its messages field, roles, texts,
weights, tools; a pair's prompt and completions) needs no tokenizer: this pass reads the local
JSONL sources with the actors' own reader and checks each record with their own check
(``chat_records.read_chat`` for a conversation, ``preference_records.read_preference`` for a
pair), stopping at the first bad one. What only the template can tell (a conversation it
refuses) is still found by the actors. The pass costs a read of the corpus, so it runs on
corpora of up to ``FIRST_PASS_BYTES``; a larger one is left to the actors.
"""

from __future__ import annotations

from typing import Any, Callable

from ringtrain.errors import DataError
from ringtrain.prepare.chat_records import BadConversation, Conversation, read_chat
from ringtrain.prepare.preference_records import read_preference
from ringtrain.prepare.sources import BadRecord, LineCounter, Piece, SourceFile, local_bytes, read_records

# The most local JSONL read twice: about a second of JSON parsing a 100 MB on one core.
FIRST_PASS_BYTES = 256 << 20


def check_records(files: list[SourceFile], content: str, field: str, context_fields: frozenset[str], max_bytes: int) -> None:
    """DataError naming the file and line of the first bad record of the local JSONL ``files``,
    read as ``--format`` ``content`` reads them (chat: conversations in ``field``; preference:
    pairs); those of a corpus over ``FIRST_PASS_BYTES`` are not read."""
    check: Callable[[Conversation], Any] = (
        (lambda record: read_preference(record, context_fields)) if content == "preference"
        else (lambda record: read_chat(record, field, context_fields))
    )  # fmt: skip
    jsonl = [f for f in files if f.kind == "jsonl"]
    size = local_bytes(jsonl)
    if not jsonl or size is None or size > FIRST_PASS_BYTES:
        return
    for source in jsonl:
        counter = LineCounter()  # the line of the record just read
        for record in read_records(Piece(0, source), field, counter=counter, max_bytes=max_bytes, chat=True):
            if isinstance(record, BadRecord):
                raise DataError(f"{source.uri}:{record.line}: {record.reason}")
            if isinstance(record, Conversation):
                try:
                    check(record)
                except BadConversation as exc:
                    raise DataError(f"{source.uri}:{counter.lines}: {exc}") from None
