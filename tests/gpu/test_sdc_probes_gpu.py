"""SDC probe digests on CUDA: the same bits round after round, in bf16 as in fp32, through every
attention kernel, and a flipped bit changes exactly its probe's digest.

A scan compares each rank's digests with its own first round (and with the other ranks'), so a
probe whose result varies from run to run on healthy hardware would evict a healthy rank. The
collective probe over NCCL is covered by tests/gpu/test_trainer_gpu.py (it needs a process group).
"""

from __future__ import annotations

import pytest
import torch

from ringtrain.train import sdc_probes
from ringtrain.train.sdc_probes import BitFlip, attention_probe, digests, run_probes

from .support import CUDA_KERNELS, MARKS, cuda_kernel

pytestmark = MARKS

ROUNDS = 4


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


def test_a_probe_round_is_the_same_every_round() -> None:
    device = _device()
    first = digests(run_probes(device, collective=False))
    assert {"gemm_float32", "gemm_bfloat16"} <= first.keys(), first
    assert any(name.startswith("attention_") and name.endswith("_bfloat16") for name in first), first
    for _ in range(ROUNDS - 1):
        assert digests(run_probes(device, collective=False)) == first
    # Inputs made again from the seed (a new process does so) give the same digests too.
    sdc_probes._fixed.cache_clear()
    assert digests(run_probes(device, collective=False)) == first


@pytest.mark.parametrize("name", CUDA_KERNELS)
def test_attention_probe_is_stable_with_every_kernel(name: str) -> None:
    cuda_kernel(name)  # skips (or fails when strict) if this machine lacks it
    device = _device()
    results = [attention_probe(device, torch.bfloat16, kernel=name) for _ in range(ROUNDS)]
    assert results[0].name == f"attention_{name}_bfloat16"
    assert len({r.digest for r in results}) == 1, f"{name}: digests vary across rounds"


@pytest.mark.parametrize("probe", ["gemm_float32", "gemm_bfloat16"])
def test_a_flipped_bit_changes_only_its_probe(probe: str) -> None:
    device = _device()
    clean = digests(run_probes(device, collective=False))
    flipped = digests(run_probes(device, collective=False, flip=BitFlip(probe=probe, element=7, bit=3)))
    assert {name for name in clean if clean[name] != flipped[name]} == {probe}
