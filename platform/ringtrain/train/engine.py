"""The DeepSpeed engine for one rank: ZeRO config, AdamW, warmup + cosine schedule, clipping."""

from __future__ import annotations

import contextlib
import math
from typing import Any

import torch
from torch import nn

from ringtrain.config import JobConfig
from ringtrain.train.mesh import DeepSpeedMpu, Mesh
from ringtrain.train.model import full_shape


def lr_multiplier(step: int, *, warmup_steps: int, total_steps: int, min_ratio: float) -> float:
    """Linear warmup to 1, then cosine decay to ``min_ratio`` at ``total_steps``.

    ``step`` counts optimizer steps already taken (0 for the first step), as LambdaLR does.
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    decay_steps = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def resolve_dtype(job: JobConfig, device: torch.device) -> torch.dtype:
    if job.train.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"fp32": torch.float32, "bf16": torch.bfloat16}[job.train.dtype]


def clips_own_gradients(job: JobConfig, dtype: torch.dtype) -> bool:
    """Whether the platform, not DeepSpeed, takes the gradient norm and clips.

    At ZeRO stage 0 in fp32 DeepSpeed steps the bare torch optimizer: it clips with a norm it
    then drops (``DeepSpeedEngine.clip_fp32_gradients``) and takes none when clipping is off, so
    ``get_global_grad_norm()`` is None on every step. Every other path (the ZeRO and 16-bit
    optimizers) records the pre-clip norm itself.
    """
    return job.zero.stage == 0 and dtype == torch.float32


def fused_adam(job: JobConfig, device_type: str) -> bool:
    """Whether AdamW takes torch's fused step: one kernel over all of a rank's state instead of
    a chain of foreach ops, where the state is on a GPU (not offloaded to the host's CPU Adam)."""
    return bool(job.train.fused_ops) and device_type == "cuda" and not job.zero.offload_optimizer


def deepspeed_config(job: JobConfig, dtype: torch.dtype, device_type: str = "cpu") -> dict[str, Any]:
    t, z = job.train, job.zero
    # The job's buffer sizes, which the planner counts too, not whatever DeepSpeed defaults to;
    # stage 3's are written at every stage (the others ignore them), stage 0's bucket has no key.
    zero: dict[str, Any] = {
        "stage": z.stage,
        "reduce_bucket_size": z.reduce_bucket_size,
        "stage3_prefetch_bucket_size": z.stage3_prefetch_bucket_size,
        "stage3_param_persistence_threshold": z.stage3_param_persistence_threshold,
        "stage3_max_live_parameters": z.stage3_max_live_parameters,
    }
    if z.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if z.offload_params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    # DeepSpeed's data-parallel world is all dp x cp ranks (see DeepSpeedMpu); to it, a sample
    # is one rank's share of a sequence, so its batch size counts cp shares per sequence.
    return {
        "train_batch_size": t.global_batch * job.topology.cp,
        "train_micro_batch_size_per_gpu": t.micro_batch,
        "gradient_accumulation_steps": job.grad_accum_steps,
        "gradient_clipping": 0.0 if clips_own_gradients(job, dtype) else t.grad_clip,
        "optimizer": {
            "type": "AdamW",
            # torch_adam: torch's own AdamW, so no fused op has to be compiled (CPU and GPU alike).
            "params": {
                "lr": t.lr,
                "betas": [t.beta1, t.beta2],
                "eps": 1e-8,
                "weight_decay": t.weight_decay,
                "torch_adam": True,
                "adam_w_mode": True,
                **({"fused": True} if fused_adam(job, device_type) else {}),
            },
        },
        "zero_optimization": zero,
        "bf16": {"enabled": dtype == torch.bfloat16},
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Decay matrices only: norms' gains and biases (1-D) are not regularised towards zero. A
    parameter's rank is its whole shape's: under ZeRO-3 a partitioned one is a 1-D placeholder."""
    params = list(model.parameters())
    decay = [p for p in params if len(full_shape(p)) >= 2]
    no_decay = [p for p in params if len(full_shape(p)) < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def clip_before_step(optimizer: torch.optim.Optimizer, max_norm: float) -> None:
    """Take the gradient norm and clip to ``max_norm`` (0: no clipping) before each step of
    ``optimizer``, the way DeepSpeed's stage-0 clipping does (coefficient
    ``max_norm / (norm + 1e-6)``, capped at 1).

    Stage 0 all-reduces whole gradients, so the local norm is already the global one. The norm
    is left in ``optimizer._global_grad_norm``, which DeepSpeed's engine copies into
    ``get_global_grad_norm()`` after every step.
    """

    def hook(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        params = [p for group in opt.param_groups for p in group["params"] if p.grad is not None]
        norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        if max_norm > 0:
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
        opt._global_grad_norm = norm.item()  # type: ignore[attr-defined]

    optimizer.register_step_pre_hook(hook)


def build_engine(model: nn.Module, job: JobConfig, mesh: Mesh, dtype: torch.dtype, device_type: str) -> Any:
    import deepspeed  # heavy; imported where the engine is built, never at module import

    t = job.train

    def schedule(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
        return torch.optim.lr_scheduler.LambdaLR(
            optimizer,
            lambda step: lr_multiplier(
                step, warmup_steps=t.warmup_steps, total_steps=t.steps, min_ratio=t.min_lr_ratio
            ),
        )

    engine, _, _, _ = deepspeed.initialize(
        model=model,
        model_parameters=param_groups(model, t.weight_decay),
        lr_scheduler=schedule,
        config=deepspeed_config(job, dtype, device_type),
        mpu=DeepSpeedMpu(mesh),
        dist_init_required=False,
    )
    if clips_own_gradients(job, dtype):
        clip_before_step(engine.optimizer, t.grad_clip)
    return engine


def partitioned_construction(job: JobConfig, mesh: Mesh, dtype: torch.dtype) -> Any:
    """The context a model is built in: under ZeRO-3 with pretrained weights, each parameter is
    partitioned as soon as its module is built (DeepSpeed's ``zero.Init``), so a rank never
    holds more than its partition, and the weights are read into the partitions next. A model
    trained from scratch is built whole and partitioned by ``deepspeed.initialize``, because its
    random initialisation draws every full tensor from the same seed on every rank."""
    if job.zero.stage != 3 or not job.model.hf:
        return contextlib.nullcontext()
    import deepspeed
    import torch.distributed as dist

    # DeepSpeed's communication layer wraps the existing process group; zero.Init reads the
    # world from it (and silently assumes a world of one before deepspeed.initialize ran).
    deepspeed.init_distributed(dist_backend=dist.get_backend(), auto_mpi_discovery=False, dist_init_required=False)
    # The dtype comes from the config's bf16 switch: an explicit ``dtype=`` is overridden by
    # bf16 on accelerators without fp16 (``Init._set_dtype`` in DeepSpeed 0.19), the CPU among them.
    return _partition_on_init_class()(
        data_parallel_group=mesh.zero_group, config_dict_or_path=deepspeed_config(job, dtype), mpu=DeepSpeedMpu(mesh)
    )


def _partition_on_init_class() -> type:
    # Defined on first use: DeepSpeed is imported where an engine is built, never at import.
    import deepspeed

    class PartitionOnInit(deepspeed.zero.Init):  # type: ignore[misc, name-defined]
        """``zero.Init`` without its broadcast of every new parameter from rank 0: the values are
        loaded into the partitions next, so copying rank 0's would only cost time and make
        every rank write (and so hold resident) every full tensor."""

        def _zero_init_param(self, param: Any) -> None:
            self._convert_to_deepspeed_param(param)
            param.partition()

    return PartitionOnInit
