"""Per-step snapshots of one rank's training state, in coordinates that do not depend on dp.

ZeRO splits each parameter's fp32 master copy and Adam moments across ranks, and the split
depends on the stage and the number of ranks. A snapshot records each rank's *fragments* in
parameter coordinates: for parameter ``name`` and state ``key`` (param, exp_avg, exp_avg_sq),
the flat element range ``[start, start + numel)`` and its values. The union of all ranks'
fragments tiles every parameter exactly once, so a snapshot taken at one dp can be restored at
any other dp and ZeRO stage: each new rank reads the ranges it now owns (``FragmentIndex``).

Off the critical path: optimizer state only changes inside the optimizer step, so the copy of
step N runs in a background thread (a side CUDA stream into pinned buffers on GPU) while step
N+1's forward and backward run, and ``fence()`` holds the next optimizer step until the copy is
done. Encoding and checksumming happen after the fence, on the copy thread.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
import threading
import time
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Protocol

import numpy as np
import torch

from ringtrain.checkpoint.retention import retained
from ringtrain.errors import ConfigError

STATE_KEYS = ("param", "exp_avg", "exp_avg_sq")
_MAGIC = b"RTSNAP01"


@dataclass
class Fragment:
    """A live view of this rank's piece of one parameter's state (fp32 tensors)."""

    name: str
    shape: tuple[int, ...]
    start: int
    tensors: dict[str, torch.Tensor]  # key -> 1-D view of length numel


@dataclass(frozen=True)
class Snapshot:
    """One rank's encoded state at the end of optimizer step ``step``."""

    step: int
    rank: int
    world_size: int
    blob: bytes
    checksum: str  # sha256 of blob
    copy_s: float  # device-to-host copy (the part the next optimizer step waits for)
    total_s: float  # copy + encode + checksum

    @property
    def num_bytes(self) -> int:
        return len(self.blob)


DeliverFn = Callable[[Snapshot], None]


def checksum(blob: bytes) -> str:
    # sha256: with the SHA extensions of current x86 and Arm CPUs it runs about twice as fast
    # as blake2b here, and the checksum is most of the snapshot thread's work.
    return hashlib.sha256(blob).hexdigest()


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
            state.setdefault("step", torch.tensor(0.0, dtype=torch.float32))
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

    def load(self, index: "FragmentIndex") -> None:
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

    def _load_model_weights(self, index: "FragmentIndex") -> None:
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
            elif self.stage in (1, 2):
                values = index.read(name, "param", 0, p.numel())
                p.data.view(-1).copy_(torch.from_numpy(values).to(p.device, p.dtype))


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


# --- encoding ---------------------------------------------------------------------------------


def encode(step: int, rank: int, world_size: int, scalars: dict[str, Any], arrays: list[tuple[Fragment, dict[str, np.ndarray]]]) -> bytes:
    """Header (JSON) + raw little-endian float32 payload; self-describing, no pickle."""
    entries, chunks, offset = [], [], 0
    for frag, values in arrays:
        for key, arr in values.items():
            data = np.ascontiguousarray(arr, dtype="<f4").tobytes()
            entries.append(
                {"name": frag.name, "key": key, "shape": list(frag.shape), "start": frag.start,
                 "numel": int(arr.size), "offset": offset}
            )
            chunks.append(data)
            offset += len(data)
    header = json.dumps(
        {"format": 1, "step": step, "rank": rank, "world_size": world_size, "scalars": scalars, "arrays": entries}
    ).encode()
    return b"".join([_MAGIC, struct.pack("<Q", len(header)), header, *chunks])


@dataclass(frozen=True)
class DecodedShard:
    step: int
    rank: int
    world_size: int
    scalars: dict[str, Any]
    entries: list[dict[str, Any]]
    payload: memoryview

    def array(self, entry: dict[str, Any]) -> np.ndarray:
        start = entry["offset"]
        return np.frombuffer(self.payload[start : start + 4 * entry["numel"]], dtype="<f4")


class SnapshotFormatError(ValueError):
    pass


def decode(blob: bytes) -> DecodedShard:
    if len(blob) < 16 or blob[:8] != _MAGIC:
        raise SnapshotFormatError("not a ringtrain snapshot (bad magic)")
    (header_len,) = struct.unpack("<Q", blob[8:16])
    if 16 + header_len > len(blob):
        raise SnapshotFormatError("truncated snapshot header")
    header = json.loads(blob[16 : 16 + header_len])
    payload = memoryview(blob)[16 + header_len :]
    need = sum(4 * e["numel"] for e in header["arrays"])
    if len(payload) != need:
        raise SnapshotFormatError(f"payload is {len(payload)} bytes, the header describes {need}")
    return DecodedShard(header["step"], header["rank"], header["world_size"], header["scalars"], header["arrays"], payload)


