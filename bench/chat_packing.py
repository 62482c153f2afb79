"""Benchmark: how full whole-conversation rows are under next-fit and first-fit decreasing.

A chat dataset's rows hold whole conversations and padding (``train/conversations.py``); the
padding costs no attention but every other op of the step, so the share of a row's tokens that
are conversations is the share of the step's work that trains. Conversations of 47 to 1,018
tokens (log-uniform: many short ones and a long tail, as chat corpora have) are packed into rows
of 2K, 4K and 8K tokens by ``data.chat_packing: next_fit`` and ``first_fit`` (first-fit
decreasing within windows of 1,024 conversations), on the same draw; the packing's own time is
reported too (once per process, before the first step).

PASS when first-fit leaves at most half of next-fit's padding at every row length (at long rows
next-fit already fills most of each row, so the padding left, not the fill, is what can move).

Usage: python bench/chat_packing.py [--conversations 200000] [--out PATH]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from ringtrain_dev.record import Run

TARGET = 0.5
SEQ_LENS = (2048, 4096, 8192)
LOW, HIGH = 47, 1018


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=200_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    run = Run("chat_packing")

    import numpy as np

    from ringtrain.train.conversations import FIRST_FIT_WINDOW, PACKERS, pack_conversations

    rng = np.random.default_rng(args.seed)
    lengths = np.exp(rng.uniform(np.log(LOW), np.log(HIGH), size=args.conversations)).astype(np.int64)
    rows, ok = [], True
    print(f"{args.conversations:,} conversations of {LOW}-{HIGH} tokens (mean {lengths.mean():.0f}); "
          f"first-fit windows of {FIRST_FIT_WINDOW:,}")
    print(f"{'seq_len':>8}  {'packing':>9}  {'rows':>9}  {'fill':>7}  {'pack s':>7}")
    for seq_len in SEQ_LENS:
        fill = {}
        for packing in PACKERS:
            started = time.perf_counter()
            counts = pack_conversations(lengths, seq_len, args.seed, "drop", packing).counts()
            seconds = time.perf_counter() - started
            fill[packing] = counts["packed_tokens"] / counts["row_tokens"]
            rows.append({"seq_len": seq_len, "packing": packing, "rows": counts["rows"], "fill": fill[packing],
                         "pack_s": seconds})
            print(f"{seq_len:>8}  {packing:>9}  {counts['rows']:>9,}  {fill[packing]:>7.2%}  {seconds:>7.2f}")
        ratio = (1 - fill["first_fit"]) / (1 - fill["next_fit"])
        ok = ok and ratio <= TARGET
        print(f"{seq_len:>8}  first_fit / next_fit padding {ratio:.3f}x: {'PASS' if ratio <= TARGET else 'FAIL'} (target <= {TARGET}x)")
    run.write({"target_padding_ratio": TARGET, "pass": ok, "conversations": args.conversations, "lengths": [LOW, HIGH],
               "window": FIRST_FIT_WINDOW, "rows": rows}, device_type="cpu", out=args.out)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
