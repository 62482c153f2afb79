"""Chat records as `ringtrain prepare --format chat` reads them: OpenAI and ShareGPT messages, what makes
a record bad, and Parquet list<struct> columns measured before they are decoded. No tokenizer, no Ray."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from ringtrain.prepare import sources
from ringtrain.prepare.chat_records import (
    BadConversation,
    Conversation,
    assistant_turns,
    messages,
    read_chat,
    value_bytes,
)

OPENAI = [
    {"role": "system", "content": "be terse"},
    {"role": "user", "content": "weather?"},
    {"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "get", "arguments": "{}"}}]},
    {"role": "tool", "content": "sunny", "tool_call_id": "1"},
    {"role": "assistant", "content": "Sunny."},
]


def test_openai_messages_are_kept_with_their_extra_keys() -> None:
    assert messages(OPENAI, "messages") == (OPENAI, (None,) * 5)
    assert assistant_turns(messages(OPENAI, "messages")[0]) == [2, 4]


def test_sharegpt_speakers_map_to_the_four_roles() -> None:
    value = [{"from": "system", "value": "s"}, {"from": "human", "value": "h"}, {"from": "function_call", "value": "{}"},
             {"from": "observation", "value": "o"}, {"from": "gpt", "value": "g"}]  # fmt: skip
    assert messages(value, "conversations")[0] == [
        {"role": "system", "content": "s"}, {"role": "user", "content": "h"}, {"role": "assistant", "content": "{}"},
        {"role": "tool", "content": "o"}, {"role": "assistant", "content": "g"},
    ]  # fmt: skip


def test_parquet_nulls_are_absent_keys() -> None:
    value = [{"role": "user", "content": "h", "from": None, "value": None}, {"from": "gpt", "value": "g", "role": None, "content": None}]
    assert messages(value, "m")[0] == [{"role": "user", "content": "h"}, {"role": "assistant", "content": "g"}]


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        (None, "field 'messages' is null, not a list of messages"),
        ("hi", "field 'messages' is str, not a list of messages"),
        ([], "field 'messages' holds no messages"),
        (["hi"], "field 'messages' message 1 is str, not an object"),
        ([{"role": "user", "content": "a"}, {"role": "narrator", "content": "b"}],
         "field 'messages' message 2: unknown role 'narrator' (expected system, user, assistant, tool)"),
        ([{"from": "bard", "value": "b"}], "field 'messages' message 1: unknown role 'bard' (expected system, human, user, gpt"),
        ([{"role": "user", "content": 3}], "field 'messages' message 1: 'content' is int, not a string"),
        ([{"role": "user"}], "field 'messages' message 1: 'content' is NoneType, not a string"),
        ([{"role": "assistant"}], "field 'messages' message 1: 'content' is NoneType, not a string"),
        ([{"from": "human"}], "field 'messages' message 1: 'value' is NoneType, not a string"),
        ([{"text": "x"}], "field 'messages' message 1 has neither 'role' (OpenAI) nor 'from' (ShareGPT)"),
    ],
)
def test_a_bad_conversation_says_what_is_wrong(value: Any, reason: str) -> None:
    with pytest.raises(BadConversation) as caught:
        messages(value, "messages")
    assert str(caught.value).startswith(reason), str(caught.value)


def test_jsonl_chat_records_carry_the_field_or_name_the_flag(tmp_path: Path) -> None:
    path = tmp_path / "c.jsonl"
    path.write_text(json.dumps({"messages": OPENAI}) + "\n" + json.dumps({"conversations": []}) + "\n{bad\n")
    piece = sources.plan(sources.expand([str(path)]), 1 << 20)[0]
    records = list(sources.read_records(piece, "messages", chat=True))
    assert records[0] == Conversation({"messages": OPENAI})
    assert records[1] == Conversation({"conversations": []})
    with pytest.raises(BadConversation, match="^no field 'messages' \\(--messages-field\\), nor Alpaca's 'instruction' and 'output'$"):
        read_chat(records[1], "messages")
    assert isinstance(records[2], sources.BadRecord) and records[2].reason.startswith("malformed JSON")


def _parquet(path: Path, rows: list[dict[str, Any]], **options: Any) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path, **options)
    return path


def test_parquet_rows_are_measured_then_read_in_order(tmp_path: Path) -> None:
    rows = [{"messages": [{"role": "user", "content": "ab"}, {"role": "assistant", "content": "c" * 50}]},
            {"messages": None}, {"messages": []}, {"messages": [{"role": "user", "content": "x" * 10}]}]  # fmt: skip
    path = _parquet(tmp_path / "c.parquet", rows, row_group_size=2)
    import pyarrow.parquet as pq

    array = pq.read_table(path).column("messages").combine_chunks()
    # The strings' bytes a row: roles count too.
    assert value_bytes(array).tolist() == [4 + 2 + 9 + 50, 0, 0, 4 + 10]
    pieces = sources.plan(sources.expand([str(path)]), 1)
    assert len(pieces) == 2  # one piece a row group: rows numbered across them by the driver
    got = [r for p in pieces for r in sources.read_records(p, "messages", max_bytes=60, chat=True)]
    assert got[0] == sources.BadRecord(1, "field 'messages' (65 bytes) is over the 60-byte limit (--max-record-bytes)")
    assert got[1:] == [Conversation({"messages": m}) for m in (None, [], rows[3]["messages"])]


def test_a_repeated_huge_value_is_measured_without_decoding_it_per_row(tmp_path: Path) -> None:
    """A dictionary-encoded value in every row is held once: each row is refused by its size."""
    big = "y" * (1 << 20)
    rows = [{"messages": [{"role": "user", "content": big}]} for _ in range(64)]
    path = _parquet(tmp_path / "bomb.parquet", rows, use_dictionary=True, compression="zstd")
    assert path.stat().st_size < 64 << 10
    piece = sources.plan(sources.expand([str(path)]), 1 << 30)[0]
    import pyarrow as pa

    default = pa.default_memory_pool()
    pool = pa.proxy_memory_pool(default)  # Arrow's own allocations while reading, counted apart
    pa.set_memory_pool(pool)
    try:
        got = list(sources.read_records(piece, "messages", max_bytes=1 << 19, chat=True))
    finally:
        pa.set_memory_pool(default)
    assert len(got) == 64 and all(isinstance(r, sources.BadRecord) and "1,048,580 bytes" in r.reason for r in got)
    assert pool.max_memory() < 16 << 20  # 3 MiB here; 65 MiB when every row's value is decoded


def test_a_parquet_column_of_another_type_is_a_bad_record_a_row(tmp_path: Path) -> None:
    path = _parquet(tmp_path / "t.parquet", [{"messages": "hello"}, {"messages": "again"}])
    piece = sources.plan(sources.expand([str(path)]), 1 << 20)[0]
    assert list(sources.read_records(piece, "messages", chat=True)) == [
        sources.BadRecord(n, "field 'messages' is string, not a list of messages") for n in (1, 2)
    ]
    with pytest.raises(Exception, match="no column 'conversations' \\(--messages-field\\), nor Alpaca's instruction and output"):
        list(sources.read_records(piece, "conversations", chat=True))
