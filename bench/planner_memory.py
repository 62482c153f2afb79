"""Measured vs predicted peak memory per rank of small jobs trained on CPU (gloo ranks, fp32).

Each config (``ringtrain_dev.peak_memory``: its docstring says how the peak is measured, and
what makes it the steady state the planner models) trains through ringtrain's own Trainer on
real gloo ranks; the reference is the planner's estimate for the same config on CPU. The tests
(tests/dist/test_planner_memory.py) check part of them; this runs them all, ZeRO optimizer
offload and four-rank layouts included, and prints each ratio.

    PYTHONPATH=platform python bench/planner_memory.py   # writes bench/results/planner_memory-cpu.json
"""

from __future__ import annotations

import sys

from ringtrain_dev.peak_memory import CONFIGS, EXTRA_CONFIGS, SAVER_CONFIGS, STEPS, ZERO_OFFLOAD_CONFIGS, compare
from ringtrain_dev.record import Run


def main() -> int:
    run = Run("planner_memory")
    rows = compare({**CONFIGS, **SAVER_CONFIGS, **ZERO_OFFLOAD_CONFIGS, **EXTRA_CONFIGS})
    print(f"{'config':<18} {'predicted MB':>13} {'measured MB':>12} {'ratio':>6} {'w/o buffers':>12}")
    for row in rows:
        print(
            f"{row['config']:<18} {row['predicted']['total'] / 1e6:>13.2f} {row['measured'] / 1e6:>12.2f} "
            f"{row['ratio']:>6.3f} {row['ratio_without_zero_buffers']:>12.3f}"
        )
    run.write({"dtype": "fp32", "steps": STEPS, "rows": rows}, device_type="cpu")
    return 0


if __name__ == "__main__":
    sys.exit(main())
