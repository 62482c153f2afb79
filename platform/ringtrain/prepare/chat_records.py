"""A chat record of `ringtrain prepare --format chat`: its conversation checked and read as role/content messages.

A record holds one conversation in its ``--messages-field`` (default ``messages``): a list of
messages, each OpenAI-style (``role`` and ``content``; extra keys such as ``tool_calls``,
``name`` or ``tool_call_id`` are kept for the template) or ShareGPT-style (``from`` and
``value``, whose speakers map to the four roles below). A record without that field but with
Alpaca's ``instruction`` and ``output`` (and an optional ``input``) is one user turn and one
assistant turn. A Parquet source holds the field as a list<struct> column; its rows are read
here too, in batches whose decoded size stays bounded (``parquet_conversations``), like the text
path's values (``sources``).

A message may say whether it is trained, whatever its role: OpenAI's fine-tuning format marks
assistant messages ``"weight": 0`` or ``1``, axolotl's datasets ``"train": false`` or ``true``.
The flag is taken out of the message (the template never sees it) and kept beside it.

The record's other fields that the chat template reads (``tools``, ``documents``, a record-level
``system``, ``enable_thinking``, ...: ``ChatTemplate.variables``) go to the template as
transformers' ``apply_chat_template`` passes them; a field the template does not read is ignored.

What is wrong with a record (no field, no messages, an unknown role, a message without text, a
flag that is neither 0 nor 1) is a ``BadConversation``: the pipeline makes it a bad record at its
line, which ``--on-bad-record`` fails on or skips. This module is pure data handling (no tokenizer).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Optional

from ringtrain.prepare.record_bounds import PARQUET_BATCH_BYTES, PARQUET_BATCH_ROWS, BadRecord, too_long
from ringtrain.prepare.render_budget import too_many_messages
from ringtrain.prepared import CHAT_ROLES as ROLES

DEFAULT_MESSAGES_FIELD = "messages"
MESSAGES_FLAG = "--messages-field"
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


# A message's own training flag, as each format spells it.
WEIGHT_KEY = "weight"  # OpenAI fine-tuning: 0 or 1
TRAIN_KEY = "train"  # axolotl: false or true
# Alpaca's instruction records: the instruction, an optional input, the answer.
ALPACA_FIELDS = ("instruction", "input", "output")
# Record-level values the template takes as named arguments of apply_chat_template; any other
# field it reads goes in as a keyword of its own.
TOOLS_FIELD, DOCUMENTS_FIELD = "tools", "documents"


class BadConversation(ValueError):
    """A record whose conversation cannot be used; the message is the bad record's reason."""


@dataclass(frozen=True)
class Conversation:
    """A chat record as read from its file: its fields by name (a JSON object's, or the Parquet
    columns read), checked by ``read_chat``, not yet."""

    fields: dict[str, Any]


@dataclass(frozen=True)
class ChatRecord:
    """A checked conversation: its messages as the template renders them, each message's own
    training flag (None: its role decides), and the record's fields the template reads."""

    messages: list[dict[str, Any]]
    flags: tuple[Optional[bool], ...] = ()
    context: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.flags:
            object.__setattr__(self, "flags", (None,) * len(self.messages))


def _text(message: dict[str, Any], key: str, where: str) -> str:
    value = message.get(key)
    if not isinstance(value, str):
        raise BadConversation(f"{where}: {key!r} is {type(value).__name__}, not a string")
    return value


def _flag(item: dict[str, Any], where: str) -> Optional[bool]:
    """The message's own training flag, taken out of it: None where it has none."""
    weight, train = item.pop(WEIGHT_KEY, None), item.pop(TRAIN_KEY, None)
    if weight is not None and (isinstance(weight, bool) or weight not in (0, 1)):
        raise BadConversation(f"{where}: {WEIGHT_KEY!r} is {weight!r}; a message's weight is 0 or 1")
    if train is not None and not isinstance(train, bool):
        raise BadConversation(f"{where}: {TRAIN_KEY!r} is {train!r}, not true or false")
    if weight is not None and train is not None and bool(weight) != train:
        raise BadConversation(f"{where}: {WEIGHT_KEY!r} {weight!r} and {TRAIN_KEY!r} {train!r} disagree")
    return bool(weight) if weight is not None else train


def _message(item: Any, where: str) -> tuple[dict[str, Any], Optional[bool]]:
    if not isinstance(item, dict):
        raise BadConversation(f"{where} is {type(item).__name__}, not an object")
    # Parquet structs carry every field of the column's type, absent ones as null.
    item = {k: v for k, v in item.items() if v is not None}
    flag = _flag(item, where)
    return _role_content(item, where), flag


def _role_content(item: dict[str, Any], where: str) -> dict[str, Any]:
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


