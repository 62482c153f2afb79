"""A tiny byte-level BPE tokenizer trained locally (no download), saved as a model folder's
``tokenizer.json``: small enough for the tiny test models' vocabulary, and able to encode the
passkey prompts and any number."""

from __future__ import annotations

import json
from pathlib import Path

from ringtrain.evaluation.passkey import FILLER, INSTRUCTION, NEEDLE, QUESTION

SPECIALS = ["<unk>", "<s>", "</s>"]  # ids 0, 1, 2: the test models' pad, bos and eos


def save_tokenizer(folder: Path, vocab_size: int = 96) -> Path:
    """Train on the passkey texts and the digits, save into ``folder``; returns the folder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [INSTRUCTION, FILLER * 3, NEEDLE.format(key="0123456789"), QUESTION, " 0 1 2 3 4 5 6 7 8 9"] * 4
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"})
    )
    return folder
