"""The tokenizer of a Hugging Face model folder (``tokenizer.json``), loaded locally.

Read with the ``tokenizers`` library, which transformers' fast tokenizers wrap: no network and
no transformers import (seconds) on the driver. ``first`` applies the tokenizer's own
post-processor, which is where a Llama-style tokenizer puts its beginning-of-sequence token.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Sequence

from ringtrain.errors import ConfigError
from ringtrain.links import check_inside

TOKENIZER_FILE = "tokenizer.json"


class HFTokenizer:
    def __init__(self, path: Path, key: str = "model.hf") -> None:
        from tokenizers import Tokenizer

        try:
            self._tok: Any = Tokenizer.from_file(str(path))
        except Exception as exc:  # the Rust side raises its own exception type
            raise ConfigError(key, f"{path} is not a readable tokenizer: {exc}") from None
        self.path = path
        self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str, *, first: bool = False) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=first).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=True))


def find_tokenizer(folder: str) -> Optional[HFTokenizer]:
    """The tokenizer of model folder ``folder``, or None when it has none (or no folder is given)."""
    if not folder:
        return None
    path = Path(folder) / TOKENIZER_FILE
    if not path.is_file():
        return None
    check_inside(folder, path, "model.hf")
    return HFTokenizer(path)
