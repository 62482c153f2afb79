"""A generated preference corpus and a tiny chat model for jobs/dpo-chat.yaml (docs/data.md's example).

Each pair answers a user's question of random words after the system prompt "You are terse.":
the chosen answer in words of the ring (``RING_WORDS``), the rejected one, as long, in the other
words, so the preference is one a 2-layer model learns within a few steps. A held-out set of
conversations (new questions, answered as the chosen answers are) and one of pairs are what
`ringtrain eval` scores the tuned model on: its next-token loss, and its DPO loss and rewards. The model is jobs/tiny_chat.py's: a 2-layer Llama
whose byte-level BPE tokenizer, trained here on the corpus, carries a ChatML template. Seeded:
the same files on every run.

Usage: python jobs/tiny_pairs.py [PAIRS_JSONL] [HELD_OUT_JSONL] [MODEL_FOLDER] [HELD_OUT_PAIRS_JSONL]
       (default data/pairs.jsonl data/held-out.jsonl runs/tiny-chat data/held-out-pairs.jsonl)
"""

import json
import random
import sys
from pathlib import Path

from tiny_chat import WORDS, save_chat_model

SYSTEM = {"role": "system", "content": "You are terse."}
RING_WORDS = ("ring", "rank", "shard", "token", "step")
OTHER_WORDS = tuple(w for w in WORDS if w not in RING_WORDS)


def question_and_answers(rng: random.Random) -> tuple[str, str, str]:
    """A question, an answer in the ring's words (chosen) and one as long in the others (rejected)."""
    length = rng.randint(3, 12)

    def say(words: tuple[str, ...]) -> str:
        return " ".join(rng.choice(words) for _ in range(length))

    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12))), say(RING_WORDS), say(OTHER_WORDS)


def pairs(rng: random.Random, count: int) -> list[dict]:
    """Conversational preference records (TRL's layout): a prompt of messages, then each answer."""
    out = []
    for _ in range(count):
        question, chosen, rejected = question_and_answers(rng)
        out.append({"prompt": [SYSTEM, {"role": "user", "content": question}],
                    "chosen": [{"role": "assistant", "content": chosen}],
                    "rejected": [{"role": "assistant", "content": rejected}]})  # fmt: skip
    return out


def held_out(rng: random.Random, count: int) -> list[dict]:
    """Conversations answered as the chosen answers are, none of them a training pair's."""
    out = []
    for _ in range(count):
        question, chosen, _ = question_and_answers(rng)
        out.append({"messages": [SYSTEM, {"role": "user", "content": question}, {"role": "assistant", "content": chosen}]})
    return out


def write_jsonl(path: Path, records: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def main() -> None:
    defaults = ["data/pairs.jsonl", "data/held-out.jsonl", "runs/tiny-chat", "data/held-out-pairs.jsonl"]
    corpus, evaluation, folder, evaluation_pairs = (Path(a) for a in (sys.argv[1:] + defaults[len(sys.argv) - 1 :])[:4])
    training, heldout, heldout_pairs = pairs(random.Random(0), 400), held_out(random.Random(1), 100), pairs(random.Random(2), 50)
    write_jsonl(corpus, training)
    write_jsonl(evaluation, heldout)
    write_jsonl(evaluation_pairs, heldout_pairs)
    texts = [m["content"] for p in training for m in (*p["prompt"], *p["chosen"], *p["rejected"])]
    save_chat_model(folder, texts)
    print(f"wrote {len(training)} preference pairs to {corpus}, {len(heldout)} held-out conversations to "
          f"{evaluation}, {len(heldout_pairs)} held-out pairs to {evaluation_pairs} and a tiny chat model to {folder}")  # fmt: skip


if __name__ == "__main__":
    main()
