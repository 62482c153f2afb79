"""Benchmark: a training step on chat data against the same tokens as packed text (masking is free).

Random conversations (assistant-turn loss masks, as ``ringtrain_dev/chat_data.py`` writes them) are
stored twice: as a chat dataset, and as the same conversations with every token trained (the
packed text of the same tokens: the same rows, the same documents, only the mask differs), so
the comparison isolates what masking costs. Three Trainers of the quickstart model (jobs/quickstart.yaml) on one gloo rank, all
with ``data.packing: doc`` and the same step shape (global batch x seq_len tokens), train in
turn, one step each per round so that load on a shared machine falls on all alike: text, chat
with ``train.loss_norm: token``, chat with ``sequence`` (per-token weights: the weighted loss).
The figure that decides PASS/FAIL: the median step time of chat (token) over text's, at most
1.02; sequence's ratio is reported too (on a GPU its weighted loss runs chunked where the
unweighted one runs liger's fused kernel).

Usage: python bench/chat_step.py [--steps 10] [--warmup 2] [--out PATH]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from ringtrain_dev.record import Run

ROOT = Path(__file__).resolve().parents[1]

TARGET = 0.02
KINDS = ("text", "chat-token", "chat-sequence")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--conversations", type=int, default=400)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    run = Run("chat_step")

    import torch
    import torch.distributed as dist

    from ringtrain import config
    from ringtrain.train.trainer import Trainer, set_rank_env
    from ringtrain_dev.chat_data import random_conversations, write_chat

    import numpy as np

    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as tmp_dir:
        convs = random_conversations(args.conversations, vocab_size=256, min_len=64, max_len=1024, seed=0)
        write_chat(Path(tmp_dir) / "chat", convs, vocab_size=256, docs_per_shard=64)
        every = [(t, np.append(0, np.ones(len(t) - 1)).astype(np.uint8)) for t, _ in convs]
        write_chat(Path(tmp_dir) / "text", every, vocab_size=256, docs_per_shard=64)
        base = ["data.packing=doc", "mesh.dp=1", "mesh.cp=1", "zero.stage=0", "checkpoint.snapshot_every=0",
                f"train.steps={args.steps + args.warmup}", "train.global_batch=2"]
        overrides = {
            "text": [f"data.path={Path(tmp_dir) / 'text'}"],
            "chat-token": [f"data.path={Path(tmp_dir) / 'chat'}", "train.loss_norm=token"],
            "chat-sequence": [f"data.path={Path(tmp_dir) / 'chat'}", "train.loss_norm=sequence"],
        }
        device = torch.device("cpu")
        set_rank_env(rank=0, world_size=1, device=device)
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        jobs = {k: config.load(ROOT / "jobs" / "quickstart.yaml", [*base, *o]) for k, o in overrides.items()}
        trainers = {k: Trainer(job, rank=0, device=device) for k, job in jobs.items()}
        times: dict[str, list[float]] = {k: [] for k in KINDS}
        trained: dict[str, int] = {k: 0 for k in KINDS}
        try:
            for step in range(args.steps + args.warmup):
                for kind in KINDS:
                    report = trainers[kind].train_step()
                    if step >= args.warmup:
                        times[kind].append(report.step_time_s)
                        trained[kind] += report.num_tokens
        finally:
            for trainer in trainers.values():
                trainer.prefetcher.close()
            dist.destroy_process_group()
    median = {k: statistics.median(v) for k, v in times.items()}
    ratio = {k: median[k] / median["text"] for k in KINDS}
    ok = ratio["chat-token"] <= 1.0 + TARGET
    job = jobs["text"]
    print(f"{args.steps} steps each of {job.train.global_batch} x {job.data.seq_len} tokens, quickstart model, CPU")
    for kind in KINDS:
        print(f"  {kind:14s} median {median[kind] * 1e3:8.1f} ms  ratio to text {ratio[kind]:.4f}")
    print(f"chat (token) / text = {ratio['chat-token']:.4f}: {'PASS' if ok else 'FAIL'} (target <= {1 + TARGET:.2f})")
    run.write({"target_ratio_within": TARGET, "pass": ok, "median_step_s": median, "ratio_to_text": ratio,
               "step_times_s": times, "steps": args.steps, "warmup_steps": args.warmup, "seq_len": job.data.seq_len,
               "global_batch": job.train.global_batch, "conversations": args.conversations},
              device_type="cpu", out=args.out)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
