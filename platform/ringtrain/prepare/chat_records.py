"""A chat record of `ringtrain prepare --format chat`: its messages field checked and read as role/content messages.

A record holds one conversation in its ``--messages-field`` (default ``messages``): a list of
messages, each OpenAI-style (``role`` and ``content``; extra keys such as ``tool_calls``,
``name`` or ``tool_call_id`` are kept for the template) or ShareGPT-style (``from`` and
``value``, whose speakers map to the four roles below). A Parquet source holds the field as a
list<struct> column; its rows are read here too, in batches whose decoded size stays bounded
(``parquet_conversations``), like the text path's values (``sources``).

What is wrong with a record (no field, no messages, an unknown role, a message without text)
is a ``BadConversation``: the pipeline makes it a bad record at its line, which
``--on-bad-record`` fails on or skips. This module is pure data handling (no tokenizer).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

DEFAULT_MESSAGES_FIELD = "messages"
MESSAGES_FLAG = "--messages-field"
ROLES = ("system", "user", "assistant", "tool")
# ShareGPT's speakers as its datasets spell them (FastChat, LLaMA-Factory): a function call is
# the assistant's turn, an observation the tool's answer.
SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "function_call": "assistant",
    "observation": "tool",
    "tool": "tool",
}


class BadConversation(ValueError):
    """A record whose conversation cannot be used; the message is the bad record's reason."""


@dataclass(frozen=True)
class Conversation:
    """A record's messages field as read from its file (checked by ``messages``, not yet)."""

    value: Any


def _text(message: dict[str, Any], key: str, where: str) -> str:
    value = message.get(key)
    if not isinstance(value, str):
        raise BadConversation(f"{where}: {key!r} is {type(value).__name__}, not a string")
    return value


def _message(item: Any, where: str) -> dict[str, Any]:
    if not isinstance(item, dict):
        raise BadConversation(f"{where} is {type(item).__name__}, not an object")
    # Parquet structs carry every field of the column's type, absent ones as null.
    item = {k: v for k, v in item.items() if v is not None}
    if "role" in item:
        role = item["role"]
        if role not in ROLES:
            raise BadConversation(f"{where}: unknown role {role!r} (expected {', '.join(ROLES)})")
        # An assistant turn that only calls tools carries no content (OpenAI's format).
        if not (role == "assistant" and "content" not in item and item.get("tool_calls")):
            _text(item, "content", where)
        return item
    if "from" in item:
        speaker = item["from"]
        if speaker not in SHAREGPT_ROLES:
            raise BadConversation(f"{where}: unknown role {speaker!r} (expected {', '.join(SHAREGPT_ROLES)})")
        return {"role": SHAREGPT_ROLES[speaker], "content": _text(item, "value", where)}
    raise BadConversation(f"{where} has neither 'role' (OpenAI) nor 'from' (ShareGPT)")


def messages(value: Any, field: str) -> list[dict[str, Any]]:
    """The conversation in a record's ``field`` as role/content messages, or BadConversation."""
    if not isinstance(value, list):
        kind = "null" if value is None else type(value).__name__
        raise BadConversation(f"field {field!r} is {kind}, not a list of messages")
    if not value:
        raise BadConversation(f"field {field!r} holds no messages")
    return [_message(item, f"field {field!r} message {i + 1}") for i, item in enumerate(value)]


def assistant_turns(conversation: list[dict[str, Any]]) -> list[int]:
    """Indices of the assistant's messages."""
    return [i for i, m in enumerate(conversation) if m["role"] == "assistant"]


# ---- Parquet --------------------------------------------------------------------------------


def _string_leaves(array: Any) -> Iterator[Any]:
    """The string (or dictionary-of-string) arrays inside a struct or list array, recursively."""
    import pyarrow as pa

    kind = array.type
    if pa.types.is_dictionary(kind):
        if pa.types.is_string(kind.value_type) or pa.types.is_large_string(kind.value_type):
            yield array
    elif pa.types.is_string(kind) or pa.types.is_large_string(kind):
        yield array
    elif pa.types.is_struct(kind):
        for i in range(kind.num_fields):
            yield from _string_leaves(array.field(i))


