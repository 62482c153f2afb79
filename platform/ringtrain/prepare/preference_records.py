"""A preference record of `ringtrain prepare --format preference`: a prompt and two completions, checked.

A record is one pair in one of TRL's layouts (``RECORD_FORMATS``):

- ``conversational``: ``prompt`` a list of messages (system, user, assistant, tool; several
  turns allowed), ``chosen`` and ``rejected`` lists of the messages that follow it (the
  assistant's answer, with any tool calls and tool answers);
- ``implicit``: no ``prompt``; ``chosen`` and ``rejected`` whole conversations, the prompt being
  the messages they share from the start;
- ``plain``: ``prompt``, ``chosen`` and ``rejected`` texts, a user turn and an assistant turn.

Messages are read as ``--format chat`` reads them (``chat_records``: OpenAI or ShareGPT style,
flags taken out). The prompt must end with the user's or a tool's turn (what a model answers),
and each completion must hold an assistant turn. The record's other fields the template reads
(``tools``, ...) are kept for it. What is wrong is a ``BadConversation``, a bad record at its
line. Pure data handling (no tokenizer).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ringtrain.prepare.chat_records import BadConversation, Conversation, context_of, messages

RECORD_FORMATS = ("conversational", "implicit", "plain")
PROMPT, CHOSEN, REJECTED = "prompt", "chosen", "rejected"
# The fields a record's pair is read from (a Parquet file's columns of these names).
PAIR_FIELDS = (PROMPT, CHOSEN, REJECTED)
# Whose turn a prompt may end with: the model answers it.
ANSWERED_ROLES = ("user", "tool")


@dataclass(frozen=True)
class PreferenceRecord:
    """A checked pair: the prompt's messages and each completion's, in ``RECORD_FORMATS``'
    ``format``, with the record's fields the template reads."""

    prompt: list[dict[str, Any]]
    chosen: list[dict[str, Any]]
    rejected: list[dict[str, Any]]
    format: str
    context: dict[str, Any] = field(default_factory=dict)


def _turns(value: Any, name: str) -> list[dict[str, Any]]:
    return messages(value, name)[0]


def _text_pair(fields: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
    for name in PAIR_FIELDS:
        if not isinstance(fields[name], str):
            raise BadConversation(f"field {name!r} is {type(fields[name]).__name__}: a plain record's prompt, chosen "
                                  "and rejected are all texts, or all lists of messages")  # fmt: skip
        if not fields[name].strip():
            raise BadConversation(f"field {name!r} is empty")
    return ([{"role": "user", "content": fields[PROMPT]}], [{"role": "assistant", "content": fields[CHOSEN]}],
            [{"role": "assistant", "content": fields[REJECTED]}])  # fmt: skip


def _split_implicit(chosen: list[dict[str, Any]], rejected: list[dict[str, Any]]) -> int:
    """How many messages the two conversations share from the start: the implicit prompt."""
    shared = 0
    while shared < min(len(chosen), len(rejected)) and chosen[shared] == rejected[shared]:
        shared += 1
    if shared == 0:
        raise BadConversation("chosen and rejected have different prompts: their first messages differ")
    return shared


def read_preference(record: Conversation, context_fields: frozenset[str] = frozenset()) -> PreferenceRecord:
    """A record's pair checked, in whichever of ``RECORD_FORMATS`` it is; BadConversation otherwise."""
    fields = record.fields
    missing = [name for name in (CHOSEN, REJECTED) if fields.get(name) is None]
    if missing:
        raise BadConversation(f"no field {' or '.join(map(repr, missing))}: a preference record holds chosen and rejected")
    if fields.get(PROMPT) is None:
        chosen, rejected = _turns(fields[CHOSEN], CHOSEN), _turns(fields[REJECTED], REJECTED)
        shared = _split_implicit(chosen, rejected)
        prompt, chosen, rejected, form = chosen[:shared], chosen[shared:], rejected[shared:], "implicit"
    elif isinstance(fields[PROMPT], str):
        (prompt, chosen, rejected), form = _text_pair(fields), "plain"
    else:
        prompt, chosen, rejected = (_turns(fields[name], name) for name in PAIR_FIELDS)
        form = "conversational"
    if prompt[-1]["role"] not in ANSWERED_ROLES:
        raise BadConversation(f"the prompt ends with the {prompt[-1]['role']}'s turn; it must end with the user's or a "
                              "tool's, which the completions answer")  # fmt: skip
    for name, completion in ((CHOSEN, chosen), (REJECTED, rejected)):
        answers = [m for m in completion if m["role"] == "assistant"]
        if not answers:
            raise BadConversation(f"the {name} completion holds no assistant turn")
        if not any(str(m.get("content") or "").strip() or m.get("tool_calls") for m in answers):
            raise BadConversation(f"the {name} completion is empty")
    return PreferenceRecord(prompt, chosen, rejected, form, context_of(fields, set(PAIR_FIELDS), context_fields))
