"""Where one rank's training state lives inside DeepSpeed, for each ZeRO stage: its fp32 master
weights and Adam moments as fragments in parameter coordinates, and the scalars beside them.

ZeRO splits each parameter's fp32 master copy and Adam moments across ranks, and the split
depends on the stage and the number of ranks. A fragment is this rank's piece of one parameter
in coordinates that do not depend on either: for parameter ``name`` and state key, the flat
element range ``[start, start + numel)``. The union of all ranks' fragments tiles every
parameter exactly once, so state taken at one dp and stage is restored at any other: each new
rank reads the ranges it now owns (``checkpoint.wire.FragmentIndex``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np
import torch

from ringtrain.checkpoint.wire import FragmentIndex
from ringtrain.errors import ConfigError


@dataclass
class Fragment:
    """A live view of this rank's piece of one parameter's state (fp32 tensors)."""

    name: str
    shape: tuple[int, ...]
    start: int
    tensors: dict[str, torch.Tensor]  # key -> 1-D view of length numel



class ZeroState:
    """Where one rank's fp32 master weights and Adam moments live, for each ZeRO stage."""

    def __init__(self, engine: Any, model: torch.nn.Module, stage: int, rank: int, world_size: int) -> None:
        self.engine = engine
        self.model = model
        self.stage = stage
        self.rank = rank
        self.world_size = world_size
        self.optimizer = engine.optimizer
        # Stage 0: id(model parameter) -> the fp32 master Adam steps, where that is a separate
        # tensor (16-bit weights); empty when each parameter is its own master (fp32).
        self.masters: dict[int, torch.Tensor] = {}
        if stage == 0:
            self.inner, self.masters = _stage0_optimizer(self.optimizer)
        else:
            self.inner = getattr(self.optimizer, "optimizer", self.optimizer)

    def ensure_optimizer_state(self) -> None:
        """Create Adam's state as torch does at its first step, so it can be restored into."""
        for t in self._state_tensors():
            state = self.inner.state[t]  # a defaultdict
            state.setdefault("step", _adam_step_tensor(t, self.inner.defaults))
            state.setdefault("exp_avg", torch.zeros_like(t, memory_format=torch.preserve_format))
            state.setdefault("exp_avg_sq", torch.zeros_like(t, memory_format=torch.preserve_format))

    def _state_tensors(self) -> list[torch.Tensor]:
        """The tensors Adam keeps state for. Not ``inner.param_groups``: ZeRO-3 fills those
        only for the duration of its step."""
        if self.stage == 0:
            return [self._master(p) for p in self.model.parameters()]
        if self.stage in (1, 2):
            return list(self.optimizer.single_partition_of_fp32_groups)
        return list(self.optimizer.fp32_partitioned_groups_flat)

    def optimizer_steps(self) -> int:
        for t in self._state_tensors():
            if "step" in self.inner.state.get(t, {}):
                return int(self.inner.state[t]["step"])
        return 0

    def set_optimizer_steps(self, steps: int) -> None:
        for t in self._state_tensors():
            self.inner.state[t]["step"].fill_(float(steps))

    def fragments(self) -> Iterator[Fragment]:
        """This rank's fragments; state must exist (after a step or ``ensure_optimizer_state``)."""
        for name, p in self.model.named_parameters():
            if self.stage == 0:
                yield from self._stage0(name, p)
            elif self.stage in (1, 2):
                yield from self._stage12(name, p)
            else:
                yield from self._stage3(name, p)

    def _master(self, p: torch.Tensor) -> torch.Tensor:
        return self.masters.get(id(p), p)

    def _views(self, flat: torch.Tensor, offset: int, numel: int) -> dict[str, torch.Tensor]:
        state = self.inner.state[flat]
        return {
            "param": flat.detach().view(-1).narrow(0, offset, numel),
            "exp_avg": state["exp_avg"].view(-1).narrow(0, offset, numel),
            "exp_avg_sq": state["exp_avg_sq"].view(-1).narrow(0, offset, numel),
        }

    def _stage0(self, name: str, p: torch.Tensor, *, whole: bool = False) -> Iterator[Fragment]:
        # Every rank holds everything: each saves an equal slice so shards stay balanced, and
        # restores the whole parameter.
        n = p.numel()
        chunk = n if whole else math.ceil(n / self.world_size)
        start = 0 if whole else min(n, self.rank * chunk)
        numel = max(0, min(chunk, n - start))
        if numel:
            yield Fragment(name, tuple(p.shape), start, self._views(self._master(p), start, numel))

    def _stage12(self, name: str, p: torch.Tensor) -> Iterator[Fragment]:
        mapping = getattr(p, "_hp_mapping", None)
        if mapping is None:  # no piece of this parameter in this rank's partition
            return
        flat = self.optimizer.single_partition_of_fp32_groups[mapping.param_group_index]
        numel = mapping.lp_fragment_address.numel
        views = self._views(flat, mapping.hp_fragment_address.start, numel)
        yield Fragment(name, tuple(p.shape), mapping.lp_fragment_address.start, views)

    def _stage3(self, name: str, p: torch.Tensor) -> Iterator[Fragment]:
        group, offset, _ = self.optimizer.grad_position[self.optimizer.get_param_id(p)]
        flat = self.optimizer.fp32_partitioned_groups_flat[group]
        per_rank = p.ds_tensor.numel()
        start = self.optimizer._get_param_partition_rank(p) * per_rank
        numel = max(0, min(per_rank, p.ds_numel - start))  # the last rank's partition is padded
        if numel:
            yield Fragment(name, tuple(p.ds_shape), start, self._views(flat, offset, numel))

    def load(self, index: FragmentIndex) -> None:
        """Overwrite this rank's weights and optimizer state with the snapshot's values."""
        self.ensure_optimizer_state()
        if self.stage == 0:
            owned = [f for name, p in self.model.named_parameters() for f in self._stage0(name, p, whole=True)]
        else:
            owned = list(self.fragments())
        with torch.no_grad():
            for frag in owned:
                for key, view in frag.tensors.items():
                    values = index.read(frag.name, key, frag.start, frag.start + view.numel())
                    view.copy_(torch.from_numpy(values).to(view.device, view.dtype))
            self._load_model_weights(index)

    def _load_model_weights(self, index: FragmentIndex) -> None:
        # The weights the forward pass uses are a separate copy of the fp32 master in stages
        # 1-3 and in 16-bit stage 0 (the same tensor in fp32 stage 0), so they are set from the
        # snapshot too, rounded as the optimizer rounds them after its step.
        for name, p in self.model.named_parameters():
            if self.stage == 0:
                master = self.masters.get(id(p))
                if master is not None:
                    p.data.copy_(master.detach())
            elif self.stage == 3:
                per_rank = p.ds_tensor.numel()
                start = self.optimizer._get_param_partition_rank(p) * per_rank
                numel = max(0, min(per_rank, p.ds_numel - start))
                if numel:
                    values = index.read(name, "param", start, start + numel)
                    p.ds_tensor.data.view(-1)[:numel].copy_(torch.from_numpy(values).to(p.ds_tensor.dtype))
                if p.numel() == p.ds_numel:
                    # Gathered whole and kept so (a small parameter ZeRO-3 persists after its first
                    # forward): the forward reads this copy, not the partition, until a step.
                    whole = index.read(name, "param", 0, p.ds_numel)
                    p.data.view(-1).copy_(torch.from_numpy(whole).to(p.device, p.dtype))
            elif self.stage in (1, 2):
                values = index.read(name, "param", 0, p.numel())
                p.data.view(-1).copy_(torch.from_numpy(values).to(p.device, p.dtype))


