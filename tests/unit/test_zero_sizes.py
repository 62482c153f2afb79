"""ZeRO's buffer sizes are one value (ringtrain/zero_sizes.py): what the engine writes into
DeepSpeed's config, as DeepSpeed's own config model reads it back, is what the planner's memory
model counts, at the declared sizes and at others put in their place."""

from __future__ import annotations

import pytest
import torch
from deepspeed.runtime.engine import MEMORY_OPT_ALLREDUCE_SIZE
from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

from ringtrain import config, zero_sizes
from ringtrain.planner.layout import precision
from ringtrain.planner.memory import zero_buffers
from ringtrain.train.engine import deepspeed_config

BF16 = precision("bf16", 1)  # 2-byte parameters and gradients
MANY = 10**13  # more parameters than any bucket or prefetch holds
# Sizes other than DeepSpeed's defaults: an engine left at those would no longer match the plan.
OTHERS = zero_sizes.ZeroSizes(reduce_bucket=200_000_000, prefetch=20_000_000, persistence_threshold=40_000,
                              max_live=300_000_000)  # fmt: skip


class Tensors:
    """A model known only by its tensors' element counts, all the stage-3 buffers read of one."""

    def __init__(self, *sizes: int) -> None:
        self.sizes = sizes

    def tensors(self) -> tuple[int, ...]:
        return self.sizes


@pytest.fixture(params=["declared", "others"])
def sizes(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """The declared sizes, then others in their place."""
    if request.param == "others":
        monkeypatch.setattr(zero_sizes, "ZERO_SIZES", OTHERS)


def engine_zero(stage: int) -> DeepSpeedZeroConfig:
    """The ZeRO settings a run at ``stage`` hands DeepSpeed, parsed as DeepSpeed parses them (an
    unknown key is refused)."""
    job = config.replace(config.JobConfig(), [f"zero.stage={stage}"])
    return DeepSpeedZeroConfig(**deepspeed_config(job, torch.bfloat16)["zero_optimization"])


@pytest.mark.usefixtures("sizes")
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_the_planner_counts_the_reduce_bucket_the_engine_sets(stage: int) -> None:
    bucket = engine_zero(stage).reduce_bucket_size
    buffers = zero_buffers(None, MANY, stage, BF16)
    assert buffers.reduce_bucket == 2 * bucket
    if stage < 3:  # gradients wait in param.grad for their bucket: at most a bucket's worth
        assert buffers.reduce_transient == 2 * bucket


@pytest.mark.usefixtures("sizes")
def test_the_planner_gathers_stage_3_parameters_as_the_engine_sets() -> None:
    zero = engine_zero(3)
    threshold, max_live = zero.param_persistence_threshold, zero.max_live_parameters

    def gathered(model: Tensors) -> int:
        return zero_buffers(model, sum(model.tensors()), 3, BF16).stage3_params // 2  # type: ignore[arg-type]

    # Known by its count alone, a model gathers a prefetch's worth ahead of the module in use.
    assert zero_buffers(None, MANY, 3, BF16).stage3_params == 2 * zero.prefetch_bucket_size
    # A tensor at the threshold stays whole on every rank, one above it is partitioned; the
    # largest, above the live cap, is gathered whole and alone.
    assert gathered(Tensors(threshold, threshold + 1, max_live + 1)) == threshold + max_live + 1
    # Two partitioned tensors under the cap: the gathered set stops at the cap.
    assert gathered(Tensors(max_live - 1, max_live - 1)) == max_live


def test_stage_0s_all_reduce_bucket_is_deepspeeds_own() -> None:
    # No config key sets it: zero_sizes.py declares DeepSpeed's engine constant, held to it here.
    assert zero_sizes.ZERO_SIZES.allreduce_bucket == MEMORY_OPT_ALLREDUCE_SIZE
    assert zero_buffers(None, MANY, 0, BF16).reduce_transient == 2 * MEMORY_OPT_ALLREDUCE_SIZE
