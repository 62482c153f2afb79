"""Benchmark: how long a training step waits for its data, as a fraction of the step's time.

A byte-level prepared dataset of real text (one document per standard-library module, each
ending with EOS; shards and manifest in the ``ringtrain prepare`` format, written here directly
so the number does not include Ray) feeds ringtrain's Trainer on one gloo rank with
``data.packing: doc`` (the heavier path: document ids, restarted positions, label masking) and
the quickstart model (jobs/quickstart.yaml: dim 128, 4 layers, seq 2048).

The Trainer builds each step's micro-batches a step ahead on a background thread
(``BatchPrefetcher``) and reports the time the step blocked on them (``StepReport.data_wait_s``,
part of ``step_time_s``). The figure that decides PASS/FAIL: total wait over total step time,
warm-up steps excluded (the first step has nothing prefetched; it opens and checks shards).
Target <= 1%. For scale, the time building one step's batches takes without the prefetcher is
reported too: what the wait would be if the data were read on the critical path.

Usage: python bench/data_wait.py [--steps 10] [--warmup 2] [--out PATH]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from ringtrain_dev.record import Run

ROOT = Path(__file__).resolve().parents[1]

TARGET = 0.01


def _write_dataset(root: Path, num_docs: int) -> int:
    import numpy as np

    from ringtrain.prepared import BYTES_EOS_ID, BYTES_VOCAB_SIZE
    from ringtrain.train.data import stdlib_source_files
    from ringtrain_dev.prepared_data import write_prepared

    docs = []
    for f in stdlib_source_files()[:num_docs]:
        body = np.frombuffer(f.read_bytes(), dtype=np.uint8).astype(np.int64)
        docs.append(np.append(body[body != BYTES_EOS_ID], BYTES_EOS_ID))
    write_prepared(root, docs, vocab_size=BYTES_VOCAB_SIZE, eos_id=BYTES_EOS_ID, docs_per_shard=64,
                   tokenizer_sha256="bytes", tokenizer_name="bytes")
    return sum(len(d) for d in docs)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--docs", type=int, default=100, help="standard-library modules in the dataset")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    run = Run("data_wait")

    import torch
    import torch.distributed as dist

    from ringtrain import config
    from ringtrain.train.trainer import Trainer, set_rank_env

    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as tmp_dir:
        data = Path(tmp_dir) / "data"
        num_tokens = _write_dataset(data, args.docs)
        job = config.load(ROOT / "jobs" / "quickstart.yaml", [
            f"data.path={data}", "data.packing=doc", "mesh.dp=1", "mesh.cp=1", "zero.stage=0",
            f"train.steps={args.steps + args.warmup}", "checkpoint.snapshot_every=0", "train.global_batch=2",
        ])
        device = torch.device("cpu")
        set_rank_env(rank=0, world_size=1, device=device)
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        trainer = Trainer(job, rank=0, device=device)
        try:
            reports = [trainer.train_step() for _ in range(args.steps + args.warmup)]
            t0 = time.perf_counter()
            for batch in range(args.steps):
                trainer.data.step_batches(1000 + batch, 0)
            build_s = (time.perf_counter() - t0) / args.steps
        finally:
            trainer.close()
    timed = reports[args.warmup :]
    wait_s = sum(r.data_wait_s for r in timed)
    step_s = sum(r.step_time_s for r in timed)
    ratio = wait_s / step_s
    ok = ratio <= TARGET
    mean_step = step_s / len(timed)
    print(f"dataset: {args.docs} documents, {num_tokens} tokens; {len(timed)} steps of {job.train.global_batch} x "
          f"{job.data.seq_len} tokens, {mean_step * 1e3:.0f} ms each")
    print(f"waiting for data: {wait_s / len(timed) * 1e3:.3f} ms a step = {ratio:.4%} of step time; "
          f"{'PASS' if ok else 'FAIL'} (target <= {TARGET:.0%})")
    print(f"building a step's batches on the critical path would take {build_s * 1e3:.2f} ms = {build_s / mean_step:.2%}")
    run.write({"target_wait_fraction": TARGET, "pass": ok, "wait_fraction": ratio, "steps": len(timed),
               "warmup_steps": args.warmup, "mean_step_s": mean_step, "mean_wait_s": wait_s / len(timed),
               "first_step_wait_s": reports[0].data_wait_s, "unprefetched_build_s": build_s,
               "unprefetched_fraction": build_s / mean_step, "num_tokens": num_tokens, "num_documents": args.docs,
               "packing": "doc", "seq_len": job.data.seq_len, "global_batch": job.train.global_batch},
              device_type="cpu", out=args.out)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