class FragmentIndex:
    """All ranks' fragments of one step, readable by (name, key, element range)."""

    def __init__(self, shards: list[DecodedShard]) -> None:
        if not shards:
            raise SnapshotFormatError("no shards")
        steps = {s.step for s in shards}
        if len(steps) != 1:
            raise SnapshotFormatError(f"shards from different steps {sorted(steps)}")
        self.step = shards[0].step
        self.scalars = shards[0].scalars
        self.shapes: dict[str, tuple[int, ...]] = {}
        self._pieces: dict[tuple[str, str], list[tuple[int, int, DecodedShard, dict[str, Any]]]] = {}
        for shard in shards:
            for e in shard.entries:
                self.shapes[e["name"]] = tuple(e["shape"])
                self._pieces.setdefault((e["name"], e["key"]), []).append((e["start"], e["numel"], shard, e))
        for (name, key), pieces in self._pieces.items():
            pieces.sort(key=lambda piece: piece[0])
            expected = 0
            for start, numel, _, _ in pieces:
                if start != expected:
                    raise SnapshotFormatError(f"{name}/{key}: elements [{expected}, {start}) missing or overlapping")
                expected = start + numel
            total = math.prod(self.shapes[name])
            if expected != total:
                raise SnapshotFormatError(f"{name}/{key}: covers {expected} of {total} elements")

    @property
    def names(self) -> list[str]:
        return sorted(self.shapes)

    def read(self, name: str, key: str, start: int, stop: int) -> np.ndarray:
        out = np.empty(stop - start, dtype=np.float32)
        for p_start, numel, shard, entry in self._pieces[(name, key)]:
            lo, hi = max(start, p_start), min(stop, p_start + numel)
            if lo < hi:
                out[lo - start : hi - start] = shard.array(entry)[lo - p_start : hi - p_start]
        return out

    def full(self, name: str, key: str = "param") -> np.ndarray:
        return self.read(name, key, 0, math.prod(self.shapes[name])).reshape(self.shapes[name])


# --- the background copy ------------------------------------------------------------------------


class CopyEvent(Protocol):
    """A point in the copy stream's queue (``torch.cuda.Event``)."""

    def synchronize(self) -> None: ...


class CopyStreams(Protocol):
    """Where the device-to-host copies of a snapshot are queued, and how they are ordered
    against training's own stream."""

    def copying(self) -> AbstractContextManager[Any]:
        """Queue the copies issued inside on the side stream, after the work queued so far."""
        ...

    def record(self) -> CopyEvent:
        """An event recorded on the side stream now: it completes when the copies are done."""
        ...

    def hold_compute(self, event: CopyEvent) -> None:
        """Make training's stream wait for ``event`` before its next kernel."""
        ...


