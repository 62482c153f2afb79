"""A step reads nothing off the device once it has launched its snapshot's copy.

On a GPU the copy runs on a side stream into host memory while the next step computes; a read of
a scalar (``.item()``, ``float(t)``) queued after it waits for the whole copy, since copies in one
direction share a copy engine in order (at 1.1B parameters that was a quarter of a second a step).
So the step reads its loss, local loss and gradient norm before the capture. On a CPU the reads are
instant, but their order is the same code: this counts the reads between the capture and the
step's return.
"""

from __future__ import annotations

import traceback
from pathlib import Path
from typing import Any

import pytest

from ringtrain_dev.ranks import gloo_rank, run_ranks
from ringtrain_dev.tiny import TINY_MODEL

pytestmark = pytest.mark.dist

STEPS = 3
JOB = [*TINY_MODEL, "data.seq_len=64", "train.global_batch=2", f"train.steps={STEPS}", "checkpoint.snapshot_every=1"]
READS = ("item", "__float__", "__int__", "tolist", "cpu", "numpy")  # each copies device memory to the host


def _rank_main(rank: int, world: int, store: str, overrides: list[str], results: Any) -> None:
    import torch

    from ringtrain import config
    from ringtrain.train.trainer import Trainer

    with gloo_rank(rank, world, store, results):
        trainer = Trainer(config.load(None, overrides), rank=rank, device=torch.device("cpu"))
        after_capture: list[str] = []
        captured = [False]
        real_capture = trainer.snapshotter.capture

        def capture(*args: Any, **kwargs: Any) -> None:
            real_capture(*args, **kwargs)
            captured[0] = True

        def counted(name: str) -> Any:
            real = getattr(torch.Tensor, name)

            def read(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
                if captured[0]:
                    after_capture.append(f"{name}: " + "".join(traceback.format_stack(limit=3)[:-1]))
                return real(self, *args, **kwargs)

            return read

        trainer.snapshotter.capture = capture  # type: ignore[method-assign]
        for name in READS:
            setattr(torch.Tensor, name, counted(name))
        taken = 0
        for _ in range(STEPS):
            captured[0] = False
            taken += trainer.train_step().snapshot_taken
        trainer.close()
        results.put((taken, after_capture))


def test_a_step_reads_its_scalars_before_the_snapshot_copy_starts(tmp_path: Path) -> None:
    taken, after_capture = run_ranks(_rank_main, 1, tmp_path, JOB)
    assert taken == STEPS
    assert after_capture == [], "device reads after the snapshot's capture:\n" + "\n".join(after_capture)
