"""A generated chat corpus and a tiny chat model for jobs/sft-chat.yaml (the README's example).

The model stands in for a downloaded chat model: a 2-layer Llama whose tokenizer (a byte-level
BPE trained here on the corpus) carries a ChatML chat template with {% generation %} markers,
the template's assistant turns being what `ringtrain prepare --format chat` trains on. The
corpus is 400 conversations of random words: a system prompt, then one to three user/assistant
exchanges. Seeded: the same files on every run.

Usage: python jobs/tiny_chat.py [CORPUS_JSONL] [MODEL_FOLDER]   (default data/chats.jsonl runs/tiny-chat)
"""

import json
import random
import sys
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM

WORDS = "the a ring rank token shard step loss model train data long context attention".split()
CHATML = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}{{ '<|im_start|>assistant\\n' }}"
    "{% generation %}{{ m['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\\n' }}"
    "{% else %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endif %}{% endfor %}"
)


def conversations(rng: random.Random, count: int) -> list[dict]:
    def say(low: int, high: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high)))

    chats = []
    for _ in range(count):
        messages = [{"role": "system", "content": "You are terse."}]
        for _ in range(rng.randint(1, 3)):
            messages += [{"role": "user", "content": say(3, 12)}, {"role": "assistant", "content": say(3, 30)}]
        chats.append({"messages": messages})
    return chats


def save_chat_model(folder: Path, texts: list[str]) -> None:
    """A byte-level BPE tokenizer trained on ``texts`` with the ChatML template, and a 2-layer Llama
    of its vocabulary, saved in ``folder`` as a Hugging Face model folder."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok.train_from_iterator(texts + ["system user assistant"],
                            trainers.BpeTrainer(vocab_size=256, special_tokens=["<unk>", "<|im_start|>", "<|im_end|>"]))  # fmt: skip
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    settings = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "unk_token": "<unk>", "chat_template": CHATML}
    (folder / "tokenizer_config.json").write_text(json.dumps(settings))

    torch.manual_seed(0)  # the model's initial weights
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, eos_token_id=2)  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(folder)


def main() -> None:
    corpus = Path(sys.argv[1] if len(sys.argv) > 1 else "data/chats.jsonl")
    folder = Path(sys.argv[2] if len(sys.argv) > 2 else "runs/tiny-chat")
    chats = conversations(random.Random(0), 400)
    corpus.parent.mkdir(parents=True, exist_ok=True)
    corpus.write_text("".join(json.dumps(c) + "\n" for c in chats))
    save_chat_model(folder, [m["content"] for c in chats for m in c["messages"]])
    print(f"wrote {len(chats)} conversations to {corpus} and a tiny chat model to {folder}")


if __name__ == "__main__":
    main()