def messages(value: Any, field: str) -> tuple[list[dict[str, Any]], tuple[Optional[bool], ...]]:
    """The conversation in a record's ``field`` as role/content messages and each message's own
    training flag, or BadConversation."""
    if not isinstance(value, list):
        kind = "null" if value is None else type(value).__name__
        raise BadConversation(f"field {field!r} is {kind}, not a list of messages")
    if not value:
        raise BadConversation(f"field {field!r} holds no messages")
    read = [_message(item, f"field {field!r} message {i + 1}") for i, item in enumerate(value)]
    return [m for m, _ in read], tuple(f for _, f in read)


def _alpaca(fields: dict[str, Any]) -> list[dict[str, Any]]:
    """An Alpaca record as a user turn (the instruction, then the input after a blank line when
    there is one) and an assistant turn (the output)."""
    values = {}
    for name in ALPACA_FIELDS:
        value = fields.get(name)
        if value is not None and not isinstance(value, str):
            raise BadConversation(f"field {name!r} is {type(value).__name__}, not a string")
        values[name] = value or ""
    prompt = values["instruction"] + (f"\n\n{values['input']}" if values["input"] else "")
    return [{"role": "user", "content": prompt}, {"role": "assistant", "content": values["output"]}]


def _is_alpaca(fields: dict[str, Any]) -> bool:
    return fields.get("instruction") is not None and fields.get("output") is not None


def _context_value(name: str, value: Any) -> Any:
    """A record-level field as the template gets it: tools and documents are lists of objects
    (a string holding one as JSON, as many datasets store tools, is read)."""
    if name not in (TOOLS_FIELD, DOCUMENTS_FIELD):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise BadConversation(f"field {name!r} is a string that is not JSON") from None
    if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
        raise BadConversation(f"field {name!r} is {type(value).__name__}, not a list of objects")
    return value


def read_chat(record: Conversation, field: str, context_fields: frozenset[str] = frozenset()) -> ChatRecord:
    """A record's conversation checked: from its ``field``, or an Alpaca record's fields; with the
    record's ``context_fields`` (those the template reads) it holds. BadConversation otherwise."""
    fields = record.fields
    if field in fields:
        turns, flags = messages(fields[field], field)
        taken = {field}
    elif _is_alpaca(fields):
        turns, flags, taken = _alpaca(fields), (None, None), {field, *ALPACA_FIELDS}
    else:
        raise BadConversation(f"no field {field!r} ({MESSAGES_FLAG}), nor Alpaca's 'instruction' and 'output'")
    return ChatRecord(turns, flags, context_of(fields, taken, context_fields))


def context_of(fields: dict[str, Any], taken: set[str], context_fields: frozenset[str]) -> dict[str, Any]:
    """The record's ``context_fields`` it holds, but for those ``taken`` as its conversation."""
    return {name: _context_value(name, fields[name]) for name in sorted(context_fields - taken)
            if fields.get(name) is not None}  # fmt: skip


def assistant_turns(conversation: list[dict[str, Any]]) -> list[int]:
    """Indices of the assistant's messages."""
    return [i for i, m in enumerate(conversation) if m["role"] == "assistant"]


# ---- Parquet --------------------------------------------------------------------------------


def value_bytes(array: Any) -> Any:
    """The bytes of each element's strings, as int64 numpy, whatever nests them: a struct's
    fields added up, a list's elements added up per row (null rows 0); other values count 0.

    A dictionary-encoded string is measured by its dictionary's value lengths picked by index,
    so a value repeated in every row is measured, and held, once.
    """
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    kind = array.type
    if pa.types.is_dictionary(kind):
        if not (pa.types.is_string(kind.value_type) or pa.types.is_large_string(kind.value_type)):
            return np.zeros(len(array), dtype=np.int64)
        sizes = np.asarray(pc.binary_length(array.dictionary).to_numpy(zero_copy_only=False), dtype=np.int64)
        codes = np.asarray(array.indices.fill_null(-1).to_numpy(zero_copy_only=False), dtype=np.int64)
        return np.where(codes >= 0, sizes[np.maximum(codes, 0)] if sizes.size else 0, 0)
    if pa.types.is_string(kind) or pa.types.is_large_string(kind):
        return np.asarray(pc.binary_length(array).fill_null(0).to_numpy(zero_copy_only=False), dtype=np.int64)
    if pa.types.is_struct(kind):
        total = np.zeros(len(array), dtype=np.int64)
        for i in range(kind.num_fields):
            total += value_bytes(array.field(i))
        return total
    if pa.types.is_list(kind) or pa.types.is_large_list(kind):
        lengths = np.asarray(pc.list_value_length(array).fill_null(0).to_numpy(zero_copy_only=False), dtype=np.int64)
        cumulative = np.concatenate(([0], np.cumsum(value_bytes(pc.list_flatten(array)))))
        ends = np.cumsum(lengths)
        return cumulative[ends] - cumulative[ends - lengths]
    return np.zeros(len(array), dtype=np.int64)


def _string_leaf_paths(schema: Any, columns: list[str]) -> list[int]:
    """Indices of the string leaves of ``columns`` among the file's leaf columns (``messages.list.
    element.content``, a string column itself, ...)."""
    return [i for i in range(len(schema)) if schema.column(i).logical_type.type == "STRING"
            and any(schema.column(i).path == c or schema.column(i).path.startswith(c + ".") for c in columns)]  # fmt: skip


def _columns(names: list[str], field: str, context_fields: frozenset[str],
             record_fields: tuple[str, ...] = ()) -> tuple[list[str], list[str]]:  # fmt: skip
    """The columns a chat record is read from: its own (``record_fields`` where given, a
    preference pair's; else ``field``, or Alpaca's), then the context's."""
    if record_fields:
        taken = [n for n in record_fields if n in names]
    elif field in names:
        taken = [field]
    elif "instruction" in names and "output" in names:
        taken = [n for n in ALPACA_FIELDS if n in names]
    else:
        return [], []
    return taken, sorted(n for n in context_fields if n in names and n not in taken)


def parquet_conversations(
    piece: Any, path: str, field: str, counter: Any, max_bytes: int, context_fields: frozenset[str] = frozenset(),
    record_fields: tuple[str, ...] = (), max_messages: int = 0,
) -> Iterator[Any]:
    """A Parquet piece's conversations (``Conversation`` or ``BadRecord``, in row order) from its
    list<struct> column ``field`` (or Alpaca's string columns), with the ``context_fields``
    columns the template reads.

    The string leaves are read as dictionaries and each row's bytes, over all its columns, are
    measured on the Arrow arrays before it is decoded, so a row over ``max_bytes``, or one huge
    value repeated in every row, never becomes Python objects; batches hold about
    ``PARQUET_BATCH_BYTES`` of rows at the row group's mean row size. A row of more than
    ``max_messages`` messages (0: any) is a bad record before it is decoded too: a few bytes of
    dictionary codes can stand for a million.
    """
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from ringtrain.errors import DataError

    uri = piece.source.uri
    try:
        probe = pq.ParquetFile(path)
        own, context = _columns(probe.schema_arrow.names, field, context_fields, record_fields)
        columns, taken = own + context, len(own)
        if not columns:
            wanted = (f"none of the columns {', '.join(record_fields)}" if record_fields
                      else f"no column {field!r} ({MESSAGES_FLAG}), nor Alpaca's instruction and output")  # fmt: skip
            raise DataError(f"{uri}: {wanted}; columns: {', '.join(probe.schema_arrow.names)}")
        leaves = _string_leaf_paths(probe.schema, columns)
        pfile = pq.ParquetFile(path, read_dictionary=[probe.schema.column(i).path for i in leaves])
        kind = probe.schema_arrow.field(columns[0]).type  # as written, before reading strings as dictionaries
        end = pfile.metadata.num_row_groups if piece.end is None else piece.end
        for group in range(piece.start, end):
            meta = pfile.metadata.row_group(group)
            size = sum(meta.column(i).total_uncompressed_size for i in leaves)
            rows = max(1, min(PARQUET_BATCH_ROWS, PARQUET_BATCH_BYTES // max(1, size // max(meta.num_rows, 1))))
            for batch in pfile.iter_batches(batch_size=rows, row_groups=[group], columns=columns):
                arrays = [batch.column(i) for i in range(len(columns))]
                if not record_fields and columns[0] == field and not (pa.types.is_list(kind) or pa.types.is_large_list(kind)):
                    for _ in range(batch.num_rows):
                        counter.lines += 1
                        yield BadRecord(counter.lines, f"field {field!r} is {kind}, not a list of messages")
                    continue
                sizes = sum(value_bytes(a) for a in arrays).tolist()
                what = f"field {field!r}" if len(columns) == 1 else f"fields {', '.join(map(repr, columns))}"
                # The messages of the record's own columns (a pair's three lists), not its context's.
                counts = sum(np.asarray(pc.list_value_length(a).fill_null(0).to_numpy(zero_copy_only=False), dtype=np.int64)
                             for a in arrays[:taken] if pa.types.is_list(a.type) or pa.types.is_large_list(a.type))  # fmt: skip
                counts = np.broadcast_to(counts, (batch.num_rows,)).tolist()
                for row in range(batch.num_rows):
                    counter.lines += 1
                    many = too_many_messages(counts[row], max_messages) if max_messages else None
                    if sizes[row] > max_bytes:
                        yield BadRecord(counter.lines, too_long(f"{what} ({sizes[row]:,} bytes)", max_bytes))
                    elif many is not None:
                        yield BadRecord(counter.lines, many)
                    else:
                        yield Conversation({name: a[row].as_py() for name, a in zip(columns, arrays)})
    except (pa.ArrowException, OSError) as exc:
        raise DataError(f"{uri}: not a readable Parquet file ({exc})") from None
