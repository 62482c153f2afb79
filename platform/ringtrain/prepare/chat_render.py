"""Conversations to token ids and per-token loss masks, rendered with the model's own chat template.

Each conversation is rendered and tokenized by transformers' ``apply_chat_template`` with the
template ``chat_template`` found (nothing downloaded: the tokenizer loads from its folder), so
the tokens are the ones the model sees at inference. The mask marks trained targets, by
``--train-on``:

- ``assistant``: every token of every assistant turn, its end-of-turn token included;
- ``last``: those of the last assistant turn only;
- ``all``: every token but the first.

A conversation's first token is never a target (nothing predicts it). Where the assistant's
turns are:

- a template with ``{% generation %}`` markers: transformers' assistant mask
  (``return_assistant_tokens_mask``), as is;
- a template without: the text of ``messages[:k]`` with the generation prompt (what the model
  sees before the assistant's k-th message) and of ``messages[:k + 1]`` (that message
  rendered) bound the turn's characters, each rendering a prefix of the next and of the whole;
  the whole text is tokenized once and a token is masked when it overlaps such a span, the
  rule transformers applies to its markers' spans. So both sources give the same mask for
  the same characters. A template whose renderings are not prefixes of one another cannot be
  masked so: it is refused, naming it (``TemplateRefused``), never guessed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Union

import numpy as np

from ringtrain.errors import ConfigError, DataError
from ringtrain.prepare.chat_records import BadConversation, Conversation, assistant_turns, messages
from ringtrain.prepare.chat_template import KEY, ChatTemplate
from ringtrain.prepare.render_budget import OverBudget, RenderBudget, Watchdog
from ringtrain.prepare.sources import BadRecord

# A conversation every chat template renders (no system turn: some templates refuse one), used
# to check a template before any record is read.
PROBE = [
    {"role": "user", "content": "What is a ring?"},
    {"role": "assistant", "content": "A cycle of ranks."},
    {"role": "user", "content": "And a shard?"},
    {"role": "assistant", "content": "A piece of the sequence."},
]


class TemplateRefused(DataError):
    """The template cannot be masked from its prefixes: a property of the template, not the record."""


@dataclass(frozen=True)
class ChatSpec:
    """What a tokenizer actor needs to render conversations; picklable."""

    template: ChatTemplate
    train_on: str  # prepared.CHAT_TRAIN_ON
    messages_field: str
    vocab_size: int  # ids at or above it are refused: the manifest's dtype was chosen for it
    budget: RenderBudget = RenderBudget()  # what one record may cost (render_budget)


def _spans_mask(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> np.ndarray:
    """1 for each token overlapping a character span: transformers' rule for its markers' spans
    (``apply_chat_template``), spans and offsets both in order."""
    mask = np.zeros(len(offsets), dtype=np.uint8)
    span = 0
    for token, (start, end) in enumerate(offsets):
        while span < len(spans) and start >= spans[span][1]:
            span += 1
        if span == len(spans):
            break
        if end > spans[span][0]:
            mask[token] = 1
    return mask


class ChatRenderer:
    """Conversations (checked role/content messages) -> (token ids, mask) by one template and policy."""

    def __init__(self, spec: ChatSpec) -> None:
        from transformers import AutoTokenizer

        self.spec = spec
        self.template = spec.template
        self._tok: Any = AutoTokenizer.from_pretrained(spec.template.folder, local_files_only=True)

    def _text(self, conversation: list[dict[str, Any]], prompt: bool = False) -> str:
        text: str = self._tok.apply_chat_template(conversation, chat_template=self.template.text, tokenize=False,
                                                  add_generation_prompt=prompt)  # fmt: skip
        return text

    def _refuse(self, why: str) -> TemplateRefused:
        return TemplateRefused(
            f"{self.template.path}: the chat template {why}, so its assistant turns cannot be found without "
            "{% generation %} markers: add them around the assistant's text and end-of-turn token, or pass --train-on all"
        )

    def _prefix_spans(self, conversation: list[dict[str, Any]], turns: list[int], whole: str) -> list[tuple[int, int]]:
        """The character span of each assistant message in ``turns``, from rendered prefixes."""
        spans = []
        for k in turns:
            if k == 0:
                raise BadConversation("it opens with the assistant's turn: with no {% generation %} markers in the "
                                      "template a turn is found after the prompt rendered before it, and there is none")  # fmt: skip
            try:
                prompt = self._text(conversation[:k], prompt=True)
                rendered = whole if k == len(conversation) - 1 else self._text(conversation[: k + 1])
            except Exception as exc:  # the template's own code (raise_exception, a filter): any error
                raise self._refuse(f"cannot render the first {k} messages of a conversation it renders whole ({exc})") from None
            if not (rendered.startswith(prompt) and whole.startswith(rendered)):
                raise self._refuse(f"renders message {k + 1}'s prompt or its first {k + 1} messages as text that does "
                                          "not begin its rendering of the whole conversation")  # fmt: skip
            spans.append((len(prompt), len(rendered)))
        return spans

    def render(self, conversation: list[dict[str, Any]]) -> tuple[np.ndarray, np.ndarray]:
        """(token ids int64, mask uint8) of one conversation. BadConversation for a record the
        policy or the template cannot use; TemplateRefused (naming the template) for a template
        that cannot be masked; DataError for an id the vocabulary does not hold."""
        turns = assistant_turns(conversation)
        train_on = self.spec.train_on
        if train_on != "all" and not turns:
            raise BadConversation(f"no assistant turn to train on (--train-on {train_on})")
        try:
            whole = self._text(conversation)
        except Exception as exc:  # the template's own code (raise_exception, a filter): any error
            raise BadConversation(f"the chat template cannot render it ({type(exc).__name__}: {exc})") from None
        over = self.spec.budget.text_over(len(whole))
        if over is not None:
            raise BadConversation(over)
        if train_on == "all":
            ids = self._encode(whole)[0]
            mask = np.ones(len(ids), dtype=np.uint8)
        elif self.template.has_markers:
            ids, mask = self._marked(conversation, turns, whole)
        else:
            ids, offsets = self._encode(whole)
            mask = _spans_mask(offsets, self._prefix_spans(conversation, turns[-1:] if train_on == "last" else turns, whole))
        if not ids:
            raise BadConversation("the chat template renders it as no tokens")
        if max(ids) >= self.spec.vocab_size:
            raise DataError(f"{self.template.folder}: the tokenizer gives id {max(ids)}, outside the vocabulary of "
                            f"{self.spec.vocab_size} its tokenizer.json declares")  # fmt: skip
        mask[0] = 0  # nothing predicts the first token
        return np.asarray(ids, dtype=np.int64), mask

    def _encode(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Token ids and character offsets of a rendered text, as ``apply_chat_template`` tokenizes it."""
        out = self._tok(text, add_special_tokens=False, return_offsets_mapping=True)
        return list(out["input_ids"]), [tuple(o) for o in out["offset_mapping"]]

    def _marked(self, conversation: list[dict[str, Any]], turns: list[int], whole: str) -> tuple[list[int], np.ndarray]:
        """transformers' assistant mask; for ``last``, without the turns before the last one's
        (the text of the messages before it must begin the whole, as it does in any template
        whose history is not rewritten)."""
        out = self._tok.apply_chat_template(conversation, chat_template=self.template.text, tokenize=True, return_dict=True,
                                            return_assistant_tokens_mask=True)  # fmt: skip
        ids, mask = list(out["input_ids"]), np.asarray(out["assistant_masks"], dtype=np.uint8)
        if self.spec.train_on == "last" and turns[-1] > 0:
            try:
                before = self._text(conversation[: turns[-1]])
            except Exception as exc:  # the template's own code: any error
                raise self._refuse(f"cannot render the messages before the last assistant turn ({exc})") from None
            if not whole.startswith(before):
                raise self._refuse("renders the messages before the last assistant turn as text that does not begin "
                                          "its rendering of the whole conversation")  # fmt: skip
            ends = np.asarray([end for _, end in out.encodings[0].offsets], dtype=np.int64)
            mask[ends <= len(before)] = 0
        return ids, mask


