"""Benchmark: cached decoding (a KV cache sharded over the CP ranks) against the cache-less decode
evaluation ran before it, and how its time moves with the tokens generated and the CP degree.

A random decoder (dim 256, 4 layers, 8 query and 4 KV heads, 1,024-token vocabulary: enough for
attention to weigh at thousands of tokens, small enough for a CPU) continues one prompt greedily.

- flat: the time of each new token against the tokens generated before it, ``--new-long`` new
  tokens after a ``--prompt``-token prompt on one rank; the figure is the median of the last 8
  steps over the median of the first 8 (the target: at most 1.2).
- speedup: ``--new`` tokens after the prompt, cached (one prefill, then one token a forward)
  against the cache-less decode (every new token a forward over the prompt and the tokens so
  far, as ``Evaluator`` generated before the cache): the target is at least 10x. Both must give
  the same tokens.
- cp: prefill and decode time on a ring of 1, 2 and 4 gloo ranks (``--cp``), one process a rank
  (on a CPU of few cores the ranks share them: the figures say what the exchange costs, not what
  more devices would gain).

On a GPU (``--device cuda``), ``--prompt 131072`` gives tokens a second at a 128K-token prompt.

Usage: python bench/decode.py [--prompt 4096] [--new 64] [--new-long 256] [--cp 1,2,4] [--out PATH]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ringtrain_dev.record import Run

FLAT_TARGET, SPEEDUP_TARGET = 1.2, 10.0
WINDOW = 8  # steps a median of the flat figure takes
SHAPE = dict(vocab_size=1024, dim=256, n_layers=4, n_heads=8, n_kv_heads=4, head_dim=32, ffn_dim=512,
             norm_eps=1e-5, rope_theta=10000.0)


def _model(attention: Any, device: Any) -> Any:
    import torch

    from ringtrain.train.model import ModelArgs, Transformer

    torch.manual_seed(0)
    model = Transformer(ModelArgs(**SHAPE), attention_fn=attention, init_std=0.35).to(device)  # type: ignore[arg-type]
    return model.eval()


def _prompt(length: int) -> list[int]:
    import torch

    g = torch.Generator().manual_seed(1)
    return torch.randint(3, int(SHAPE["vocab_size"]), (length,), generator=g).tolist()


def cacheless(model: Any, prompt: list[int], new: int, device: Any) -> list[int]:
    """Greedy decoding without a cache on one rank: each new token a forward over everything so far."""
    import torch

    ids = list(prompt)
    for _ in range(new):
        x = torch.tensor([ids], device=device)
        logits = model(x, torch.arange(len(ids), device=device)[None])
        ids.append(int(logits[0, -1].argmax()))
    return ids[len(prompt):]


def _one_rank(device_type: str, prompt_len: int, new: int, new_long: int) -> dict[str, Any]:
    import torch

    from ringtrain.topology import CPLayout
    from ringtrain.train.attention import build_attention
    from ringtrain.train.decode import Decoder

    device = torch.device(device_type)
    attention = build_attention(CPLayout(1, 1), "auto", ring_group=None, ulysses_group=None)
    model = _model(attention, device)
    decoder = Decoder(model, attention, device)
    prompt = _prompt(prompt_len)
    with torch.no_grad():
        decoder.generate([prompt], 2)  # warm-up
        decoder.generate([prompt], new_long)
        steps = decoder.step_times
        first, last = statistics.median(steps[:WINDOW]), statistics.median(steps[-WINDOW:])
        started = time.perf_counter()
        cached_ids = decoder.generate([prompt], new)[0]
        cached_s = time.perf_counter() - started
        started = time.perf_counter()
        plain_ids = cacheless(model, prompt, new, device)
        cacheless_s = time.perf_counter() - started
    return {
        "flat": {"prompt": prompt_len, "new": new_long, "first_steps_ms": round(first * 1e3, 3),
                 "last_steps_ms": round(last * 1e3, 3), "ratio": round(last / first, 3),
                 "target": FLAT_TARGET, "pass": last / first <= FLAT_TARGET},
        "speedup": {"prompt": prompt_len, "new": new, "cached_s": round(cached_s, 3),
                    "cacheless_s": round(cacheless_s, 3), "ratio": round(cacheless_s / cached_s, 2),
                    "same_tokens": cached_ids == plain_ids, "target": SPEEDUP_TARGET,
                    "pass": cacheless_s / cached_s >= SPEEDUP_TARGET and cached_ids == plain_ids},
    }


def _rank_main(rank: int, world: int, store: str, prompt_len: int, new: int, results: Any) -> None:
    import torch
    import torch.distributed as dist

    from ringtrain.topology import CPLayout, Topology
    from ringtrain.train.attention import build_attention
    from ringtrain.train.decode import Decoder
    from ringtrain.train.mesh import build_mesh
    from ringtrain_dev.ranks import gloo_rank

    with gloo_rank(rank, world, store, results):
        mesh = build_mesh(Topology(1, world), rank)
        attention = build_attention(CPLayout(world, 1, "ring"), "auto", ring_group=mesh.ring_group,
                                    ulysses_group=mesh.ulysses_group)
        decoder = Decoder(_model(attention, torch.device("cpu")), attention, torch.device("cpu"))
        prompt = _prompt(prompt_len)
        with torch.no_grad():
            decoder.generate([prompt], 2)  # warm-up
            dist.barrier()
            started = time.perf_counter()
            decoder.generate([prompt], new)
            total = time.perf_counter() - started
        if rank == 0:
            decode_s = sum(decoder.step_times)
            results.put({"cp": world, "prefill_s": round(total - decode_s, 3), "decode_s": round(decode_s, 3),
                         "ms_per_token": round(decode_s / max(1, len(decoder.step_times)) * 1e3, 3),
                         "cache_mb_rank0": round((decoder.last_cache.nbytes if decoder.last_cache else 0) / 2**20, 2)})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt", type=int, default=4096)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--new-long", type=int, default=256)
    parser.add_argument("--cp", default="1,2,4")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    run = Run("decode")

    import torch

    from ringtrain_dev.ranks import run_ranks

    torch.set_num_threads(1 if args.device == "cpu" else torch.get_num_threads())
    results: dict[str, Any] = _one_rank(args.device, args.prompt, args.new, args.new_long)
    if args.device == "cuda":
        results["tokens_per_s"] = round(1e3 / results["flat"]["last_steps_ms"], 1)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            results["cp"] = [run_ranks(_rank_main, int(cp), Path(tmp), args.prompt, args.new, timeout=1800)
                             for cp in args.cp.split(",")]
    for name in ("flat", "speedup"):
        r = results[name]
        print(f"{name}: {r['ratio']} (target {'<=' if name == 'flat' else '>='} {r['target']}): "
              f"{'PASS' if r['pass'] else 'FAIL'}")
    for r in results.get("cp", []):
        print(f"cp {r['cp']}: prefill {r['prefill_s']} s, decode {r['ms_per_token']} ms a token")
    run.write(results, device_type=args.device, out=args.out)
    return 0 if results["flat"]["pass"] and results["speedup"]["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
