"""Tiny byte-level BPE tokenizers trained locally (no download), saved as a model folder's
``tokenizer.json``: one small enough for the tiny test models' vocabulary, able to encode the
passkey prompts and any number; and one carrying a chat template (ChatML or Llama 3)."""

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


# Chat templates as models ship them (see NOTES.md "Chat templates"). ChatML with the
# {% generation %} markers transformers' assistant masks need (SmolLM3 and Qwen-style templates
# carry them): the assistant's text and its <|im_end|> are generated, the newline after is not.
CHATML_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}{{ '<|im_start|>assistant\\n' }}"
    "{% generation %}{{ m['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\\n' }}"
    "{% else %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# Meta-Llama-3-8B-Instruct's template, verbatim: no markers, so masks come from rendered prefixes.
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
    "message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
# The same text as LLAMA3_TEMPLATE with the assistant's turn (text and <|eot_id|>) in markers:
# what transformers' own assistant mask says of it, a reference for the prefix-derived mask.
LLAMA3_MARKED_TEMPLATE = (
    "{% for message in messages %}{% if loop.index0 == 0 %}{{ bos_token }}{% endif %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] | trim + '<|eot_id|>' }}{% endgeneration %}{% else %}"
    "{{ message['content'] | trim + '<|eot_id|>' }}{% endif %}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
# A tool-calling ChatML template that reads the record's ``tools``, its assistant turns written by
# ``tool_template(body)``: with ``{% generation %}`` around ``BODY`` (TOOLS_MARKED_TEMPLATE), without
# markers (TOOLS_TEMPLATE), or, as the masks' reference, with markers only on messages whose
# ``weight`` is not 0 (TOOLS_WEIGHTED_REFERENCE: transformers then masks the trained turns itself).
TOOLS_BODY = "{{ m['content'] + '<|im_end|>' }}"


def tool_template(assistant: str) -> str:
    return (
        "{% if tools %}{{ '<|im_start|>system\\ntools: ' }}{% for t in tools %}{{ t['name'] + ' ' }}{% endfor %}"
        "{{ '<|im_end|>\\n' }}{% endif %}{% for m in messages %}{% if m['role'] == 'assistant' %}"
        "{{ '<|im_start|>assistant\\n' }}" + assistant + "{{ '\\n' }}"
        "{% else %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )


TOOLS_TEMPLATE = tool_template(TOOLS_BODY)
TOOLS_MARKED_TEMPLATE = tool_template("{% generation %}" + TOOLS_BODY + "{% endgeneration %}")
TOOLS_WEIGHTED_REFERENCE = tool_template(
    "{% if m.get('weight', 1) != 0 %}{% generation %}" + TOOLS_BODY + "{% endgeneration %}{% else %}" + TOOLS_BODY + "{% endif %}"
)
CHAT_SPECIALS = ["<unk>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
CHAT_WORDS = "the a ring rank token shard step loss model train data long context attention you are terse why how".split()
# Each style: (EOS token, BOS token, template, where the folder keeps it).
CHAT_STYLES = {
    "chatml": ("<|im_end|>", None, CHATML_TEMPLATE, "tokenizer_config.json"),
    "llama3": ("<|eot_id|>", "<|begin_of_text|>", LLAMA3_TEMPLATE, "chat_template.jinja"),
}


def save_chat_tokenizer(folder: Path, style: str = "chatml", vocab_size: int = 320) -> Path:
    """A byte-level BPE tokenizer (every byte in its alphabet, so any text encodes) trained on
    CHAT_WORDS and the role names, with both families' control tokens,
    saved into ``folder`` with the ``style`` chat template (CHAT_STYLES): ChatML (markers) in
    tokenizer_config.json, Llama 3 (no markers) as chat_template.jinja. Returns the folder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    eos, bos, template, where = CHAT_STYLES[style]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [" ".join(CHAT_WORDS), "system\nuser\nassistant\ntool\n\n", "0123456789 .,?!:{}\"'"] * 4
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=CHAT_SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos, "unk_token": "<unk>"}
    if bos is not None:
        config["bos_token"] = bos
    if where == "tokenizer_config.json":
        config["chat_template"] = template
    else:
        (folder / where).write_text(template)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder
