"""A tokenizer folder's chat template: which file holds it, its text and hash, and whether it marks generation.

The template is the model's own, read where transformers reads it, in transformers' order: a
``chat_template.jinja`` beside the tokenizer wins over the ``chat_template`` entry of
``tokenizer_config.json`` (a string, or a list of named templates whose ``default`` is the one
used). Its text is what prepare renders with and what the manifest's ``template_sha256``
hashes, so a dataset names the exact template its masks came from.

``--chat-template`` replaces it: a Jinja file of the user's, or the name of one that ships here
(``templates/``): templates that render as a family's own but wrap the assistant's turns in
``{% generation %}`` markers, for families whose own templates rewrite the history (Qwen3 drops
earlier turns' reasoning) and so cannot be masked from rendered prefixes.

A template that wraps the assistant's text in ``{% generation %}`` ... ``{% endgeneration %}``
gives its assistant masks directly (transformers' ``return_assistant_tokens_mask``); any other
is masked from its renderings of the conversation's prefixes (``chat_render``).

The record-level fields a template reads (``tools``, ``documents``, ``enable_thinking``, ...)
are its undeclared variables (``variables``), less the names the renderer itself provides.
"""

from __future__ import annotations

import functools
import hashlib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ringtrain.errors import ConfigError
from ringtrain.jsonfile import read_json
from ringtrain.evaluation.tokenizer import TOKENIZER_FILE
from ringtrain.prepared import BYTES_TOKENIZER

KEY = "--tokenizer"
OVERRIDE_KEY = "--chat-template"
TEMPLATE_FILE = "chat_template.jinja"
# The templates that ship, by the name --chat-template takes: templates/<name>.jinja.
SHIPPED_DIR = Path(__file__).parent / "templates"
CONFIG_FILE = "tokenizer_config.json"
# transformers' own test for a template's markers (utils/chat_template_utils.py).
GENERATION_MARKER = re.compile(r"\{\%-?\s*generation\s*-?\%\}")
# Names a template reads that never come from a record: what apply_chat_template passes itself
# (the conversation, its switches, the tokenizer's special tokens: any ``*_token(s)``) and the
# globals transformers' sandbox defines. A record's field of one of these names is not passed.
PROVIDED = frozenset({"messages", "add_generation_prompt", "continue_final_message", "raise_exception",
                      "strftime_now", "dict", "namespace", "range", "lipsum", "cycler", "joiner"})  # fmt: skip


def shipped() -> list[str]:
    """The names of the templates that ship (``--chat-template NAME``)."""
    return sorted(p.stem for p in SHIPPED_DIR.glob("*.jinja"))


def _generation_tag() -> Any:
    """A Jinja extension that parses ``{% generation %}`` blocks as plain scopes: enough to read a
    template's variables (transformers' own extension tracks the rendered spans)."""
    from jinja2 import nodes
    from jinja2.ext import Extension

    class GenerationTag(Extension):
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body).set_lineno(lineno)

    return GenerationTag


@functools.lru_cache(maxsize=8)
def template_variables(text: str) -> frozenset[str]:
    """The variables ``text`` reads without defining them, less ``PROVIDED`` and special tokens;
    none where it does not parse (the probe render then says why)."""
    import jinja2
    from jinja2 import meta

    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True, extensions=[_generation_tag(), "jinja2.ext.loopcontrols"])
    try:
        names = meta.find_undeclared_variables(env.parse(text))
    except jinja2.TemplateSyntaxError:
        return frozenset()
    return frozenset(n for n in names if n not in PROVIDED and not n.endswith(("_token", "_tokens")))


@dataclass(frozen=True)
class ChatTemplate:
    folder: str  # the tokenizer folder
    file: str  # TEMPLATE_FILE or CONFIG_FILE in the folder, or what --chat-template named
    text: str
    override: str = ""  # the --chat-template file's path: the template is not the tokenizer's

    @property
    def path(self) -> str:
        """The file holding the template, as messages name it."""
        return self.override or str(Path(self.folder) / self.file)

    @property
    def variables(self) -> frozenset[str]:
        """The record-level fields the template reads (``template_variables``)."""
        return template_variables(self.text)

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


def find(tokenizer: str, content: str = "chat") -> ChatTemplate:
    """The chat template of the tokenizer ``--tokenizer`` names (a folder, or its tokenizer.json),
    for ``--format`` ``content`` (chat or preference: the messages name it)."""
    if tokenizer == BYTES_TOKENIZER:
        raise ConfigError(KEY, f"bytes has no chat template: --format {content} needs a tokenizer folder that carries one")
    path = Path(tokenizer)
    folder = path if path.is_dir() else path.parent
    if not path.is_dir() and path.name != TOKENIZER_FILE:
        raise ConfigError(KEY, f"{tokenizer}: --format {content} reads the tokenizer from its folder; name the folder "
                               f"holding {TOKENIZER_FILE}")
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


def override(template: ChatTemplate, chosen: str) -> ChatTemplate:
    """``template`` with its text replaced by ``--chat-template``'s: a Jinja file's path, or the
    name of a template that ships."""
    path = Path(chosen)
    if not path.is_file():
        if chosen in shipped():
            path = SHIPPED_DIR / f"{chosen}.jinja"
        else:
            names = ", ".join(shipped())
            raise ConfigError(OVERRIDE_KEY, f"{chosen}: no such file, nor a template that ships ({names})")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(OVERRIDE_KEY, f"{path}: cannot read ({exc})") from None
    return ChatTemplate(template.folder, chosen, text, override=str(path))
