"""The tokenizer `ringtrain prepare` encodes with: resolved once on the driver, loaded in each worker.

``--tokenizer`` is ``bytes`` (one token per UTF-8 byte, EOS the NUL byte: see ``prepared``) or
a local Hugging Face tokenizer: a ``tokenizer.json`` file or a folder holding one (a model
folder as in ``model.hf``). It is read from disk only, never downloaded. Documents are encoded
without the tokenizer's special tokens (no BOS from its post-processor) and prepare appends the
EOS id to each, so every document ends the same way whatever the tokenizer's template.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Optional

import numpy as np

from ringtrain.errors import ConfigError
from ringtrain.jsonfile import read_json
from ringtrain.evaluation.tokenizer import TOKENIZER_FILE, HFTokenizer
from ringtrain.links import check_folder, check_inside
from ringtrain.prepared import BYTES_EOS_ID, BYTES_TOKENIZER, BYTES_VOCAB_SIZE, TokenizerInfo, tokenizer_sha256

KEY = "--tokenizer"
# Tried in order when no config file names the EOS token: the spellings of the common families
# (GPT-2/Qwen, Llama 3, Llama 2/Mistral, Gemma).
EOS_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>")


@dataclass(frozen=True)
class TokenizerSpec:
    """What a worker needs to load the tokenizer, and what the manifest records of it."""

    path: Optional[str]  # tokenizer.json; None for bytes
    info: TokenizerInfo


class BatchTokenizer(HFTokenizer):
    """A Hugging Face tokenizer that also encodes a batch and finds its EOS id."""

    def encode_many(self, texts: list[str]) -> list[list[int]]:
        # The same ids as encode_batch without the character offsets prepare never reads:
        # about a fifth less work per token.
        return [e.ids for e in self._tok.encode_batch_fast(texts, add_special_tokens=False)]

    def token_id(self, token: str) -> Optional[int]:
        found = self._tok.token_to_id(token)
        return None if found is None else int(found)


# The files beside a tokenizer.json that say which token ends a document, in the order asked.
EOS_CONFIG_FILES = ("tokenizer_config.json", "generation_config.json", "config.json")


def _config_eos(folder: Path) -> tuple[Optional[str], Optional[int]]:
    """(EOS token, EOS id) as the folder's tokenizer_config.json / config.json state them."""
    token: Optional[str] = None
    eos_id: Optional[int] = None
    for name in EOS_CONFIG_FILES:
        try:
            cfg: Any = read_json(folder / name)
        except (OSError, ValueError):  # JsonFileError among them: the next file may say
            continue
        value = cfg.get("eos_token") if isinstance(cfg, dict) else None
        if token is None and isinstance(value, dict):
            value = value.get("content")
        if token is None and isinstance(value, str):
            token = value
        ids = cfg.get("eos_token_id") if isinstance(cfg, dict) else None
        if eos_id is None and isinstance(ids, list) and ids:
            ids = ids[0]  # Llama 3 lists several stop ids; the first is its end-of-text
        if eos_id is None and isinstance(ids, int):
            eos_id = ids
    return token, eos_id


def resolve(arg: str) -> TokenizerSpec:
    """The tokenizer ``arg`` names, checked (exists, loads, has an EOS token) before any cluster starts."""
    if arg == BYTES_TOKENIZER:
        return TokenizerSpec(None, TokenizerInfo(BYTES_TOKENIZER, BYTES_TOKENIZER, BYTES_VOCAB_SIZE, BYTES_EOS_ID))
    path = Path(arg)
    file = path / TOKENIZER_FILE if path.is_dir() else path
    if not path.exists():
        raise ConfigError(KEY, f"{arg} does not exist (a folder with {TOKENIZER_FILE}, a {TOKENIZER_FILE}, or 'bytes')")
    if not file.is_file():
        raise ConfigError(KEY, f"{arg} has no {TOKENIZER_FILE}")
    if path.is_dir():
        check_folder(path, KEY)  # transformers reads more of it for --format chat
    else:
        # The files beside it are read too (its config, and for --format chat the template and
        # whatever else transformers loads): none of them may lead out of that folder.
        for entry in file.parent.iterdir():
            check_inside(file.parent, entry, KEY)
    tok = BatchTokenizer(file, key=KEY)
    token, eos_id = _config_eos(file.parent)
    if token is not None:
        eos_id = tok.token_id(token)
        if eos_id is None:
            raise ConfigError(KEY, f"{file.parent}: EOS token {token!r} of its config is not in {TOKENIZER_FILE}")
    if eos_id is None:
        eos_id = next((i for i in map(tok.token_id, EOS_CANDIDATES) if i is not None), None)
    if eos_id is None or not 0 <= eos_id < tok.vocab_size:
        raise ConfigError(KEY, f"{file}: no EOS token (set eos_token in {file.parent / 'tokenizer_config.json'})")
    name = file.parent.name if file.name == TOKENIZER_FILE else file.stem
    return TokenizerSpec(str(file), TokenizerInfo(name, tokenizer_sha256(file), tok.vocab_size, eos_id))


def absolute(spec: TokenizerSpec) -> TokenizerSpec:
    """``spec`` as the tokenizer actors load it on the cluster, from their own working directory."""
    return spec if spec.path is None else replace(spec, path=os.path.abspath(spec.path))


class Encoder:
    """Documents to one flat token array with EOS after each, in the dataset's dtype."""

    def __init__(self, spec: TokenizerSpec, dtype: str) -> None:
        self.spec = spec
        self.dtype = np.dtype(dtype)
        self._tok = BatchTokenizer(Path(spec.path), key=KEY) if spec.path else None

    def encode(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """(tokens, lengths): every document's ids then its EOS, concatenated; each one's length."""
        eos = self.spec.info.eos_id
        if not texts:
            return np.empty(0, dtype=self.dtype), np.empty(0, dtype=np.int64)
        if self._tok is None:
            # Bytes: the UTF-8 encoding is the token sequence; the NUL terminator is the EOS.
            encoded = [t.encode("utf-8") for t in texts]
            data = bytes([eos]).join(encoded) + bytes([eos])
            lengths = np.fromiter((len(e) + 1 for e in encoded), dtype=np.int64, count=len(encoded))
            return np.frombuffer(data, dtype=np.uint8).astype(self.dtype), lengths
        ids = self._tok.encode_many(texts)
        lengths = np.fromiter((len(d) + 1 for d in ids), dtype=np.int64, count=len(ids))
        flat = np.empty(int(lengths.sum()), dtype=self.dtype)
        ends = np.cumsum(lengths)
        start = 0
        for doc, end in zip(ids, ends):
            flat[start : end - 1] = doc
            flat[end - 1] = eos
            start = int(end)
        return flat, lengths