class CudaCopyStreams:
    """The copy on a side CUDA stream of ``device``."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)

    def copying(self) -> AbstractContextManager[Any]:
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        return torch.cuda.stream(self.stream)

    def record(self) -> CopyEvent:
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    def hold_compute(self, event: CopyEvent) -> None:
        assert isinstance(event, torch.cuda.Event)
        torch.cuda.current_stream(self.device).wait_event(event)


class Snapshotter:
    """Copies this rank's state off the critical path after each optimizer step.

    Two host buffers alternate, so the copy of step N+1 never writes into memory that the
    encoder of step N is still reading. ``fence()`` is the only synchronisation the training
    loop sees: before the next optimizer step mutates state, the pending copy must be done.
    On GPU the copy is queued on a side stream into pinned buffers and the fence is a
    stream-to-stream wait, so the host never blocks; on CPU a background thread copies.
    """

    def __init__(
        self,
        zero: ZeroState,
        *,
        rank: int,
        world_size: int,
        device: torch.device,
        deliver: Optional[Callable[[Snapshot], None]] = None,
        keep: int = 2,
        streams: Optional[CopyStreams] = None,
        executor: Optional[Executor] = None,
    ) -> None:
        """``streams`` defaults to a side CUDA stream on a CUDA device (none on CPU), and
        ``executor`` to one background thread; tests pass stand-ins for either."""
        self.zero = zero
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.deliver = deliver
        self.keep = keep
        # One worker: jobs finish in capture order, so ``recent`` and deliveries stay ordered.
        self._pool = executor or ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"snapshot-r{rank}")
        if streams is None and device.type == "cuda":
            streams = CudaCopyStreams(device)
        self._streams = streams
        self._copy_done: Optional[CopyEvent] = None  # the newest capture's copy, for ``fence``
        self._copied = threading.Event()
        self._copied.set()
        self._pending: Optional[Future[Snapshot]] = None
        self._slot_jobs: list[Optional[Future[Snapshot]]] = [None, None]  # the last job per buffer
        self._buffers: list[Optional[list[dict[str, torch.Tensor]]]] = [None, None]
        self._turn = 0
        self._lock = threading.Lock()
        self.recent: dict[int, Snapshot] = {}  # step -> snapshot: the newest ``keep``, and the pinned one
        self.pinned: Optional[int] = None
        self.errors: list[BaseException] = []

    def capture(self, step: int, scalars: dict[str, Any]) -> None:
        """Start snapshotting the state as it is now (call right after an optimizer step)."""
        self.fence()
        slot = self._turn
        self._turn ^= 1
        previous = self._slot_jobs[slot]
        if previous is not None:
            previous.result()  # only the job that last used this buffer must be done with it
        fragments = list(self.zero.fragments())
        buffers = self._host_buffers(slot, fragments)
        t0 = time.perf_counter()
        copy_done: Optional[CopyEvent] = None
        if self._streams is not None:
            with self._streams.copying():
                for frag, host in zip(fragments, buffers):
                    for key, tensor in frag.tensors.items():
                        host[key].copy_(tensor.detach(), non_blocking=True)
            copy_done = self._copy_done = self._streams.record()
        else:
            self._copied.clear()
        # The job gets its own event: ``self._copy_done`` may already be the next capture's by
        # the time the job runs, and its host buffers would then be read before this copy lands.
        self._pending = self._slot_jobs[slot] = self._pool.submit(
            self._run, step, scalars, fragments, buffers, t0, copy_done
        )

    def fence(self) -> None:
        """Hold the next state change until the pending copy has left the live tensors."""
        if self._streams is not None and self._copy_done is not None:
            # The side stream runs its copies in order: the newest one done means all are.
            self._streams.hold_compute(self._copy_done)
        self._copied.wait()

    def wait(self) -> Optional[Snapshot]:
        """The pending snapshot, finished (tests and persistence use this)."""
        if self._pending is None:
            return None
        return self._pending.result()

    def get(self, step: int) -> Optional[Snapshot]:
        with self._lock:
            return self.recent.get(step)

    def newest(self) -> Optional[Snapshot]:
        with self._lock:
            return self.recent[max(self.recent)] if self.recent else None

    def steps(self) -> list[int]:
        with self._lock:
            return sorted(self.recent)

    def pin(self, step: int) -> None:
        """Hold the newest snapshot at or before ``step`` beyond the ``keep`` newest, until the
        next pin (see ``retained``)."""
        with self._lock:
            self.pinned = step
            self._trim()

    def _trim(self) -> None:
        keep = retained(self.recent, keep=self.keep, pin=self.pinned)
        for old in [s for s in self.recent if s not in keep]:
            del self.recent[old]

    def forget_after(self, step: int) -> None:
        """Drop snapshots newer than ``step``: after a rollback they describe an abandoned future."""
        self.wait()
        with self._lock:
            for newer in [s for s in self.recent if s > step]:
                del self.recent[newer]

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def _host_buffers(self, slot: int, fragments: list[Fragment]) -> list[dict[str, torch.Tensor]]:
        cached = self._buffers[slot]
        sizes = [{k: t.numel() for k, t in f.tensors.items()} for f in fragments]
        if cached is None or [{k: b.numel() for k, b in host.items()} for host in cached] != sizes:
            pin = self.device.type == "cuda"
            cached = [{k: torch.empty(n, dtype=torch.float32, pin_memory=pin) for k, n in s.items()} for s in sizes]
            self._buffers[slot] = cached
        return cached

    def _run(
        self,
        step: int,
        scalars: dict[str, Any],
        fragments: list[Fragment],
        buffers: list[dict[str, torch.Tensor]],
        t0: float,
        copy_done: Optional[CopyEvent],
    ) -> Snapshot:
        try:
            if copy_done is not None:
                copy_done.synchronize()
            else:
                for frag, host in zip(fragments, buffers):
                    for key, tensor in frag.tensors.items():
                        host[key].copy_(tensor.detach())  # releases the GIL: overlaps the step
        finally:
            copy_s = time.perf_counter() - t0
            self._copied.set()
        arrays = [(frag, {k: b.numpy() for k, b in host.items()}) for frag, host in zip(fragments, buffers)]
        blob = encode(step, self.rank, self.world_size, scalars, arrays)
        snap = Snapshot(step, self.rank, self.world_size, blob, checksum(blob), copy_s, time.perf_counter() - t0)
        with self._lock:
            self.recent[step] = snap
            self._trim()
        if self.deliver is not None:
            try:
                self.deliver(snap)
            except Exception as exc:  # a holder being away must not stop training
                self.errors.append(exc)
        return snap
