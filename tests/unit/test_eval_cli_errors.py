"""`ringtrain eval` on bad input: exit 2, one stderr line naming what to change, no traceback.

As in test_cli_errors, the subprocesses see stand-in ``torch``, ``ray`` and ``deepspeed``
packages that refuse to be imported: every check here happens before any of them is loaded,
let alone a cluster started.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Optional

import numpy as np
import pytest

from tests.tiny_tokenizer import save_tokenizer

REPO = Path(__file__).resolve().parents[2]
HEAVY_MODULES = ("torch", "ray", "deepspeed")
LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 96, "hidden_size": 64,
    "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 32, "rms_norm_eps": 1e-6, "hidden_act": "silu", "rope_theta": 10000.0,
}  # fmt: skip


def _eval(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return run_cli(tmp_path, "eval", *args)


def run_cli(tmp_path: Path, *args: str, refused: tuple[str, ...] = HEAVY_MODULES,
            env_extra: Optional[dict[str, str]] = None) -> subprocess.CompletedProcess[str]:
    """``ringtrain ARGS`` with the ``refused`` modules (torch, Ray and DeepSpeed) refusing to be imported."""
    poison = tmp_path / "poison"
    for name in refused:
        (poison / name).mkdir(parents=True, exist_ok=True)
        (poison / name / "__init__.py").write_text(f"raise ImportError('{name} imported before the input was checked')\n")
    env = dict(os.environ, HOME=str(tmp_path), RAY_AUTH_MODE="disabled", **(env_extra or {}))
    env.pop("RAY_ADDRESS", None)
    env["PYTHONPATH"] = os.pathsep.join([str(poison), str(REPO / "platform"), env.get("PYTHONPATH", "")])
    return subprocess.run(
        [sys.executable, "-m", "ringtrain", *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60
    )


@pytest.fixture
def model(tmp_path: Path) -> Path:
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(LLAMA))
    return folder


@pytest.fixture
def rows(tmp_path: Path) -> Path:
    path = tmp_path / "rows.npy"
    np.save(path, np.arange(2 * 16).reshape(2, 16) % 90)
    return path


CASES = {
    "no-source": ([], "SOURCE: is missing"),
    "no-data": (["{model}"], "--data: is missing"),
    "missing-source": (["{tmp}/nowhere", "--data", "{rows}"], "SOURCE: no such run directory, checkpoint or model folder"),
    "missing-data": (["{model}", "--data", "{tmp}/nothing.npy"], "--data: no such file or directory"),
    "out-of-vocab": (["{model}", "--data", "stdlib"], "--data: stdlib holds token id"),
    "bad-passkey-list": (["{model}", "--data", "{rows}", "--passkey", "1k"], "--passkey: '1k' is not a comma-separated list"),
    "passkey-without-tokenizer": (["{model}", "--data", "{rows}", "--passkey", "400"], "--passkey: the model has no tokenizer.json"),
    "short-passkey": (["{tokmodel}", "--data", "{rows}", "--passkey", "400,20"], "--passkey: 20 tokens cannot hold the passkey prompt"),
    "bad-depth": (["{model}", "--data", "{rows}", "--passkey", "400", "--passkey-depths", "0,2"], "--passkey-depths[1]: must be in [0, 1]"),
    "bad-seq-len": (["{model}", "--data", "stdlib", "--seq-len", "0"], "--seq-len: must be >= 1"),
    "bad-bucket": (["{model}", "--data", "{rows}", "--bucket-tokens", "0"], "--bucket-tokens: must be >= 1"),
    "unknown-key": (["{model}", "--data", "{rows}", "mesh.bogus=1"], "mesh.bogus: unknown key"),
    "bad-mesh": (["{model}", "--data", "{rows}", "mesh.cp=2", "attention.impl=ulysses", "mesh.ulysses=3"], "mesh.ulysses"),
    "run-without-checkpoints": (["{run}", "--data", "{rows}"], "SOURCE: {run} has no valid durable checkpoint"),
    "empty-checkpoint-store": (["file://{tmp}/store", "--data", "{rows}"], "SOURCE: no valid checkpoint in"),
}


@pytest.mark.parametrize(("args", "expected"), CASES.values(), ids=CASES.keys())
def test_bad_input_exits_2_with_one_line(tmp_path: Path, model: Path, rows: Path, args: list[str], expected: str) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("name: r\n")
    (tmp_path / "store").mkdir()
    tokmodel = save_tokenizer(tmp_path / "tokmodel")
    (tokmodel / "config.json").write_text(json.dumps(LLAMA))
    names = {"model": model, "tokmodel": tokmodel, "rows": rows, "tmp": tmp_path, "run": run}
    proc = _eval(tmp_path, *(a.format(**names) for a in args))
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert expected.format(**names) in lines[0], lines[0]
    assert "Traceback" not in proc.stderr and proc.stdout == ""
