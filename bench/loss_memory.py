"""Peak memory growth of the loss from 2K to 4K tokens at vocabulary 128,256: chunked against whole logits (CPU, fp32).

The peak is that of live torch tensor storage during one forward and backward of the output
projection and the loss (``ringtrain_dev.live_bytes``). Unchunked, going from 2K to 4K tokens
adds at least 2K x 128,256 fp32 logits and their gradients; chunked, only the hidden states and
one log-sum-exp per token. Target: growth ratio chunked / unchunked <= 0.1.

    PYTHONPATH=platform python bench/loss_memory.py   # writes bench/results/loss_memory-cpu.json
"""

from __future__ import annotations

import sys

from ringtrain_dev.record import Run

VOCAB, DIM, CHUNK = 128_256, 256, 1024


def peak(tokens: int, chunk: int) -> int:
    import torch

    from ringtrain_dev.live_bytes import loss_peak

    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(tokens, DIM, generator=g, requires_grad=True)
    weight = (0.05 * torch.randn(VOCAB, DIM, generator=g)).requires_grad_()
    labels = torch.randint(0, VOCAB, (tokens,), generator=g)
    return loss_peak(hidden, weight, labels, chunk)


def main() -> int:
    run = Run("loss_memory")
    rows = {name: {n: peak(n, chunk) for n in (2048, 4096)} for name, chunk in (("unchunked", 0), ("chunked", CHUNK))}
    growth = {name: r[4096] - r[2048] for name, r in rows.items()}
    ratio = growth["chunked"] / growth["unchunked"]
    for name, r in rows.items():
        print(f"{name:<10} peak 2K {r[2048] / 1e6:9.1f} MB  4K {r[4096] / 1e6:9.1f} MB  growth {growth[name] / 1e6:9.1f} MB")
    print(f"growth ratio chunked / unchunked: {ratio:.4f} (target <= 0.1: {'PASS' if ratio <= 0.1 else 'FAIL'})")
    run.write({"vocab": VOCAB, "dim": DIM, "chunk": CHUNK, "peaks": rows, "growth": growth, "ratio": ratio}, device_type="cpu")
    return 0


if __name__ == "__main__":
    sys.exit(main())
