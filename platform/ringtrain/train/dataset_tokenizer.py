"""Whether a prepared dataset's token ids mean what the model's do: the tokenizer its manifest
records against the model's own.

A model's tokens are its tokenizer's: a dataset prepared with another tokenizer trains or scores
other words under the same ids, with no error and a loss that means nothing. So ``ringtrain
run`` and ``ringtrain eval`` compare the tokenizer a dataset was prepared with (the sha256 of its
``tokenizer.json``, as ``ringtrain prepare`` records it) with the model's: the ``tokenizer.json``
of its Hugging Face folder, else, for a model ringtrain trained from scratch, the tokenizer of
the prepared data it trained on. A model folder without a ``tokenizer.json`` gives nothing to
compare with: that is said, not passed over.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from ringtrain.config import STDLIB_CORPUS
from ringtrain.errors import ConfigError, DataError
from ringtrain.evaluation.tokenizer import TOKENIZER_FILE
from ringtrain.prepared import BYTES_TOKENIZER, TokenizerInfo, tokenizer_sha256
from ringtrain.uris import local_path


@dataclass(frozen=True)
class ModelTokenizer:
    """The model's tokenizer identity (``sha256``) and where it comes from, for messages."""

    sha256: str
    where: str  # "model.hf's tokenizer (/m/tokenizer.json)", "the tokenizer of its training data (...)"


def folder_tokenizer(folder: str, key: str = "model.hf") -> Optional[ModelTokenizer]:
    """The tokenizer of a model folder, or None when it has no ``tokenizer.json`` (or no folder)."""
    if not folder:
        return None
    path = Path(folder) / TOKENIZER_FILE
    if not path.is_file():
        return None
    try:
        return ModelTokenizer(tokenizer_sha256(path), f"the model's tokenizer ({path})")
    except OSError as exc:
        raise ConfigError(key, f"cannot read {path}: {exc.strerror}") from None


def check_same(path: str, tok: TokenizerInfo, model: ModelTokenizer, key: str, prepare_with: str) -> None:
    """ConfigError naming ``key`` when dataset ``path`` was prepared with another tokenizer than
    the model's; ``prepare_with`` is the ``--tokenizer`` to prepare it again with ("" when none)."""
    if tok.sha256 == model.sha256:
        return
    again = f"; prepare it again with --tokenizer {prepare_with}" if prepare_with else "; prepare it with the model's tokenizer"
    raise ConfigError(
        key,
        f"{path} was tokenized with {tok.name!r} (tokenizer.json sha256 {tok.sha256[:12]}), not with "
        f"{model.where} (sha256 {model.sha256[:12]}): its token ids are other words to this model{again}",
    )


def unchecked_note(folder: str, path: str, tok: TokenizerInfo, key: str) -> str:
    """The warning for a model folder without a tokenizer: nothing to compare ``path`` with."""
    return (
        f"{key}: {folder} has no {TOKENIZER_FILE}, so whether {path} (tokenized with {tok.name!r}, sha256 "
        f"{tok.sha256[:12]}) uses the model's token ids cannot be checked; add the model's tokenizer.json to {folder}"
    )


def trained_tokenizer(first_source: str) -> Optional[ModelTokenizer]:
    """The tokens a model trained from scratch by ringtrain knows, from ``first_source``, the
    data it trained on (``data.path`` or its first ``data.sources``): that prepared dataset's
    tokenizer, or bytes for text it read byte by byte; None for a token file of unknown origin,
    or a dataset that cannot be read now."""
    from ringtrain.train.corpus import is_prepared_path, read_manifest
    from ringtrain.train.data import is_byte_corpus

    local = local_path(first_source)
    if first_source != STDLIB_CORPUS and local is not None and not local.exists():
        return None  # moved or deleted since: nothing tells what it held, text or a dataset
    if not is_prepared_path(first_source):
        return ModelTokenizer(BYTES_TOKENIZER, f"the bytes it trained on ({first_source})") if is_byte_corpus(first_source) else None
    try:
        tok = read_manifest(first_source).tokenizer
    except (DataError, ValueError, OSError):
        return None
    return ModelTokenizer(tok.sha256, f"the tokenizer of the data it trained on ({tok.name!r}, {first_source})")
