"""ZeRO's buffer sizes are the job's (its ``zero`` section): what the engine writes into
DeepSpeed's config, as DeepSpeed's own config model reads it back, is what the planner counts for
the same job, at DeepSpeed's defaults and at other sizes a job sets; ``ringtrain plan`` of a job
counts the job's."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from deepspeed.runtime.engine import MEMORY_OPT_ALLREDUCE_SIZE
from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

from ringtrain import cli, config
from ringtrain.errors import ConfigError
from ringtrain.planner.layout import precision, workload_of
from ringtrain.planner.memory import ALLREDUCE_BUCKET, zero_buffers
from ringtrain.train.engine import deepspeed_config

BF16 = precision("bf16", 1)  # 2-byte parameters and gradients
MANY = 10**13  # more parameters than any bucket or prefetch holds
# Sizes other than DeepSpeed's defaults: an engine or a planner left at those would no longer match.
OTHERS = [
    "zero.reduce_bucket_size=200000000",
    "zero.stage3_prefetch_bucket_size=20000000",
    "zero.stage3_param_persistence_threshold=40000",
    "zero.stage3_max_live_parameters=300000000",
]
LLAMA3_8B_JOB = Path(__file__).resolve().parents[2] / "jobs" / "llama3-8b-128k.yaml"  # ZeRO-3


class Tensors:
    """A model known only by its tensors' element counts, all the stage-3 buffers read of one."""

    def __init__(self, *sizes: int) -> None:
        self.sizes = sizes

    def tensors(self) -> tuple[int, ...]:
        return self.sizes


@pytest.fixture(params=[[], OTHERS], ids=["defaults", "others"])
def sizes(request: pytest.FixtureRequest) -> list[str]:
    """The job's zero keys: none (DeepSpeed's defaults), then others."""
    return list(request.param)


def job_at(stage: int, sizes: list[str]) -> config.JobConfig:
    return config.replace(config.JobConfig(), [f"zero.stage={stage}", *sizes])


def engine_zero(job: config.JobConfig) -> DeepSpeedZeroConfig:
    """The ZeRO settings a run of ``job`` hands DeepSpeed, parsed as DeepSpeed parses them (an
    unknown key is refused)."""
    return DeepSpeedZeroConfig(**deepspeed_config(job, torch.bfloat16)["zero_optimization"])


def planned(job: config.JobConfig) -> config.ZeroConfig:
    """The sizes the planner counts for ``job``: its workload's, as ``ringtrain plan`` and the
    fit check build it."""
    return workload_of(job, "cuda").zero


def deepspeeds(zero: DeepSpeedZeroConfig) -> tuple[int, int, int, int]:
    """The four sizes as DeepSpeed holds them, in the job's keys' order."""
    return zero.reduce_bucket_size, zero.prefetch_bucket_size, zero.param_persistence_threshold, zero.max_live_parameters


def test_deepspeed_reads_the_jobs_sizes(sizes: list[str]) -> None:
    job = job_at(3, sizes)
    asked = job.zero
    assert deepspeeds(engine_zero(job)) == (asked.reduce_bucket_size, asked.stage3_prefetch_bucket_size,
                                            asked.stage3_param_persistence_threshold, asked.stage3_max_live_parameters)  # fmt: skip


def test_the_keys_defaults_are_deepspeeds_and_the_others_differ_in_each() -> None:
    defaults = deepspeeds(DeepSpeedZeroConfig())
    assert deepspeeds(engine_zero(job_at(3, []))) == defaults
    assert all(other != default for other, default in zip(deepspeeds(engine_zero(job_at(3, OTHERS))), defaults))


