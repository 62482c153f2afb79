"""A tokenizer folder's chat template: which file holds it, its text and hash, and whether it marks generation.

The template is the model's own, read where transformers reads it, in transformers' order: a
``chat_template.jinja`` beside the tokenizer wins over the ``chat_template`` entry of
``tokenizer_config.json`` (a string, or a list of named templates whose ``default`` is the one
used). Its text is what prepare renders with and what the manifest's ``template_sha256``
hashes, so a dataset names the exact template its masks came from.

A template that wraps the assistant's text in ``{% generation %}`` ... ``{% endgeneration %}``
gives its assistant masks directly (transformers' ``return_assistant_tokens_mask``); any other
is masked from its renderings of the conversation's prefixes (``chat_render``).
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

from ringtrain.errors import ConfigError
from ringtrain.jsonfile import read_json
from ringtrain.evaluation.tokenizer import TOKENIZER_FILE
from ringtrain.prepared import BYTES_TOKENIZER

KEY = "--tokenizer"
TEMPLATE_FILE = "chat_template.jinja"
CONFIG_FILE = "tokenizer_config.json"
# transformers' own test for a template's markers (utils/chat_template_utils.py).
GENERATION_MARKER = re.compile(r"\{\%-?\s*generation\s*-?\%\}")


@dataclass(frozen=True)
class ChatTemplate:
    folder: str  # the tokenizer folder
    file: str  # TEMPLATE_FILE or CONFIG_FILE: where the text was found
    text: str

    @property
    def path(self) -> str:
        """The file holding the template, as messages name it."""
        return str(Path(self.folder) / self.file)

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.text.encode("utf-8")).hexdigest()

    @property
    def has_markers(self) -> bool:
        return GENERATION_MARKER.search(self.text) is not None

    @property
    def mask_source(self) -> str:
        """How its assistant masks are made: ``generation`` (markers) or ``prefix``."""
        return "generation" if self.has_markers else "prefix"


def _from_config(config: object, where: Path) -> str | None:
    """The default template of a tokenizer_config.json's ``chat_template`` entry, None without one."""
    entry = config.get("chat_template") if isinstance(config, dict) else None
    if entry is None or isinstance(entry, str):
        return entry or None
    if isinstance(entry, list):
        named = {t.get("name"): t.get("template") for t in entry if isinstance(t, dict)}
        if isinstance(named.get("default"), str):
            return str(named["default"])
        raise ConfigError(KEY, f"{where}: chat_template lists templates {sorted(map(str, named))} but none named 'default'")
    raise ConfigError(KEY, f"{where}: chat_template is {type(entry).__name__}, not a template")


def find(tokenizer: str) -> ChatTemplate:
    """The chat template of the tokenizer ``--tokenizer`` names (a folder, or its tokenizer.json)."""
    if tokenizer == BYTES_TOKENIZER:
        raise ConfigError(KEY, "bytes has no chat template: --format chat needs a tokenizer folder that carries one")
    path = Path(tokenizer)
    folder = path if path.is_dir() else path.parent
    if not path.is_dir() and path.name != TOKENIZER_FILE:
        raise ConfigError(KEY, f"{tokenizer}: --format chat reads the tokenizer from its folder; name the folder holding {TOKENIZER_FILE}")
    jinja = folder / TEMPLATE_FILE
    if jinja.is_file():
        try:
            return ChatTemplate(str(folder), TEMPLATE_FILE, jinja.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(KEY, f"{jinja}: cannot read ({exc})") from None
    config_file = folder / CONFIG_FILE
    text = None
    if config_file.is_file():
        try:
            text = _from_config(read_json(config_file), config_file)
        except (OSError, ValueError) as exc:  # JsonFileError among them
            raise ConfigError(KEY, f"{config_file}: cannot read ({exc})") from None
    if text is None:
        raise ConfigError(KEY, f"{folder} has no chat template (a {TEMPLATE_FILE}, or chat_template in {CONFIG_FILE})")
    return ChatTemplate(str(folder), CONFIG_FILE, text)