def _adam_step_tensor(param: torch.Tensor, defaults: dict[str, Any]) -> torch.Tensor:
    """Adam's step count as ``torch.optim.Adam(W)`` makes it at its first step: on the
    parameter's device for the fused and capturable implementations, which read it there (a
    CPU step breaks them), else a CPU scalar, which the others read on the host."""
    if defaults.get("fused") or defaults.get("capturable"):
        return torch.zeros((), dtype=torch.float32, device=param.device)
    return torch.tensor(0.0, dtype=torch.float32)


def _stage0_optimizer(optimizer: Any) -> tuple[Any, dict[int, torch.Tensor]]:
    """The torch optimizer that holds Adam's state without ZeRO, and the fp32 masters it steps.

    In fp32 DeepSpeed steps the torch optimizer on the model's own parameters. With 16-bit
    weights it wraps it in ``FP16_UnfusedOptimizer`` (deepspeed/runtime/fp16/unfused_optimizer.py),
    which steps Adam on fp32 copies (``fp32_groups``, parallel to the model's ``fp16_groups``)
    and copies them into the model after each step, so Adam's state is keyed by the copies.
    """
    if isinstance(optimizer, torch.optim.Optimizer):
        return optimizer, {}
    low, high = getattr(optimizer, "fp16_groups", None), getattr(optimizer, "fp32_groups", None)
    inner = getattr(optimizer, "optimizer", None)
    if not isinstance(inner, torch.optim.Optimizer) or low is None or high is None:
        # Any other wrapper (the fused FP16_Optimizer keeps one flat fp32 tensor per group,
        # say) would need its own reader; refusing beats snapshotting the wrong tensors.
        raise ConfigError(
            "zero.stage",
            f"snapshots cannot read the fp32 master weights of DeepSpeed's {type(optimizer).__name__} "
            "at stage 0; use zero.stage=1 (or train.dtype=fp32)",
        )
    masters = {
        id(lp): hp
        for lp_group, hp_group in zip(low, high, strict=True)
        for lp, hp in zip(lp_group, hp_group, strict=True)
    }
    return inner, masters