def test_the_job_takes_the_sizes_deepspeed_takes() -> None:
    # Stage 3's may be 0 (DeepSpeed's ge=0); a reduce bucket of 0 elements DeepSpeed refuses too.
    zeros = ["zero.stage3_prefetch_bucket_size=0", "zero.stage3_param_persistence_threshold=0",
             "zero.stage3_max_live_parameters=0"]  # fmt: skip
    assert deepspeeds(engine_zero(job_at(3, zeros)))[1:] == (0, 0, 0)
    with pytest.raises(ValueError):
        DeepSpeedZeroConfig(reduce_bucket_size=0)
    with pytest.raises(ConfigError, match="zero.reduce_bucket_size"):
        job_at(3, ["zero.reduce_bucket_size=0"])


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_the_planner_counts_the_reduce_bucket_the_engine_sets(stage: int, sizes: list[str]) -> None:
    job = job_at(stage, sizes)
    bucket = engine_zero(job).reduce_bucket_size
    buffers = zero_buffers(None, MANY, stage, BF16, planned(job))
    assert buffers.reduce_bucket == 2 * bucket
    if stage < 3:  # gradients wait in param.grad for their bucket: at most a bucket's worth
        assert buffers.reduce_transient == 2 * bucket


def test_the_planner_gathers_stage_3_parameters_as_the_engine_sets(sizes: list[str]) -> None:
    job = job_at(3, sizes)
    zero = engine_zero(job)
    threshold, max_live = zero.param_persistence_threshold, zero.max_live_parameters

    def gathered(model: Tensors) -> int:
        return zero_buffers(model, sum(model.tensors()), 3, BF16, planned(job)).stage3_params // 2  # type: ignore[arg-type]

    # Known by its count alone, a model gathers a prefetch's worth ahead of the module in use.
    assert zero_buffers(None, MANY, 3, BF16, planned(job)).stage3_params == 2 * zero.prefetch_bucket_size
    # A tensor at the threshold stays whole on every rank, one above it is partitioned; the
    # largest, above the live cap, is gathered whole and alone.
    assert gathered(Tensors(threshold, threshold + 1, max_live + 1)) == threshold + max_live + 1
    # Two partitioned tensors under the cap: the gathered set stops at the cap.
    assert gathered(Tensors(max_live - 1, max_live - 1)) == max_live


def test_stage_0s_all_reduce_bucket_is_deepspeeds_own() -> None:
    # No config key sets it: the planner's memory model declares DeepSpeed's engine constant.
    assert ALLREDUCE_BUCKET == MEMORY_OPT_ALLREDUCE_SIZE
    assert zero_buffers(None, MANY, 0, BF16, config.ZeroConfig()).reduce_transient == 2 * MEMORY_OPT_ALLREDUCE_SIZE


def _plan(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    assert cli.main(["plan", str(LLAMA3_8B_JOB), *argv, "--json", "--top", "3"]) == 0
    return dict(json.loads(capsys.readouterr().out))


def test_a_job_that_lowers_the_live_cap_is_planned_with_less_stage_3_memory(capsys: pytest.CaptureFixture[str]) -> None:
    # Llama-3-8B's largest module (the embedding, 5.3e8 elements) is gathered whole: under this cap
    # no prefetch is gathered beside it.
    lowered = "zero.stage3_max_live_parameters=100000000"
    job = config.load(LLAMA3_8B_JOB, [lowered])
    model, prec = workload_of(job, "cuda").model, precision("bf16", 3)

    def stage3_buffers(zero: config.ZeroConfig) -> int:
        return zero_buffers(model, model.num_params, 3, prec, zero).resident

    assert stage3_buffers(job.zero) < stage3_buffers(config.ZeroConfig())
    # The job's own layout, and each ZeRO-3 layout of the longest sequence per layout.
    assert _plan(capsys, lowered)["job_layout"]["memory_bytes"]["zero_buffers"] == stage3_buffers(job.zero)
    reach = [r for r in _plan(capsys, lowered, "--max-seq-len")["layouts"] if r["layout"]["zero_stage"] == 3]
    assert reach and all(r["memory_bytes"]["zero_buffers"] == stage3_buffers(job.zero) for r in reach)
