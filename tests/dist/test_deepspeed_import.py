"""A rank builds its DeepSpeed engine without importing mlflow or TorchInductor (seconds of CPU
each, every rank of every run), and the process still imports mlflow afterwards.

Run in a fresh interpreter: the suite's own processes may have imported either already.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ringtrain_dev.tiny import TINIEST_MODEL

pytestmark = [pytest.mark.dist]

REPO = Path(__file__).resolve().parents[2]
PROBE = """
import json, sys
import torch, torch.distributed as dist
from ringtrain import config
from ringtrain.train.trainer import Trainer, set_rank_env

device = torch.device("cpu")
set_rank_env(rank=0, world_size=1, device=device)
found = {}
for stage in json.loads(sys.argv[2]):  # each engine checked as soon as it is built
    # A group of its own: closing a trainer ends the process group.
    dist.init_process_group("gloo", store=dist.FileStore(f"{sys.argv[1]}-{stage}", 1), rank=0, world_size=1)
    trainer = Trainer(config.load(None, [*sys.argv[3:], f"zero.stage={stage}"]), rank=0, device=device)
    losses = [trainer.train_step().loss for _ in range(2)]
    trainer.close()
    found[stage] = {"loaded": {name: name in sys.modules for name in ("mlflow", "torch._inductor.compile_fx")}, "losses": losses}
import mlflow  # the driver's tracker imports it after DeepSpeed
print(json.dumps(found))
"""
# One interpreter for both stages: starting one costs seconds of CPU.
STAGES = [2, 3]


def test_an_engine_is_built_without_mlflow_or_inductor(tmp_path: Path) -> None:
    pytest.importorskip("mlflow")  # the test extras install it; without it there is nothing to hide
    args = [*TINIEST_MODEL, "data.seq_len=64", "train.global_batch=2", "train.micro_batch=1"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "platform"), str(REPO)])}
    done = subprocess.run([sys.executable, "-c", PROBE, str(tmp_path / "store"), json.dumps(STAGES), *args],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert list(found) == [str(stage) for stage in STAGES]
    for stage, result in found.items():
        assert result["loaded"] == {"mlflow": False, "torch._inductor.compile_fx": False}, f"zero.stage={stage}"
        assert all(loss == loss for loss in result["losses"]), f"zero.stage={stage}"  # trained: finite losses
