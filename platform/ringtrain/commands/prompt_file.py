"""The prompts of ``ringtrain generate --prompts FILE.jsonl``, read and tokenized on the driver.

Each line is one JSON object with one of three fields: ``{"prompt": "text"}`` (tokenized as a
sequence's start, so a tokenizer that puts a beginning-of-sequence token in front does),
``{"messages": [{"role": ..., "content": ...}, ...]}`` (rendered by the model's chat template
with the generation prompt, as transformers' ``apply_chat_template`` renders it) or
``{"ids": [...]}`` (token ids as they are). A line that is not such an object is named with
its file and line number, before any cluster starts.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from ringtrain.errors import ConfigError, first_line
from ringtrain.evaluation.text import Tokenizer

FIELDS = ("prompt", "messages", "ids")
OPTION = "--prompts"


class ChatTemplate:
    """The chat template of a Hugging Face folder's tokenizer, through transformers."""

    def __init__(self, folder: str) -> None:
        self.folder = folder
        self._tokenizer: Any = None

    def render(self, messages: list[dict[str, Any]], where: str) -> list[int]:
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            try:
                self._tokenizer = AutoTokenizer.from_pretrained(self.folder, local_files_only=True)
            except Exception as exc:  # transformers' many errors of a folder it cannot read, each of many lines
                raise ConfigError(OPTION, f"{where}: \"messages\" needs the model's chat template, and the tokenizer of "
                                          f"{self.folder} cannot be loaded ({first_line(exc)})") from None
        if not getattr(self._tokenizer, "chat_template", None):
            raise ConfigError(OPTION, f"{where}: \"messages\" needs a chat template, and {self.folder} has none")
        try:
            text = self._tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except Exception as exc:  # the template's own errors (a missing role, a bad field)
            raise ConfigError(OPTION, f"{where}: the chat template refused these messages: {exc}") from None
        return list(self._tokenizer(text, add_special_tokens=False)["input_ids"])


def read_prompts(path: str, tokenizer: Optional[Tokenizer], template: Optional[ChatTemplate],
                 vocab_size: int) -> list[tuple[str, list[int]]]:
    """Every line's prompt as token ids, with where it is (file and line, for the user);
    ConfigError naming ``--prompts``, the file and the line."""
    file = Path(path)
    if not file.is_file():
        raise ConfigError(OPTION, f"{path} is not a file")
    prompts = []
    with file.open("rb") as lines:
        for number, raw in enumerate(lines, start=1):
            where = f"{path} line {number}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise ConfigError(OPTION, f"{where}: not UTF-8 text (byte {exc.start + 1} of the line)") from None
            if not line.strip():
                continue
            prompts.append((where, _prompt(line, where, tokenizer, template, vocab_size)))
    if not prompts:
        raise ConfigError(OPTION, f"{path} holds no prompt")
    return prompts


def _prompt(line: str, where: str, tokenizer: Optional[Tokenizer], template: Optional[ChatTemplate],
            vocab_size: int) -> list[int]:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ConfigError(OPTION, f"{where}: not JSON ({exc.msg})") from None
    given = [f for f in FIELDS if isinstance(record, dict) and f in record]
    if len(given) != 1:
        raise ConfigError(OPTION, f"{where}: want an object with one of {', '.join(FIELDS)}")
    value = record[given[0]]
    if given[0] == "ids":
        if not isinstance(value, list) or not value or not all(isinstance(i, int) and 0 <= i < vocab_size
                                                                for i in value):
            raise ConfigError(OPTION, f"{where}: \"ids\" must be a non-empty list of token ids in [0, {vocab_size})")
        return list(value)
    if given[0] == "prompt":
        if not isinstance(value, str) or not value:
            raise ConfigError(OPTION, f"{where}: \"prompt\" must be non-empty text")
        if tokenizer is None:
            raise ConfigError(OPTION, f"{where}: the model has no tokenizer for text; give \"ids\"")
        return tokenizer.encode(value, first=True)
    if not isinstance(value, list) or not value or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) for m in value):
        raise ConfigError(OPTION, f"{where}: \"messages\" must be a list of {{\"role\": ..., \"content\": ...}}")
    if template is None:
        raise ConfigError(OPTION, f"{where}: \"messages\" needs the model's chat template (a Hugging Face folder)")
    return template.render(value, where)
