"""The GPU tier's entry points, checked where there is no GPU: what they install, and that they
refuse (rather than skip) when the GPU they need is missing or unusable.

- flash-attn is built as its README says: after torch, without build isolation, at one pinned
  2.x version shared by the image (infra/Dockerfile) and ``make test-gpu``. Under isolation
  pip builds it without the installed torch and the build fails.
- ``make test-gpu`` fails where nvidia-smi sees a GPU that torch cannot use, instead of letting
  every GPU test skip; ``make gpu-check`` fails on a machine with no GPU at all.
- bench/train.py exits 2 with a message without CUDA; tests/gpu collects on a CPU machine.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
MAKEFILE = (REPO / "Makefile").read_text()
DOCKERFILE = (REPO / "infra" / "Dockerfile").read_text()

needs_no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
slow = pytest.mark.slow  # a subprocess that imports torch: seconds


def _makefile_var(name: str) -> str:
    found = re.search(rf"^{name} \?= (\S+)$", MAKEFILE, re.MULTILINE)
    assert found, f"Makefile sets no {name}"
    return found.group(1)


def _docker_runs() -> list[str]:
    joined = re.sub(r"\\\n", " ", DOCKERFILE)
    return [line.strip()[4:] for line in joined.splitlines() if line.strip().startswith("RUN ")]


def test_flash_attn_pinned_once_for_the_image_and_make() -> None:
    version = _makefile_var("FLASH_ATTN_VERSION")
    assert re.fullmatch(r"2\.\d+\.\d+(\.post\d+)?", version), version
    assert re.search(rf"^ARG FLASH_ATTN_VERSION={re.escape(version)}$", DOCKERFILE, re.MULTILINE)


def test_image_builds_flash_attn_after_torch_without_isolation() -> None:
    runs = _docker_runs()
    torch_at = next(i for i, run in enumerate(runs) if 'pip install "torch==${TORCH_VERSION}"' in run)
    flash = [i for i, run in enumerate(runs) if "flash-attn==${FLASH_ATTN_VERSION}" in run]
    ringtrain_at = next(i for i, run in enumerate(runs) if re.search(r"pip install (\.|\"\.\[)", run))
    assert flash and torch_at < flash[0] < ringtrain_at
    assert "--no-build-isolation" in runs[flash[0]]
    assert "ninja" in runs[flash[0]] and "MAX_JOBS" in runs[flash[0]]


def test_make_test_gpu_builds_flash_attn_without_isolation_and_runs_the_gpu_marker() -> None:
    recipe = MAKEFILE.split("\ntest-gpu:", 1)[1].split("\n\n", 1)[0]
    assert "--no-build-isolation" in recipe and '"flash-attn==$(FLASH_ATTN_VERSION)"' in recipe
    assert "torch.cuda.is_available()" in recipe
    assert re.search(r"pytest tests/gpu -m gpu", recipe)


def _make(target: str, tmp_path: Path, *, gpu_visible: bool) -> subprocess.CompletedProcess[str]:
    make = shutil.which("make")
    if make is None:
        pytest.skip("make is not installed")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    if gpu_visible:  # an nvidia-smi that succeeds: the machine claims a GPU
        fake = bin_dir / "nvidia-smi"
        fake.write_text("#!/bin/sh\nexit 0\n")
        fake.chmod(0o755)
    path = os.environ.get("PATH", "")
    if not gpu_visible:  # hide a real one, if any
        path = os.pathsep.join(p for p in path.split(os.pathsep) if not (Path(p) / "nvidia-smi").exists())
    return subprocess.run(
        # The venv is this interpreter's, already installed: -o keeps make from touching it,
        # and PIP=false makes sure nothing is installed should a check let the recipe go on.
        [make, "-s", "-o", ".venv/.installed", f"PY={sys.executable}", "PIP=false", target],
        cwd=REPO,
        env={**os.environ, "PATH": os.pathsep.join([str(bin_dir), path])},
        capture_output=True,
        text=True,
        timeout=120,
    )


@needs_no_cuda
@slow
def test_make_test_gpu_fails_when_a_gpu_is_visible_but_torch_cannot_use_it(tmp_path: Path) -> None:
    done = _make("test-gpu", tmp_path, gpu_visible=True)
    assert done.returncode != 0, done.stdout + done.stderr
    assert "cannot use it" in done.stderr and "CUDA build" in done.stderr, done.stderr


@needs_no_cuda
def test_make_gpu_check_fails_without_a_gpu(tmp_path: Path) -> None:
    done = _make("gpu-check", tmp_path, gpu_visible=False)
    assert done.returncode != 0
    assert "sees no GPU" in done.stderr, done.stderr


@needs_no_cuda
@slow
def test_train_bench_refuses_to_run_without_cuda() -> None:
    done = subprocess.run(
        [sys.executable, str(REPO / "bench" / "train.py")],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO / "platform")},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert "needs a CUDA GPU" in done.stderr


@slow
def test_gpu_tier_collects_on_any_machine() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "tests/gpu", "--collect-only", "-q", "-p", "no:cacheprovider"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert re.search(r"^\d+ tests? collected", done.stdout, re.MULTILINE), done.stdout[-2000:]