def capture_scalars(engine: Any, zero: ZeroState, trainer_step: int, data_cursor: int) -> dict[str, Any]:
    """The small, non-tensor part of the state (taken synchronously: microseconds)."""
    scheduler = engine.lr_scheduler
    return {
        "trainer_step": trainer_step,
        "data_cursor": data_cursor,
        "optimizer_steps": zero.optimizer_steps(),
        "global_steps": int(engine.global_steps),
        "global_samples": int(engine.global_samples),
        "scheduler": {k: v for k, v in scheduler.state_dict().items() if k != "lr_lambdas"} if scheduler else None,
        "torch_rng": torch.get_rng_state().numpy().tobytes().hex(),
    }


def restore_scalars(engine: Any, zero: ZeroState, scalars: dict[str, Any]) -> tuple[int, int]:
    """Apply ``capture_scalars``'s output; returns the trainer step to continue from and the
    data cursor (batches consumed) that goes with it."""
    zero.set_optimizer_steps(scalars["optimizer_steps"])
    engine.global_steps = scalars["global_steps"]
    engine.global_samples = scalars["global_samples"]
    if engine.lr_scheduler is not None and scalars["scheduler"] is not None:
        state = dict(engine.lr_scheduler.state_dict())
        state.update(scalars["scheduler"])
        engine.lr_scheduler.load_state_dict(state)
        # LambdaLR recomputes lr only on step(); set the optimizer's current lr explicitly.
        for group, lr in zip(engine.optimizer.param_groups, engine.lr_scheduler.get_last_lr()):
            group["lr"] = lr
    torch.set_rng_state(torch.from_numpy(np.frombuffer(bytes.fromhex(scalars["torch_rng"]), dtype=np.uint8).copy()))
    step = int(scalars["trainer_step"])
    return step, int(scalars.get("data_cursor", step))