def check(spec: ChatSpec) -> ChatRenderer:
    """Load the tokenizer and render PROBE by ``spec`` on the driver, before any cluster starts: a
    template that cannot render it, or cannot be masked, is a ConfigError naming it."""
    try:
        renderer = ChatRenderer(spec)
    except (OSError, ValueError) as exc:
        raise ConfigError(KEY, f"{spec.template.folder}: transformers cannot load the tokenizer ({exc})") from None
    try:
        renderer.render(PROBE)
    except TemplateRefused as exc:
        raise ConfigError(KEY, f"{exc} (seen on a probe conversation)") from None
    except (BadConversation, DataError) as exc:
        raise ConfigError(KEY, f"{spec.template.path}: a probe conversation of user and assistant turns: {exc}") from None
    return renderer


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
        count = len(record.value) if isinstance(record.value, list) else 0
        over = self.budget.messages_over(count)
        if over is not None:
            return BadRecord(line, over)
        try:
            with self.watchdog.watch():
                rendered = Rendered(*self.renderer.render(messages(record.value, self.field)))
        except OverBudget:
            return BadRecord(line, self.watchdog.reason)
        except BadConversation as exc:
            return BadRecord(line, str(exc))
        except DataError as exc:  # TemplateRefused, an id outside the vocabulary: not the record's fault
            return BadRecord(line, str(exc), fatal=True)
        over = self.budget.tokens_over(len(rendered))
        return rendered if over is None else BadRecord(line, over)

    def encode(self, docs: list[Rendered]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(tokens, lengths, mask) of a chunk's conversations laid end to end; no EOS is appended."""
        if not docs:
            return np.empty(0, dtype=self.dtype), np.empty(0, dtype=np.int64), np.empty(0, dtype=np.uint8)
        tokens = np.concatenate([d.ids for d in docs]).astype(self.dtype)
        lengths = np.fromiter((len(d) for d in docs), dtype=np.int64, count=len(docs))
        return tokens, lengths, np.concatenate([d.mask for d in docs])
