"""What evaluation needs of a tokenizer, and the byte-level one of models trained from scratch.

ringtrain trains byte-level models on text (``data.path`` of text files reads their bytes):
token ``b`` is byte ``b``. A Hugging Face model folder brings its own tokenizer
(``ringtrain.evaluation.tokenizer``); both answer the same two calls.
"""

from __future__ import annotations

from typing import Protocol, Sequence


class Tokenizer(Protocol):
    def encode(self, text: str, *, first: bool = False) -> list[int]:
        """Token ids of ``text``; ``first``: it starts a sequence (a tokenizer that puts a
        beginning-of-sequence token in front does so here only)."""
        ...

    def decode(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255."""

    vocab_size = 256

    def encode(self, text: str, *, first: bool = False) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        # A random model may emit any byte sequence: undecodable bytes become U+FFFD.
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")