def element_bytes(elements: Any) -> Any:
    """The bytes of each element's strings (a struct message's role, content, ...), as int64 numpy."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    total = np.zeros(len(elements), dtype=np.int64)
    for leaf in _string_leaves(elements):
        if pa.types.is_dictionary(leaf.type):
            # Lengths of the dictionary's values, picked by index: a value repeated in every row
            # is measured, and held, once.
            sizes = np.asarray(pc.binary_length(leaf.dictionary).to_numpy(zero_copy_only=False), dtype=np.int64)
            codes = np.asarray(leaf.indices.fill_null(-1).to_numpy(zero_copy_only=False), dtype=np.int64)
            total += np.where(codes >= 0, sizes[np.maximum(codes, 0)] if sizes.size else 0, 0)
        else:
            total += np.asarray(pc.binary_length(leaf).fill_null(0).to_numpy(zero_copy_only=False), dtype=np.int64)
    return total


def row_bytes(array: Any) -> Any:
    """Each row's bytes of message text in a list<struct> array (null rows 0), before any row is decoded."""
    import numpy as np
    import pyarrow.compute as pc

    lengths = np.asarray(pc.list_value_length(array).fill_null(0).to_numpy(zero_copy_only=False), dtype=np.int64)
    sizes = element_bytes(pc.list_flatten(array))
    cumulative = np.concatenate(([0], np.cumsum(sizes)))
    ends = np.cumsum(lengths)
    return cumulative[ends] - cumulative[ends - lengths]


def _string_leaf_paths(schema: Any, column: str) -> list[int]:
    """Indices of ``column``'s string leaves among the file's leaf columns (``messages.list.
    element.content``, ...)."""
    return [i for i in range(len(schema))
            if schema.column(i).path.startswith(column + ".") and schema.column(i).logical_type.type == "STRING"]  # fmt: skip


def parquet_conversations(piece: Any, path: str, field: str, counter: Any, max_bytes: int, max_messages: int = 0) -> Iterator[Any]:
    """A Parquet piece's conversations (``Conversation`` or ``BadRecord``, in row order) from its
    list<struct> column ``field``.

    The string leaves are read as dictionaries and each row's bytes are measured on the Arrow
    arrays before it is decoded, so a row over ``max_bytes``, or one huge value repeated in
    every row, never becomes Python objects; batches hold about ``PARQUET_BATCH_BYTES`` of rows
    at the row group's mean row size. A row of more than ``max_messages`` messages (0: any) is a
    bad record before it is decoded too: a few bytes of dictionary codes can stand for a million.
    """
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from ringtrain.errors import DataError
    from ringtrain.prepare.render_budget import too_many_messages
    from ringtrain.prepare.sources import PARQUET_BATCH_BYTES, PARQUET_BATCH_ROWS, BadRecord, too_long

    uri = piece.source.uri
    try:
        probe = pq.ParquetFile(path)
        if field not in probe.schema_arrow.names:
            raise DataError(f"{uri}: no column {field!r} ({MESSAGES_FLAG}); columns: {', '.join(probe.schema_arrow.names)}")
        leaves = _string_leaf_paths(probe.schema, field)
        pfile = pq.ParquetFile(path, read_dictionary=[probe.schema.column(i).path for i in leaves])
        kind = pfile.schema_arrow.field(field).type
        end = pfile.metadata.num_row_groups if piece.end is None else piece.end
        for group in range(piece.start, end):
            meta = pfile.metadata.row_group(group)
            size = sum(meta.column(i).total_uncompressed_size for i in leaves)
            rows = max(1, min(PARQUET_BATCH_ROWS, PARQUET_BATCH_BYTES // max(1, size // max(meta.num_rows, 1))))
            for batch in pfile.iter_batches(batch_size=rows, row_groups=[group], columns=[field]):
                array = batch.column(0)
                if not (pa.types.is_list(kind) or pa.types.is_large_list(kind)):
                    for _ in range(len(array)):
                        counter.lines += 1
                        yield BadRecord(counter.lines, f"field {field!r} is {kind}, not a list of messages")
                    continue
                sizes = row_bytes(array).tolist()
                counts = pc.list_value_length(array).fill_null(0).to_pylist()
                for row in range(len(array)):
                    counter.lines += 1
                    many = too_many_messages(counts[row], max_messages) if max_messages else None
                    if sizes[row] > max_bytes:
                        yield BadRecord(counter.lines, too_long(f"field {field!r} ({sizes[row]:,} bytes)", max_bytes))
                    elif many is not None:
                        yield BadRecord(counter.lines, many)
                    else:
                        yield Conversation(array[row].as_py())
    except (pa.ArrowException, OSError) as exc:
        raise DataError(f"{uri}: not a readable Parquet file ({exc})") from None
