"""A model of a given shape trained on one device, the ways the benches compare: ringtrain's job
of the shape and its Trainer in a world of one, and transformers' own model of the same config
with the recipe a user would otherwise run (bf16 weights, fp32 master copies stepped by torch's
AdamW). bench/train.py times them at one length, bench/max_context.py finds the longest each
trains.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from ringtrain.config import JobConfig


@dataclass(frozen=True)
class Shape:
    """A model shape: the job's ``model.*`` keys, its tiny stand-in, transformers' classes."""

    title: str
    model: Mapping[str, Any]
    tiny: Mapping[str, Any]  # the sizes ``--tiny`` puts in place; the family's switches stay
    hf_model: str
    hf_config: str

    def model_keys(self, tiny: bool) -> dict[str, Any]:
        return {**self.model, **(self.tiny if tiny else {})}


def _yaml(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{k}: {_yaml(v)}" for k, v in value.items()) + "}"
    return str(value)


def model_overrides(model: Mapping[str, Any]) -> list[str]:
    """``model.<key>=<value>`` overrides of a job, as the command line takes them."""
    return [f"model.{key}={_yaml(value)}" for key, value in model.items()]


def device_of(device_type: str) -> torch.device:
    """The device a try runs on (cuda: the current one, made current for the process too)."""
    if device_type != "cuda":
        return torch.device("cpu")
    device = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.set_device(device)
    return device


def join_world_of_one(device: torch.device) -> None:
    """Make this process rank 0 of a process group of one (NCCL on CUDA, gloo otherwise), as a
    worker of a one-device job is, with DeepSpeed's own logging kept to warnings."""
    from ringtrain.train.trainer import set_rank_env

    set_rank_env(rank=0, world_size=1, device=device)  # before DeepSpeed's import reads it
    import logging

    import torch.distributed as dist
    from deepspeed.utils import logger as ds_logger

    ds_logger.setLevel(logging.WARNING)
    cuda = device.type == "cuda"
    dist.init_process_group(
        "nccl" if cuda else "gloo", store=dist.HashStore(), rank=0, world_size=1, device_id=device if cuda else None
    )


def hf_model(shape: Shape, job: JobConfig, seq_len: int, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """transformers' own model of ``shape``, from the config ringtrain exports for ``job``'s model:
    SDPA attention, every layer checkpointed (long sequences do not fit without), in train mode."""
    import warnings

    import transformers

    from ringtrain.hf.hfconfig import hf_config

    config_class, model_class = getattr(transformers, shape.hf_config), getattr(transformers, shape.hf_model)
    source = {"architectures": [shape.hf_model], "model_type": config_class.model_type}
    fields = hf_config(job.model, source, trained_seq_len=seq_len, dtype="bf16" if dtype == torch.bfloat16 else "fp32")
    config = config_class.from_dict(fields, attn_implementation="sdpa")
    if config._attn_implementation != "sdpa":
        raise RuntimeError(f"transformers {transformers.__version__} set attention {config._attn_implementation}, not sdpa")
    config.use_cache = False
    torch.manual_seed(job.train.seed)
    with device:
        model = model_class(config).to(dtype=dtype)
    with warnings.catch_warnings():
        # transformers 5.2x renamed it activation_checkpointing_enable; this name works in every 5.x.
        warnings.simplefilter("ignore", FutureWarning)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return model


class MasterWeightAdamW:
    """torch's AdamW over fp32 master copies of a model's weights, written back after each step,
    with the job's gradient clipping: DeepSpeed's bf16 recipe written out, for the baselines."""

    def __init__(self, model: torch.nn.Module, job: JobConfig, *, fused: bool) -> None:
        from ringtrain.train.engine import param_groups

        t = job.train
        self.weights = list(model.parameters())  # a tied weight once
        self.masters = [w.detach().float().clone() for w in self.weights]
        master_of = {id(w): m for w, m in zip(self.weights, self.masters)}
        groups = [
            {"params": [master_of[id(w)] for w in group["params"]], "weight_decay": group["weight_decay"]}
            for group in param_groups(model, t.weight_decay)
        ]
        self.optimizer = torch.optim.AdamW(groups, lr=t.lr, betas=(t.beta1, t.beta2), eps=1e-8, fused=fused)
        self.grad_clip = t.grad_clip

    def step(self) -> None:
        for weight, master in zip(self.weights, self.masters):
            master.grad = None if weight.grad is None else weight.grad.float()
            weight.grad = None
        if self.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.masters, self.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            for weight, master in zip(self.weights, self.masters):
                weight.copy_(master)


def hf_step(model: torch.nn.Module, optimizer: MasterWeightAdamW, input_ids: torch.Tensor) -> float:
    """One optimizer step of transformers' model on ``input_ids`` as its own labels (it shifts
    them itself); the loss, read back as a training loop reads it."""
    loss = model(input_ids=input_ids, labels=input_ids).loss
    loss.backward()
    optimizer.step()
    return float(loss.item())
