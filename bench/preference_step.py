"""Benchmark: a preference step with the prompt laid out once against twice, on the CPU.

Pairs of a long prompt and two short completions (``--prompt-tokens`` about 6K, completions about
512 tokens, as long-context preference data has them) are prepared with ``ringtrain prepare
--format preference`` and trained by the real Trainer on one gloo rank, one pair a step, SimPO
(its step costs what DPO's does, without the reference pass): with ``data.prefix_sharing: true``
(the prompt once, both completions continuing it: P + C + R + 1 tokens a row) and ``false``
(prompt + chosen and prompt + rejected: 2 P + C + R tokens), each row as long as its layout needs
(rounded up to an even length). The two layouts give the same losses (tests/dist/
test_preference_loss.py); the figure is the median step time of the two-document layout over the
shared one's, measured in the same run, alternating, warm-up steps left out. Target >= 1.3x.

Usage: python bench/preference_step.py [--prompt-tokens 6144] [--completion-tokens 512] [--steps 6] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from ringtrain_dev.record import Run

TARGET = 1.3
VOCAB = 320
# A small model of the quickstart's shape: the step's cost is its tokens' and their attention's.
MODEL = ["model.dim=128", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", f"model.vocab_size={VOCAB}",
         "model.ffn_dim=256"]  # fmt: skip


def _dataset(root: Path, prompt_tokens: int, completion_tokens: int, pairs: int) -> tuple[Path, int, int, int, int]:
    """A preference dataset of ``pairs`` pairs; the longest pair's row in each layout, and the
    median prompt and completion as the template rendered them (tokens)."""
    import numpy as np
    from tokenizers import Tokenizer

    from ringtrain import cli
    from ringtrain.train.corpus import PreparedCorpus
    from ringtrain.train.pairs import row_length
    from ringtrain_dev.tiny_tokenizer import CHAT_WORDS, save_chat_tokenizer

    rng = random.Random(0)
    tokenizer = save_chat_tokenizer(root / "tokenizer", "chatml", vocab_size=VOCAB)
    encoder = Tokenizer.from_file(str(tokenizer / "tokenizer.json"))
    cost = {word: len(encoder.encode(" " + word).ids) for word in CHAT_WORDS}  # each word's tokens, its space included

    def words(tokens: int) -> str:  # words drawn until the tokenizer counts ``tokens``
        drawn, count = [], 0
        while count < tokens:
            drawn.append(rng.choice(CHAT_WORDS))
            count += cost[drawn[-1]]
        return " ".join(drawn)

    records = [{"prompt": words(prompt_tokens), "chosen": words(completion_tokens), "rejected": words(completion_tokens)}
               for _ in range(pairs)]  # fmt: skip
    (root / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    code = cli.main(["prepare", str(root / "pairs.jsonl"), "--format", "preference", "--tokenizer", str(tokenizer),
                     "--out", str(root / "data"), "--quiet"])  # fmt: skip
    if code:
        raise SystemExit(f"prepare failed ({code})")
    corpus = PreparedCorpus(str(root / "data"))
    lengths = corpus.document_lengths().reshape(-1, 3)
    corpus.close()
    prompt, completion = int(np.median(lengths[:, 0])), int(np.median(lengths[:, 1:]))
    print(f"{pairs} pairs; median prompt {prompt} tokens, completions {completion} tokens")
    # A row is seq_len + 1 tokens; seq_len even (the zigzag layout's two chunks).
    longest = {shared: int(row_length(lengths[:, 0], lengths[:, 1], lengths[:, 2], shared).max()) for shared in (True, False)}
    return root / "data", *(-(-longest[shared] // 2) * 2 for shared in (True, False)), prompt, completion


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-tokens", type=int, default=6144)
    parser.add_argument("--completion-tokens", type=int, default=512)
    parser.add_argument("--steps", type=int, default=6, help="timed steps of each layout (after one warm-up step)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    run = Run("preference_step")

    import torch
    import torch.distributed as dist

    from ringtrain import config
    from ringtrain.train.trainer import Trainer, set_rank_env

    torch.set_num_threads(2)
    device = torch.device("cpu")
    set_rank_env(rank=0, world_size=1, device=device)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    times: dict[bool, list[float]] = {True: [], False: []}
    with tempfile.TemporaryDirectory() as tmp:
        data, shared_len, twice_len, prompt, completion = _dataset(Path(tmp), args.prompt_tokens, args.completion_tokens,
                                                                   args.steps + 1)
        trainers = {}
        for shared, seq_len in ((True, shared_len), (False, twice_len)):
            job = config.load(None, [*MODEL, f"data.path={data}", "data.packing=doc", f"data.seq_len={seq_len}",
                                     f"data.prefix_sharing={str(shared).lower()}", "train.objective=simpo",
                                     "mesh.dp=1", "mesh.cp=1", "zero.stage=0", "train.global_batch=1",
                                     f"train.steps={args.steps + 1}", "checkpoint.snapshot_every=0"])  # fmt: skip
            trainers[shared] = Trainer(job, rank=0, device=device)
        for step in range(args.steps + 1):
            for shared in (True, False):  # alternating: the machine's load falls on both alike
                started = time.perf_counter()
                trainers[shared].train_step()
                if step:
                    times[shared].append(time.perf_counter() - started)
        for trainer in trainers.values():
            trainer.prefetcher.close()
    dist.destroy_process_group()
    shared_s, twice_s = statistics.median(times[True]), statistics.median(times[False])
    ratio = twice_s / shared_s
    ok = ratio >= TARGET
    print(f"prompt shared: {shared_len} tokens a row, {shared_s:.2f} s a step; twice: {twice_len} tokens, {twice_s:.2f} s")
    print(f"shared is {ratio:.2f}x faster: {'PASS' if ok else 'FAIL'} (target >= {TARGET}x)")
    run.write({"target_speedup": TARGET, "pass": ok, "speedup": ratio, "shared_step_s": shared_s, "twice_step_s": twice_s,
               "shared_row_tokens": shared_len, "twice_row_tokens": twice_len, "steps": args.steps,
               "prompt_tokens": prompt, "completion_tokens": completion,  # as rendered: the template's tokens included
               "objective": "simpo", "model": MODEL}, device_type="cpu", out=args.out)  # fmt: skip
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
