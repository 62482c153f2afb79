"""Conversations to token ids and per-token loss masks, rendered with the model's own chat template.

Each conversation is rendered and tokenized by transformers' ``apply_chat_template`` with the
template ``chat_template`` found (nothing downloaded: the tokenizer loads from its folder), the
record's fields the template reads passed as transformers passes them (``tools``, ``documents``
and any other as a keyword), so the tokens are the ones the model sees at inference. The mask
marks trained targets. Which messages train:

- ``--roles-to-train`` (default ``assistant``): the messages of these roles, unless a message's
  own flag (``"weight": 0`` / ``"train": false``, or 1 / true) says otherwise (``chat_records``);
- ``--train-on``: ``assistant`` (every such message), ``last`` (the last one only), or ``all``
  (every token but the first, roles and flags aside);
- ``--train-on-eos``: whether a trained turn's end-of-turn token (the tokenizer's EOS, or any of
  the model's ``generation_config.json`` EOS ids) trains: ``turn`` (every turn's), ``last`` (the
  last trained turn's only) or ``none``. What a turn renders after it (ChatML's newline) is glue
  between turns and never trains.

A conversation's first token is never a target (nothing predicts it). Where a turn is:

- an assistant turn of a template with ``{% generation %}`` markers: transformers' assistant mask
  (``return_assistant_tokens_mask``), a run of it per assistant message;
- an assistant turn of a template without: the text of ``messages[:k]`` with the generation
  prompt (what the model sees before the assistant's k-th message) and of ``messages[:k + 1]``
  (that message rendered) bound the turn's characters;
- a turn of another role: the text of ``messages[:k]`` and ``messages[:k + 1]`` bound it, and it
  starts where the message's text does in it (its role header is not trained).

Each rendering must be a prefix of the next and of the whole; the whole text is tokenized once and
a token is in a turn when it overlaps the turn's span, the rule transformers applies to its
markers' spans, so both sources give the same mask for the same characters. A template whose
renderings are not prefixes of one another cannot be masked so: it is refused, naming it
(``TemplateRefused``), never guessed.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Union

import numpy as np

from ringtrain.errors import ConfigError, DataError
from ringtrain.jsonfile import read_json
from ringtrain.prepare.chat_records import (
    DOCUMENTS_FIELD,
    TOOLS_FIELD,
    BadConversation,
    ChatRecord,
    Conversation,
    assistant_turns,
    read_chat,
)
from ringtrain.prepare.chat_template import KEY, OVERRIDE_KEY, ChatTemplate, shipped
from ringtrain.prepare.preference_records import PAIR_FIELDS
from ringtrain.prepare.render_budget import OverBudget, RenderBudget, Watchdog
from ringtrain.prepare.sources import BadRecord

# A conversation every chat template renders (no system turn: some templates refuse one), used
# to check a template before any record is read.
PROBE = ChatRecord([
    {"role": "user", "content": "What is a ring?"},
    {"role": "assistant", "content": "A cycle of ranks."},
    {"role": "user", "content": "And a shard?"},
    {"role": "assistant", "content": "A piece of the sequence."},
])
GENERATION_CONFIG = "generation_config.json"


class TemplateRefused(DataError):
    """The template cannot be masked from its prefixes: a property of the template, not the record."""


@dataclass(frozen=True)
class ChatSpec:
    """What a tokenizer actor needs to render conversations; picklable."""

    template: ChatTemplate
    train_on: str  # prepared.CHAT_TRAIN_ON
    messages_field: str
    vocab_size: int  # ids at or above it are refused: the manifest's dtype was chosen for it
    roles: tuple[str, ...] = ("assistant",)  # --roles-to-train
    eos: str = "turn"  # prepared.CHAT_TRAIN_ON_EOS
    content: str = "chat"  # prepared.CONTENTS: conversations, or preference pairs
    budget: RenderBudget = RenderBudget()  # what one record may cost (render_budget)

    @property
    def record_fields(self) -> tuple[str, ...]:
        """The fields a Parquet record is read from, where not the messages field (or Alpaca's)."""
        return PAIR_FIELDS if self.content == "preference" else ()


Turn = tuple[int, int]  # a trained turn's tokens [start, end)


def _token_range(starts: np.ndarray, ends: np.ndarray, span: tuple[int, int]) -> Optional[Turn]:
    """The tokens overlapping a character span (transformers' rule for its markers' spans in
    ``apply_chat_template``); None where none does."""
    inside = np.flatnonzero((starts < span[1]) & (ends > span[0]))
    return (int(inside[0]), int(inside[-1]) + 1) if inside.size else None


def _runs(mask: np.ndarray) -> list[Turn]:
    """The runs of ones of a 0/1 mask, in order."""
    edges = np.flatnonzero(np.diff(np.concatenate(([0], mask.astype(np.int8), [0]))))
    return [(int(a), int(b)) for a, b in zip(edges[::2], edges[1::2])]


def end_of_turn_ids(tokenizer: Any, folder: str) -> frozenset[int]:
    """The ids that end a turn: the tokenizer's EOS, and the EOS ids of the model's
    ``generation_config.json`` beside it (where chat models list their end-of-turn tokens)."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    path = Path(folder) / GENERATION_CONFIG
    if path.is_file():
        try:
            listed = read_json(path).get("eos_token_id")
        except (OSError, ValueError, AttributeError):  # JsonFileError among them; not an object
            listed = None
        ids.update(i for i in (listed if isinstance(listed, list) else [listed]) if isinstance(i, int))
    return frozenset(ids)


class ChatRenderer:
    """Conversations (checked ``ChatRecord``s) -> (token ids, mask) by one template and policy."""

    def __init__(self, spec: ChatSpec) -> None:
        from transformers import AutoTokenizer

        self.spec = spec
        self.template = spec.template
        self._tok: Any = AutoTokenizer.from_pretrained(spec.template.folder, local_files_only=True)
        self.context_fields = spec.template.variables
        self.end_ids = end_of_turn_ids(self._tok, spec.template.folder)

    def _arguments(self, chat: ChatRecord) -> dict[str, Any]:
        context = dict(chat.context)
        tools, documents = context.pop(TOOLS_FIELD, None), context.pop(DOCUMENTS_FIELD, None)
        return {"chat_template": self.template.text, "tools": tools, "documents": documents, **context}

    def _text(self, chat: ChatRecord, upto: int, prompt: bool = False) -> str:
        """The template's text of the first ``upto`` messages."""
        text: str = self._tok.apply_chat_template(chat.messages[:upto], tokenize=False, add_generation_prompt=prompt,
                                                  **self._arguments(chat))  # fmt: skip
        return text

    def _prefix(self, chat: ChatRecord, upto: int, prompt: bool = False) -> str:
        """``_text`` of a prefix, a template error there being the record's (the probe rendered
        prefixes before any record was read)."""
        try:
            return self._text(chat, upto, prompt)
        except Exception as exc:  # the template's own code (raise_exception, a filter): any error
            raise BadConversation(f"the chat template cannot render its first {upto} messages "
                                  f"({type(exc).__name__}: {exc})") from None  # fmt: skip

    def _refuse(self, why: str) -> TemplateRefused:
        return TemplateRefused(
            f"{self.template.path}: the chat template {why}, so its turns cannot be found without {{% generation %}} "
            f"markers: pass {OVERRIDE_KEY} with a template that has them (shipped: {', '.join(shipped())}; or add them "
            "around the assistant's text and end-of-turn token), or --train-on last (the last assistant turn is found "
            "while it ends the conversation), or --train-on all"
        )

    def trained(self, chat: ChatRecord) -> list[int]:
        """The messages whose turns train: their role's, or their own flag's say; the last only
        under ``--train-on last``."""
        picked = [i for i, (m, flag) in enumerate(zip(chat.messages, chat.flags))
                  if (m["role"] in self.spec.roles if flag is None else flag)]  # fmt: skip
        return picked[-1:] if self.spec.train_on == "last" else picked

    def _prefix_span(self, chat: ChatRecord, k: int, whole: str) -> tuple[int, int]:
        """The characters of message k's turn, from rendered prefixes: after the generation
        prompt for the assistant's; from the message's text on for another role's."""
        assistant = chat.messages[k]["role"] == "assistant"
        if assistant and k == 0:
            raise BadConversation("it opens with the assistant's turn: with no {% generation %} markers in the "
                                  "template a turn is found after the prompt rendered before it, and there is none")  # fmt: skip
        before = self._prefix(chat, k, prompt=assistant) if k else ""
        rendered = whole if k == len(chat.messages) - 1 else self._prefix(chat, k + 1)
        if not (rendered.startswith(before) and whole.startswith(rendered)):
            raise self._refuse(f"renders message {k + 1}'s prompt or its first {k + 1} messages as text that does "
                               "not begin its rendering of the whole conversation")  # fmt: skip
        start = len(before)
        if not assistant:
            content = chat.messages[k].get("content")
            found = rendered.find(content.strip(), start) if isinstance(content, str) and content.strip() else -1
            start = found if found >= 0 else start
        return start, len(rendered)

    def render(self, chat: ChatRecord) -> tuple[np.ndarray, np.ndarray]:
        """(token ids int64, mask uint8) of one conversation. BadConversation for a record the
        policy or the template cannot use; TemplateRefused (naming the template) for a template
        that cannot be masked; DataError for an id the vocabulary does not hold."""
        trained = self.trained(chat)
        spec = self.spec
        if spec.train_on != "all" and not trained:
            weighed = " and its messages' own weights" if any(f is not None for f in chat.flags) else ""
            raise BadConversation(f"no {' or '.join(spec.roles)} turn to train on (--train-on {spec.train_on}{weighed})")
        try:
            whole = self._text(chat, len(chat.messages))
        except Exception as exc:  # the template's own code (raise_exception, a filter): any error
            raise BadConversation(f"the chat template cannot render it ({type(exc).__name__}: {exc})") from None
        over = spec.budget.text_over(len(whole))
        if over is not None:
            raise BadConversation(over)
        if spec.train_on == "all":
            ids = self._encode(whole)[0]
            mask = np.ones(len(ids), dtype=np.uint8)
        else:
            ids, turns = self._turns(chat, trained, whole)
            mask = np.zeros(len(ids), dtype=np.uint8)
            for i, (start, end) in enumerate(turns):
                eot = self._end_of_turn(ids, start, end)
                keeps_eot = spec.eos == "turn" or (spec.eos == "last" and i == len(turns) - 1)
                mask[start : (eot + keeps_eot if eot < end else end)] = 1
        if not ids:
            raise BadConversation("the chat template renders it as no tokens")
        if max(ids) >= spec.vocab_size:
            raise DataError(f"{self.template.folder}: the tokenizer gives id {max(ids)}, outside the vocabulary of "
                            f"{spec.vocab_size} its tokenizer.json declares")  # fmt: skip
        mask[0] = 0  # nothing predicts the first token
        return np.asarray(ids, dtype=np.int64), mask

    def prompt_ids(self, chat: ChatRecord) -> list[int]:
        """The tokens of ``chat``'s messages with the generation prompt: what a model is given to
        answer them. BadConversation where the template cannot render them."""
        try:
            ids = self._encode(self._text(chat, len(chat.messages), prompt=True))[0]
        except Exception as exc:  # the template's own code (raise_exception, a filter): any error
            raise BadConversation(f"the chat template cannot render the prompt ({type(exc).__name__}: {exc})") from None
        if ids and max(ids) >= self.spec.vocab_size:
            raise DataError(f"{self.template.folder}: the tokenizer gives id {max(ids)}, outside the vocabulary of "
                            f"{self.spec.vocab_size} its tokenizer.json declares")  # fmt: skip
        return ids

    def _end_of_turn(self, ids: list[int], start: int, end: int) -> int:
        """Where a turn's end-of-turn token is, or its end where it has none. What a turn's
        rendering holds after that token (ChatML's newline) is the template's glue between turns:
        never trained, whatever marks the turn."""
        return next((t for t in range(start, end) if ids[t] in self.end_ids), end)

    def _turns(self, chat: ChatRecord, trained: list[int], whole: str) -> tuple[list[int], list[Turn]]:
        """The whole conversation's token ids, and the trained messages' turns as token ranges."""
        roles = [chat.messages[k]["role"] for k in trained]
        marked = self.template.has_markers and "assistant" in roles
        if marked:
            out = self._tok.apply_chat_template(chat.messages, tokenize=True, return_dict=True,
                                                return_assistant_tokens_mask=True, **self._arguments(chat))  # fmt: skip
            ids = list(out["input_ids"])
            offsets = out.encodings[0].offsets
            by_marker = self._marked(chat, trained, whole, _runs(np.asarray(out["assistant_masks"], dtype=np.uint8)), offsets)
        else:
            ids, offsets = self._encode(whole)
            by_marker = []
        starts = np.asarray([a for a, _ in offsets], dtype=np.int64)
        ends = np.asarray([b for _, b in offsets], dtype=np.int64)
        by_prefix = [_token_range(starts, ends, self._prefix_span(chat, k, whole))
                     for k, role in zip(trained, roles) if not (marked and role == "assistant")]  # fmt: skip
        return ids, sorted(t for t in [*by_marker, *by_prefix] if t is not None)

    def _marked(self, chat: ChatRecord, trained: list[int], whole: str, runs: list[Turn],
                offsets: list[tuple[int, int]]) -> list[Turn]:  # fmt: skip
        """The trained assistant messages' runs of transformers' assistant mask: a run a message
        where the template renders one a message; else all of them when every assistant message
        trains, or under ``--train-on last`` those after the text of the messages before the last
        turn (which must begin the whole, as in any template whose history is not rewritten)."""
        assistants = assistant_turns(chat.messages)
        wanted = [k for k in trained if chat.messages[k]["role"] == "assistant"]
        if len(runs) == len(assistants):
            return [runs[assistants.index(k)] for k in wanted]
        if wanted == assistants:
            return runs
        if self.spec.train_on == "last" and not any(f is not None for f in chat.flags):
            before = self._prefix(chat, wanted[-1])
            if not whole.startswith(before):
                raise self._refuse("renders the messages before the last assistant turn as text that does not begin "
                                   "its rendering of the whole conversation")  # fmt: skip
            return [run for run in runs if offsets[run[1] - 1][1] > len(before)]
        raise self._refuse(f"wraps {len(runs)} spans in generation markers for {len(assistants)} assistant messages, "
                           "so a message's own weight, or its role, cannot pick its span")  # fmt: skip

    def _encode(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Token ids and character offsets of a rendered text, as ``apply_chat_template`` tokenizes it."""
        out = self._tok(text, add_special_tokens=False, return_offsets_mapping=True)
        return list(out["input_ids"]), [tuple(o) for o in out["offset_mapping"]]


def check(spec: ChatSpec) -> None:
    """Load the tokenizer and render PROBE by ``spec`` on the driver, before any cluster starts: a
    template that cannot render it, or cannot be masked, is a ConfigError naming it. The probe
    trains the roles of ``--roles-to-train`` it has (the assistant's where it has none of them)."""
    key = OVERRIDE_KEY if spec.template.override else KEY
    roles = tuple(r for r in spec.roles if r in ("user", "assistant")) or ("assistant",)
    try:
        renderer = ChatRenderer(dataclasses.replace(spec, roles=roles))
    except (OSError, ValueError) as exc:
        raise ConfigError(KEY, f"{spec.template.folder}: transformers cannot load the tokenizer ({exc})") from None
    try:
        renderer.render(PROBE)
    except TemplateRefused as exc:
        raise ConfigError(key, f"{exc} (seen on a probe conversation)") from None
    except (BadConversation, DataError) as exc:
        raise ConfigError(key, f"{spec.template.path}: a probe conversation of user and assistant turns: {exc}") from None


@dataclass(frozen=True)
class Rendered:
    """One conversation's tokens and mask, as a chunk collects them."""

    ids: np.ndarray
    mask: np.ndarray

    def __len__(self) -> int:
        return len(self.ids)


class ChatEncoder:
    """A tokenizer actor's chat half: records to rendered conversations (or bad records), and a
    chunk of them to flat (tokens, lengths, mask) in the dataset's dtype."""

    def __init__(self, spec: ChatSpec, dtype: str) -> None:
        self.renderer = ChatRenderer(spec)
        self.dtype = np.dtype(dtype)
        self.field = spec.messages_field
        self.budget = spec.budget
        self.watchdog = Watchdog(spec.budget)

    def convert(self, record: Conversation, line: int) -> Union[Rendered, BadRecord]:
        """A record's conversation rendered within the budget; what is wrong with it a bad record
        at ``line``, one that stops the run whatever ``--on-bad-record`` says when the template
        is at fault."""
        value = record.fields.get(self.field)
        rendered = self.within_budget(
            len(value) if isinstance(value, list) else 0, line,
            lambda: (Rendered(*self.renderer.render(read_chat(record, self.field, self.renderer.context_fields))),),
        )  # fmt: skip
        return rendered if isinstance(rendered, BadRecord) else rendered[0]

    def within_budget(self, num_messages: int, line: int, render: Callable[[], tuple[Rendered, ...]]
                      ) -> Union[tuple[Rendered, ...], BadRecord]:  # fmt: skip
        """``render()``'s documents, rendered under the budget's watchdog, or the bad record at
        ``line`` they make: over a bound, refused by the record's own fields, or (fatal) by the
        template or the vocabulary."""
        over = self.budget.messages_over(num_messages)
        if over is not None:
            return BadRecord(line, over)
        try:
            with self.watchdog.watch():
                docs = render()
        except OverBudget:
            return BadRecord(line, self.watchdog.reason)
        except BadConversation as exc:
            return BadRecord(line, str(exc))
        except DataError as exc:  # TemplateRefused, an id outside the vocabulary: not the record's fault
            return BadRecord(line, str(exc), fatal=True)
        over = self.budget.tokens_over(sum(len(d) for d in docs))
        return docs if over is None else BadRecord(line, over)

    def encode(self, docs: list[Rendered]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(tokens, lengths, mask) of a chunk's conversations laid end to end; no EOS is appended."""
        if not docs:
            return np.empty(0, dtype=self.dtype), np.empty(0, dtype=np.int64), np.empty(0, dtype=np.uint8)
        tokens = np.concatenate([d.ids for d in docs]).astype(self.dtype)
        lengths = np.fromiter((len(d) for d in docs), dtype=np.int64, count=len(docs))
        return tokens, lengths, np.concatenate([d.mask for d in docs])
