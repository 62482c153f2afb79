"""The chat corpus's first pass: a bad record's line found on the driver before any cluster starts.

Under ``--on-bad-record fail`` a malformed record stops ``prepare``; on Ray it is found only once
the cluster and its actors have started and tokenized up to it (10-20 s on two cores, however
early the line). What a record's own fields can tell (its JSON, its messages field, roles, texts,
weights, tools) needs no tokenizer: this pass reads the local JSONL sources with the actors'
own reader and checks each record with their own check (``chat_records.read_chat``), stopping at
the first bad one. What only the template can tell (a conversation it refuses) is still found by
the actors. The pass costs a read of the corpus, so it runs on corpora of up to
``FIRST_PASS_BYTES``; a larger one is left to the actors.
"""

from __future__ import annotations

from ringtrain.errors import DataError
from ringtrain.prepare.chat_records import BadConversation, Conversation, read_chat
from ringtrain.prepare.sources import BadRecord, LineCounter, Piece, SourceFile, local_bytes, read_records

# The most local JSONL read twice: about a second of JSON parsing a 100 MB on one core.
FIRST_PASS_BYTES = 256 << 20


def check_chat_records(files: list[SourceFile], field: str, context_fields: frozenset[str], max_bytes: int) -> None:
    """DataError naming the file and line of the first bad record of the local JSONL ``files``
    (those of a corpus over ``FIRST_PASS_BYTES`` are not read)."""
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
                    read_chat(record, field, context_fields)
                except BadConversation as exc:
                    raise DataError(f"{source.uri}:{counter.lines}: {exc}") from None
