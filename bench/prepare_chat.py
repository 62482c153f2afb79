"""Benchmark: `ringtrain prepare --format chat` against its text path, over the same tokens, in one run.

Random multi-turn conversations (a system prompt, then 1-4 user/assistant exchanges of random
words) are written twice: as chat records (``messages``) and as texts, each text the very
string the chat template renders for its conversation. Both go through the command line
(``--quiet``, its embedded cluster on this machine's cores, one tokenizer folder), so the two
sides tokenize the same characters into nearly the same tokens (a text also gets an EOS);
what differs is what chat adds: checking each record's messages, rendering it through
transformers' ``apply_chat_template`` (jinja) and deriving its loss mask, once per template
kind: ChatML with ``{% generation %}`` markers (transformers' assistant masks), and Llama 3
without markers (the mask from the conversation's rendered prefixes: a rendering per turn).

Rates are tokens/s over the pipeline alone (first row to manifest published; the cluster's
start-up is reported apart). Sides alternate over ``--rounds`` and each ratio is the median:
a 2-core machine shared with other work moves single timings by a third. The target: chat at
least ``TARGET`` of text's rate, for both templates. Text is tokenized in Rust, a batch a
call; a conversation is rendered by jinja in Python, one call each (two per assistant turn for
the prefix method): at most three times the work of tokenizing it is what chat may cost.

Usage: ``.venv/bin/python bench/prepare_chat.py [--conversations 20000] [--rounds 3] [--out JSON]``
(about 40 s a round on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ringtrain_dev.record import Run

TARGET = 0.25
STYLES = ("chatml", "llama3")


def conversations(count: int, seed: int = 0) -> list[dict[str, Any]]:
    from ringtrain_dev.tiny_tokenizer import CHAT_WORDS

    rng = random.Random(seed)

    def say(n: int) -> str:
        return " ".join(rng.choice(CHAT_WORDS) for _ in range(n))

    out = []
    for _ in range(count):
        messages = [{"role": "system", "content": say(rng.randint(4, 12))}]
        for _ in range(rng.randint(1, 4)):
            messages += [{"role": "user", "content": say(rng.randint(8, 60))},
                         {"role": "assistant", "content": say(rng.randint(8, 120))}]  # fmt: skip
        out.append({"messages": messages})
    return out


def write_sources(folder: Path, tokenizer: Path, convs: list[dict[str, Any]]) -> tuple[Path, Path]:
    """(chat records, the same conversations as rendered texts) as JSONL files."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer))
    folder.mkdir(parents=True, exist_ok=True)
    chat, text = folder / "chats.jsonl", folder / "texts.jsonl"
    chat.write_text("".join(json.dumps(c) + "\n" for c in convs))
    rendered = tok.apply_chat_template([c["messages"] for c in convs], tokenize=False)
    text.write_text("".join(json.dumps({"text": r}) + "\n" for r in rendered))
    return chat, text


def prepare(source: Path, tokenizer: Path, out: Path, work: Path, *extra: str) -> dict[str, Any]:
    env = dict(os.environ, RAY_AUTH_MODE="disabled", HOME=str(work), RAY_TMPDIR=tempfile.mkdtemp(prefix="rtb-", dir="/tmp"))
    env.pop("RAY_ADDRESS", None)
    cmd = [sys.executable, "-m", "ringtrain", "prepare", str(source), "--tokenizer", str(tokenizer), "--out", str(out), "--quiet",
           # On the cluster, as measured: a corpus this small would otherwise be tokenized in process.
           "--num-cpus", str(os.cpu_count() or 1), *extra]
    t0 = time.perf_counter()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        raise SystemExit(f"prepare failed ({done.returncode}):\n{done.stderr[-3000:]}")
    match = re.search(r"([\d.]+) s: .* \(cluster start ([\d.]+) s", done.stdout)
    assert match, done.stdout
    manifest = json.loads((out / "manifest.json").read_text())
    seconds = float(match.group(1))
    return {"tokens": manifest["num_tokens"], "documents": manifest["num_documents"], "seconds": seconds,
            "cluster_start_s": float(match.group(2)), "command_wall_s": round(wall, 2),
            "tokens_per_s": round(manifest["num_tokens"] / seconds, 1),
            "trained_tokens": (manifest.get("chat") or {}).get("num_trained_tokens"),
            "mask_source": (manifest.get("chat") or {}).get("mask_source")}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None, help="the JSON to write (default bench/results/prepare_chat-cpu.json)")
    args = parser.parse_args()
    run = Run("prepare_chat")
    from ringtrain_dev.tiny_tokenizer import save_chat_tokenizer

    convs = conversations(args.conversations)
    rounds: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-prepare-chat-") as tmp:
        work = Path(tmp)
        sources = {}
        for style in STYLES:
            tokenizer = save_chat_tokenizer(work / f"tok-{style}", style=style)
            sources[style] = (tokenizer, *write_sources(work / f"src-{style}", tokenizer, convs))
        for number in range(args.rounds):
            one: dict[str, Any] = {}
            for style, (tokenizer, chat, text) in sources.items():
                # Alternate which side goes first: load drifts over a round.
                order = ("text", "chat") if number % 2 == 0 else ("chat", "text")
                for side in order:
                    out = work / f"out-{style}-{side}-{number}"
                    source, extra = (chat, ("--format", "chat")) if side == "chat" else (text, ())
                    one[f"{style}/{side}"] = prepare(source, tokenizer, out, work, *extra)
                one[f"{style}/ratio"] = one[f"{style}/chat"]["tokens_per_s"] / one[f"{style}/text"]["tokens_per_s"]
                print(f"round {number + 1}/{args.rounds} {style:<7} text {one[f'{style}/text']['tokens_per_s']:>10,.0f} tok/s  "
                      f"chat {one[f'{style}/chat']['tokens_per_s']:>10,.0f} tok/s  ({one[f'{style}/chat']['mask_source']})  "
                      f"ratio {one[f'{style}/ratio']:.3f}", flush=True)  # fmt: skip
            rounds.append(one)
    verdicts = {}
    for style in STYLES:
        ratio = statistics.median(r[f"{style}/ratio"] for r in rounds)
        ok = ratio >= TARGET
        print(f"{style}: chat / text tokens/s, median of {len(rounds)} rounds: {ratio:.3f}  target >= {TARGET}  {'PASS' if ok else 'FAIL'}")
        verdicts[style] = {"ratio": round(ratio, 4), "target": TARGET, "pass": ok}
    run.write({"conversations": args.conversations, "rounds": rounds, "verdicts": verdicts}, device_type="cpu", out=args.out)
    return 0 if all(v["pass"] for v in verdicts.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
