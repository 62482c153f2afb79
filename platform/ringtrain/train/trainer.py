"""One rank's training: builds mesh, model, engine and data shard, and runs optimizer steps.

Loss scaling: the step's loss is the mean over all of its N labelled tokens. ZeRO averages
gradients over all dp x cp ranks (``DeepSpeedMpu``) and scales by 1/grad_accum, so each rank
backpropagates the sum of its micro-batch's token losses divided by N / (dp x cp x grad_accum)
= micro_batch x labels per sample / cp (independent of dp, so a resize changes nothing), and
the step's gradient is that of the global mean loss: the same as single-rank training on the
whole global batch. With windows every CP rank holds the same number of labels and this is its
local mean; a row sample's last token has no label, so one rank holds one fewer.

Where samples carry documents (and chat masks), N is counted: every rank sums its labels and
one all-reduce gives the step's N over dp, cp and accumulation, never a mean of per-rank means.
Under ``train.loss_norm: sequence`` each label carries the weight 1 / N_i of its conversation
(data.py): the model's loss is the weighted sum, and N is the sum of the weights, which is the
number of conversations with a trained label in the global batch. The step's loss is then the
mean over conversations of each one's token mean.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import resource
import time
from typing import Callable, Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist

from ringtrain.chaos import FaultPlan, FaultSpec
from ringtrain.train.deepspeed_import import import_deepspeed
from ringtrain.checkpoint.wire import FragmentIndex, decode
from ringtrain.config import REFERENCE_OBJECTIVES, AttentionConfig, ChaosConfig, JobConfig, checkpointing_mode
from ringtrain.planner.recompute import Recompute, recompute_for
from ringtrain.status import StepReport
from ringtrain.train.attention.documents import Documents
from ringtrain.train.data import IGNORE_INDEX, BatchPlan, BatchPrefetcher, MicroBatch, SampleSource, ShardedData
from ringtrain.train.engine import build_engine, partitioned_construction, resolve_dtype
from ringtrain.train.fused import FusedOps
from ringtrain.train.mesh import Mesh, all_reduce_mean, build_mesh
from ringtrain.train.mixture import open_samples
from ringtrain.train.pairset import rehearsal_pairs
from ringtrain.train.model import AttentionFn, MemorySavers, ModelArgs, Transformer, full_shape, skip_parameter_init
from ringtrain.train import pair_loss
from ringtrain.train.preference import Objective, PairLosses
from ringtrain.train.reference import reference_table
from ringtrain.train.reference_input import Reference
from ringtrain.train.sdc_probes import BitFlip, digests, flip_bit, run_probes
from ringtrain.train.snapshot import DeliverFn, Snapshot, Snapshotter
from ringtrain.train.zero_state import ZeroState, capture_scalars, restore_scalars

AttentionFactory = Callable[[JobConfig, Mesh], AttentionFn]
# The longest row a warm-up trains on: enough to run every kernel a step runs.
WARM_UP_SEQ_LEN = 64


def set_rank_env(*, rank: int, world_size: int, device: torch.device) -> None:
    """Environment DeepSpeed reads at import and initialize time; call before building a Trainer.

    DeepSpeed's engine makes ``cuda:$LOCAL_RANK`` current and puts itself there, so on CUDA
    LOCAL_RANK must be the index of this rank's own device, not 0 whatever the device.
    """
    if device.type == "cuda" and device.index is None:
        raise ValueError("set_rank_env needs an indexed CUDA device (cuda:N): LOCAL_RANK names it")
    # Set outright, never defaulted: an inherited DS_ACCELERATOR=cpu would put DeepSpeed's
    # engine on the CPU while the model and NCCL are on the GPU (and the reverse on a CPU rank).
    os.environ["DS_ACCELERATOR"] = "cuda" if device.type == "cuda" else "cpu"
    os.environ["LOCAL_RANK"] = str(device.index) if device.type == "cuda" else "0"
    os.environ["RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(world_size)


def skip_shm_comm_op() -> None:
    """Keep DeepSpeed's communication layer from loading its shared-memory all-reduce op.

    DeepSpeed 0.19's TorchBackend loads that JIT-built op whenever its op table says it is
    compatible, and reading the table first probes every op builder (compiler runs). The op
    serves only ``inference_all_reduce``, which training never calls, yet each rank paid the
    probe and a load under torch's extension-directory lock (serialised across the ranks of a
    node): seconds per process on a busy host. Naming it incompatible skips both."""
    import_deepspeed()  # the package first, without what its import would pull in
    import deepspeed.ops

    table = deepspeed.ops.__dict__.get("__compatible_ops__")
    if table is None:
        deepspeed.ops.__compatible_ops__ = {"deepspeed_shm_comm": False}
    else:
        table["deepspeed_shm_comm"] = False


def default_attention(job: JobConfig, mesh: Mesh) -> AttentionFn:
    """The job's CP layout on this rank's groups (what a group of one rank runs is the layout's)."""
    from ringtrain.train.attention import build_attention

    return build_attention(job.cp_layout, job.attention.kernel, ring_group=mesh.ring_group,
                           ulysses_group=mesh.ulysses_group)


def resolve_recompute(job: JobConfig, device: Optional[torch.device]) -> Recompute:
    """``model.activation_checkpointing`` and ``model.recompute_layers`` as they run on ``device``:
    ``auto`` is the least recomputation whose activations fit the GPU's memory
    (planner/recompute.py); on a CPU, where memory is the host's, none."""
    if device is None or device.type != "cuda":
        mode = checkpointing_mode(job.model.activation_checkpointing)
        return Recompute("none") if mode == "auto" else Recompute(mode, job.model.recompute_layers)
    return recompute_for(job, torch.cuda.get_device_properties(device).total_memory)


def construction_device(job: JobConfig, device: torch.device) -> contextlib.AbstractContextManager[object]:
    """Where the model's tensors are made: on the rank's GPU, where its random initialisation
    takes milliseconds instead of seconds on one host core and no host-to-device copy follows,
    unless ZeRO-3 partitions the model (it is built on the host, whole, or partitioned as each
    module is made; a GPU may not hold it whole)."""
    if device.type == "cuda" and job.zero.stage != 3:
        return device
    return contextlib.nullcontext()


def build_model(job: JobConfig, attention_fn: AttentionFn, device: Optional[torch.device] = None) -> Transformer:
    """The job's model, its savers resolved for ``device`` (see ``resolve_recompute``)."""
    # Same seed on every rank: identical initial weights without a broadcast. A pretrained
    # model's weights are loaded after the engine is built, so they are not drawn at all.
    torch.manual_seed(job.train.seed)
    recompute = resolve_recompute(job, device)
    savers = dataclasses.replace(
        MemorySavers.from_job(job), checkpointing=recompute.mode, recompute_layers=recompute.layers
    )
    with skip_parameter_init() if job.model.hf else contextlib.nullcontext():
        return Transformer(
            ModelArgs.from_job(job),
            attention_fn=attention_fn,
            init_std=None if job.model.hf else job.model.init_std,
            savers=savers,
            fused=FusedOps.from_job(job),
        )


def warm_up(job: JobConfig, device: torch.device) -> None:
    """Touch everything a rank's first build and first step load lazily (DeepSpeed's and
    torch's deferred imports, op builders, kernels, the corpus) by training one step of a
    one-layer copy of the model in a one-rank world of its own, on rows of at most
    ``WARM_UP_SEQ_LEN`` tokens (a long context needs the job's CP ring to fit; one rank holds
    it all). A fresh process spends seconds on these; a warm spare or a new worker that did it
    in the background joins a world in a fraction of a second.

    A preference job rehearses its objective's step (pair documents, per-token losses, the
    completions' sums, the objective) on one made-up pair (``pairset.rehearsal_pairs``): its
    dataset's pairs may all be longer than the rehearsal's rows, and a pair is never cut into
    one. DPO and IPO rehearse as SimPO (the same kernels), so no reference pass is taken."""
    preference = job.train.objective != "lm"
    seq_len = min(job.data.seq_len, WARM_UP_SEQ_LEN)
    data = dataclasses.replace(job.data, seq_len=seq_len)
    if not preference:
        # Conversations of a chat dataset cut to the warm-up's rows: one longer than them still warms up.
        data = dataclasses.replace(data, path=_warm_up_data(job.data.path), chat_overlong="truncate")
    tiny = dataclasses.replace(
        job,
        # The weights of a pretrained model are not needed to warm up: a random copy does, of
        # the first layer (and its attention window).
        model=dataclasses.replace(
            job.model, n_layers=1, hf="", layer_types=job.model.layer_types[:1] if job.model.layer_types else None
        ),
        mesh=dataclasses.replace(job.mesh, dp=1, cp=1, ulysses=None, min_dp=1, max_dp=None, spares=0),
        # One rank: the default's ring of one, which runs local attention whatever the job's layout
        # (a hybrid's mesh.ulysses would not fit in one rank).
        attention=dataclasses.replace(job.attention, impl=AttentionConfig.impl),
        train=dataclasses.replace(job.train, global_batch=1, micro_batch=1, stop_at_step=None,
                                  objective="simpo" if job.train.objective in REFERENCE_OBJECTIVES else job.train.objective),
        data=data,
        checkpoint=dataclasses.replace(job.checkpoint, snapshot_every=0),
        chaos=ChaosConfig(),
    )
    pairs = rehearsal_pairs(seq_len, tiny.model_int("vocab_size"), prefix_sharing=data.prefix_sharing) if preference else None
    set_rank_env(rank=0, world_size=1, device=device)
    cuda = device.type == "cuda"
    dist.init_process_group(
        "nccl" if cuda else "gloo", store=dist.HashStore(), rank=0, world_size=1, device_id=device if cuda else None
    )
    trainer = Trainer(tiny, rank=0, device=device, samples=pairs)
    try:
        trainer.train_step()
    finally:
        trainer.close()


def _warm_up_data(path: str) -> str:
    # Row samples have the job's seq_len, not the warm-up's: a byte stream stands in for them.
    from ringtrain.config import STDLIB_CORPUS

    return STDLIB_CORPUS if path.endswith(".npy") else path


def _closing_reduction_tampered(faults: set[str], device: torch.device) -> bool:
    """Whether a chaos fault of the step (``faults``, their kinds) tampers with its closing
    all-reduce, the one its reported loss comes from: skip_collective leaves it out, wrong_shape
    enters it with another shape (here, in place of it). The rank then reports its own loss."""
    if "skip_collective" in faults:
        return True
    if "wrong_shape" in faults:
        # On the rank's own device: NCCL rejects a CPU tensor before anything is sent, which
        # would fail this rank at once instead of leaving its peers waiting on a mismatched
        # collective (the stall the fault is there to produce). gloo returns at once.
        dist.all_reduce(torch.zeros(0, device=device))
        return True
    return False


def _attended_tokens(mb: MicroBatch) -> int:
    """The micro-batch's tokens that are not padding (a chat row's padding is document -1)."""
    return int(mb.input_ids.size if mb.doc_ids is None else (np.asarray(mb.doc_ids) >= 0).sum())


def _label_weight(mb: MicroBatch) -> float:
    """What a micro-batch adds to the step's denominator: its labels, or their weights' sum."""
    if mb.weights is None:
        return float((mb.labels != IGNORE_INDEX).sum())
    return float(mb.weights.sum(dtype=np.float64))


class Trainer:
    """Everything one rank needs to train; assumes ``torch.distributed`` is initialised."""

    def __init__(
        self,
        job: JobConfig,
        *,
        rank: int,
        device: torch.device,
        attention_factory: Optional[AttentionFactory] = None,
        deliver: Optional[DeliverFn] = None,
        reference: Optional[Reference] = None,
        samples: Optional[SampleSource] = None,
    ) -> None:
        """``reference``: DPO's and IPO's reference table, or the weights to take it with
        (``train/reference.py``); None: taken with the starting weights. ``samples``: what the
        rank trains on in place of the job's data (a warm-up's made-up pair)."""
        self.job = job
        self.device = device
        self.dtype = resolve_dtype(job, device)
        topology = job.topology
        controllers = job.controllers
        self.mesh = build_mesh(
            topology, rank, form_timeout_s=controllers.join_timeout_s, timeout_s=controllers.step_timeout_s
        )
        attention_fn = (attention_factory or default_attention)(job, self.mesh)
        skip_shm_comm_op()
        with partitioned_construction(job, self.mesh, self.dtype), construction_device(job, device):
            self.model = build_model(job, attention_fn, device)
        self.engine = build_engine(self.model, job, self.mesh, self.dtype, device.type)
        c = self.mesh.coord
        self.data = ShardedData(
            samples if samples is not None else open_samples(job),
            seq_len=job.data.seq_len,
            seed=job.train.seed,
            plan=BatchPlan(job.train.global_batch, topology.dp, job.train.micro_batch),
            ring=topology.ring,
            ulysses=topology.ulysses,
            ring_idx=c.ring_idx,
            ulysses_idx=c.ulysses_idx,
            vocab_size=job.model_int("vocab_size"),
            loss_norm=job.train.loss_norm,
        )
        self.prefetcher = BatchPrefetcher(self.data)
        self.step = 0  # optimizer steps completed
        # Batches consumed: the step's samples are those of batch ``data_cursor``. It runs ahead
        # of ``step`` only when a poisoned batch was skipped.
        self.data_cursor = 0
        self.skip_batches = set(job.train.skip_batches)
        self.faults = FaultPlan(job.chaos.faults)
        self.bad_device: Optional[FaultSpec] = None  # a bitflip fault struck: this device corrupts bits
        self.zero = ZeroState(self.engine, self.model, job.zero.stage, rank, topology.world_size)
        if job.model.hf:
            self.load_pretrained(job.model.hf)
        # A preference objective, and (DPO, IPO) each pair's log-probs under the reference: the
        # run's table when given, else taken here, before any state is restored.
        self.objective = Objective.of(job.train.objective, job.train.preference) if job.train.objective != "lm" else None
        self.reference: Optional[np.ndarray] = None
        if self.objective is not None and self.objective.name in REFERENCE_OBJECTIVES:
            self.reference = reference_table(self, reference)
        self.snapshotter: Optional[Snapshotter] = None
        if job.checkpoint.snapshot_every > 0:
            self.snapshotter = Snapshotter(
                self.zero,
                rank=rank,
                world_size=topology.world_size,
                device=device,
                deliver=deliver,
                keep=job.checkpoint.keep_in_memory,
                staging=job.checkpoint.snapshot_staging,
            )

    def load_pretrained(self, folder: str, key: str = "model.hf") -> None:
        """Put a Hugging Face model's weights into this rank's ZeRO state, reading only the
        fragments this rank keeps; Adam starts from zero moments. Errors name ``key``."""
        from ringtrain.hf.weights import PretrainedWeights

        weights = PretrainedWeights(folder, key=key)
        weights.check({name: tuple(full_shape(p)) for name, p in self.model.named_parameters()})
        self.zero.load(weights)

    def _tensor(self, array: object) -> torch.Tensor:
        host = torch.as_tensor(array, dtype=torch.long)
        if self.device.type != "cuda":
            return host.to(self.device)
        # From pinned memory the copy is a DMA queued behind the work already launched; from
        # pageable memory it would stage through a bounce buffer and block the host until done.
        return host.pin_memory().to(self.device, non_blocking=True)

    def _docs(self, mb: MicroBatch) -> dict[str, Documents]:
        """The model's document-id argument under document packing, else nothing: the ids on the
        device, and the host copy the batch already is (the blocks are cut by it); a preference
        pair's documents in their families."""
        if mb.doc_ids is None:
            return {}
        return {"doc_ids_BS": Documents(self._tensor(mb.doc_ids), np.asarray(mb.doc_ids), mb.family)}

    def _weights(self, mb: MicroBatch) -> dict[str, torch.Tensor]:
        """The model's per-label loss weights (train.loss_norm: sequence), else nothing: the
        unweighted loss path runs as it always has."""
        if mb.weights is None:
            return {}
        return {"weights_BS": torch.as_tensor(mb.weights, dtype=torch.float32).to(self.device)}

    def _count_labels(self, batches: Sequence[MicroBatch]) -> float:
        """The labels of the whole step, over every rank (one scalar all-reduce); with loss
        weights, their sum: the step's conversations with a trained label."""
        local = sum(_label_weight(mb) for mb in batches)
        # On the rank's device: on CUDA the default group is NCCL, which takes no CPU tensors.
        total = torch.tensor([float(local)], dtype=torch.float64, device=self.device)
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
        count = float(total.item())
        if any(mb.weights is not None for mb in batches):
            # Each conversation's fp32 weights add up to 1 within rounding: the count is whole.
            count = float(round(count))
        return max(count, 1.0)

    def _inject_faults(self) -> tuple[bool, list[FaultSpec]]:
        """Take the chaos plan's faults for the step about to run: whether its loss is poisoned,
        and the faults that strike mid-step. Slow faults delay the step's start here."""
        poison, mid_step = False, []
        for fault in self.faults.take(self.mesh.rank, self.step + 1):
            if fault.kind == "slow":
                time.sleep(fault.seconds)
            elif fault.kind == "nan":
                poison = True
            elif fault.kind == "bitflip":
                self.bad_device = fault  # and it stays bad: every later probe round shows it
                if fault.target == "gradients":
                    self._corrupt_next_gradient(fault.bit)
            else:
                mid_step.append(fault)
        return poison, mid_step

    def _corrupt_next_gradient(self, bit: int) -> None:
        """Flip ``bit`` (of an fp32 element; of its top half on 16-bit types) in this rank's next
        gradient of the first parameter, at its largest element so the damage is real; the
        gradient reduction then hands the corruption to every rank."""
        param = next(p for p in self.model.parameters() if p.requires_grad)

        def flip(grad: torch.Tensor) -> torch.Tensor:
            handle.remove()
            element = int(grad.detach().reshape(-1).abs().argmax())
            return flip_bit(grad.contiguous(), element, max(0, bit - (32 - 8 * grad.element_size())))

        handle = param.register_hook(flip)

    def probe_round(self) -> dict[str, str]:
        """One SDC probe round on this rank: probe name -> digest. Collective (the probe
        all-reduce runs over the world): every rank of the world calls it together."""
        flip = BitFlip(probe="gemm_float32", bit=self.bad_device.bit) if self.bad_device is not None else None
        return digests(run_probes(self.device, kernel=self.job.attention.kernel, flip=flip))

    @staticmethod
    def _strike(faults: Sequence[FaultSpec]) -> None:
        """Crash and hang strike after the forward pass, with the step's collectives under way."""
        for fault in faults:
            if fault.kind == "crash":
                os._exit(70)  # abrupt, like a kill: no cleanup, no exception to report
            if fault.kind == "hang":
                # Stuck in compute: the peers wait in their next collective until the
                # controller acts (a bounded sleep when seconds is set, else for good).
                deadline = time.monotonic() + (fault.seconds or float("inf"))
                while time.monotonic() < deadline:
                    time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))

    def _micro_step(
        self, mb: MicroBatch, poison: bool = False, strike: Sequence[FaultSpec] = (), norm: Optional[float] = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward, backward and (at the accumulation boundary) the optimizer step of one
        micro-batch; returns this rank's summed token loss and its number of labels."""
        labels = self._tensor(mb.labels).flatten()
        # The model returns the summed loss itself (fused, chunked or over the whole logits, as
        # its output head says): with the fused and chunked losses the whole [tokens x vocab]
        # logits never exist. Normalised below.
        loss_sum = self.engine(self._tensor(mb.input_ids), self._tensor(mb.position_ids), labels, **self._docs(mb),
                               **self._weights(mb))
        self._strike(strike)
        # The mean number of labels a rank holds per micro-batch (see the module docstring).
        self._backward_and_step(loss_sum / (norm or len(mb.samples) * self.data.labels_per_sample / self.mesh.topology.cp),
                                poison)  # fmt: skip
        count = (labels != IGNORE_INDEX).sum() if mb.weights is None else torch.tensor(_label_weight(mb), device=self.device)
        return (loss_sum * float("nan") if poison else loss_sum).detach(), count

    def train_step(self) -> StepReport:
        poison, strike = self._inject_faults() if self.faults else (False, [])
        start = time.perf_counter()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        lr = float(self.engine.get_lr()[0])  # the rate this step uses; the scheduler advances in step()
        while self.data_cursor in self.skip_batches:
            self.data_cursor += 1
        batch = self.data_cursor
        batches, data_wait = self.prefetcher.get(batch, self.mesh.coord.replica, self.skip_batches)
        objective_metrics: dict[str, float] = {}
        if self.objective is not None:
            loss, local_loss_value, objective_metrics = self._pairs_step(batches, poison, strike)
        else:
            loss, local_loss_value = self._lm_step(batches, poison, strike)
        self.step += 1
        self.data_cursor += 1
        grad_norm = self.engine.get_global_grad_norm()
        # Every scalar is read off the device before the capture: a read after it would wait
        # behind the snapshot's device-to-host copy (one copy engine a direction, in order).
        grad_norm_value = float(grad_norm) if grad_norm is not None else float("nan")
        step_time = time.perf_counter() - start
        taken = self._maybe_snapshot()
        last = self.last_snapshot()
        return StepReport(
            step=self.step,
            rank=self.mesh.rank,
            loss=loss,
            local_loss=local_loss_value,
            lr=lr,
            grad_norm=grad_norm_value,
            num_tokens=sum(_attended_tokens(mb) for mb in batches),
            trained_tokens=sum(int((mb.labels != IGNORE_INDEX).sum()) for mb in batches),
            step_time_s=step_time,
            data_wait_s=data_wait,
            batch=batch,
            samples=tuple(s for mb in batches for s in mb.samples) if self.mesh.coord.ring_pos == 0 else (),
            origins=tuple(o for mb in batches for o in mb.origins) if self.mesh.coord.ring_pos == 0 else (),
            snapshot_step=last.step if last else 0,
            snapshot_taken=taken,
            snapshot_s=last.total_s if last else 0.0,
            snapshot_bytes=last.num_bytes if last else 0,
            memory_bytes=self._peak_memory(),
            objective_metrics=objective_metrics,
        )

    def _lm_step(self, batches: Sequence[MicroBatch], poison: bool, strike: Sequence[FaultSpec]) -> tuple[float, float]:
        """The step's micro-batches under the next-token loss: (the step's loss, this rank's own)."""
        world = self.mesh.topology.world_size
        labels_per_rank, norm = self.job.train.global_batch * self.data.labels_per_sample / world, None
        if self.data.packed_documents:
            # Documents drop labels (see data.py): the step's mean is over the labels it has.
            labels_per_rank = self._count_labels(batches) / world
            norm = labels_per_rank / len(batches)
        sums, counts = zip(
            *(self._micro_step(mb, poison, strike if i == 0 else (), norm) for i, mb in enumerate(batches))
        )
        local_sum = torch.stack(sums).sum()
        local_loss = local_sum / torch.stack(counts).sum().clamp(min=1)
        # The world's mean of sum / (N / world) is the mean over all N labels of the step.
        loss = self._global_loss(local_sum / labels_per_rank, {f.kind for f in strike})
        return loss, float(local_loss.item())

    def _pairs_step(self, batches: Sequence[MicroBatch], poison: bool,
                    strike: Sequence[FaultSpec]) -> tuple[float, float, dict[str, float]]:  # fmt: skip
        """The step's micro-batches of preference pairs under the objective (train/pair_loss.py):
        (the step's loss, this rank's own, the step's metrics)."""
        assert self.objective is not None
        topology = self.mesh.topology
        num_pairs = pair_loss.count_pairs(list(batches), topology.cp, self.device)
        scale = pair_loss.pairs_scale(num_pairs, topology.world_size, len(batches))
        losses = [self._pairs_micro_step(mb, scale, poison, strike if i == 0 else ()) for i, mb in enumerate(batches)]
        reduce = not _closing_reduction_tampered({f.kind for f in strike}, self.device)
        loss, metrics = pair_loss.step_metrics(losses, num_pairs, topology.cp, self.device, reduce=reduce)
        local = float(torch.cat([l.loss.detach() for l in losses]).mean().item()) if losses else float("nan")
        return loss, local, metrics

    def _pairs_micro_step(self, mb: MicroBatch, scale: float, poison: bool, strike: Sequence[FaultSpec]) -> PairLosses:
        """Forward, backward and (at the accumulation boundary) the optimizer step of one
        micro-batch of pairs; its pairs' losses and rewards."""
        assert self.objective is not None
        token_losses = self.token_losses(mb, stepping=True)
        self._strike(strike)
        sums, counts = pair_loss.completion_sums(-token_losses, mb, self.mesh.cp_group, self.device)
        loss, losses = pair_loss.micro_loss(self.objective, pair_loss.pair_scores(sums, counts, mb.pairs, self.reference), scale)
        self._backward_and_step(loss, poison)
        # A poisoned step reports its loss as NaN, as the lm path's does: the controller reads the reported loss.
        return dataclasses.replace(losses, loss=losses.loss.detach() * float("nan")) if poison else losses

    def _backward_and_step(self, loss: torch.Tensor, poison: bool) -> None:
        """Backward of a micro-batch's loss, then the engine's step (the optimizer's at the
        accumulation boundary, after the snapshot in flight has read what it changes)."""
        if poison:
            loss = loss * float("nan")  # NaN gradients too, as a real numerical blow-up would give
        self.engine.backward(loss)
        if self.snapshotter is not None and self.engine.is_gradient_accumulation_boundary():
            self.snapshotter.fence()  # the optimizer step below changes what the copy reads
        self.engine.step()

    def token_losses(self, mb: MicroBatch, *, stepping: bool = False) -> torch.Tensor:
        """Each of this rank's tokens' loss in ``mb`` under the current weights (0 where it
        predicts nothing): through the engine for a step's backward (``stepping``), else the
        model's forward alone, for passes that take no step."""
        forward = self.engine if stepping else self.model
        labels = self._tensor(mb.labels).flatten()
        return forward(self._tensor(mb.input_ids), self._tensor(mb.position_ids), labels, **self._docs(mb),
                       per_token=True)  # fmt: skip

    def _global_loss(self, local_loss: torch.Tensor, faults: set[str]) -> float:
        """The world's mean of ``local_loss``, unless a chaos fault tampers with the reduction."""
        if _closing_reduction_tampered(faults, self.device):
            return float(local_loss.item())
        return float(all_reduce_mean(local_loss).item())

    def _peak_memory(self) -> int:
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        # Linux reports the peak resident set in KiB.
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    def _maybe_snapshot(self) -> bool:
        """Capture this step's state when a snapshot is due; whether one was."""
        every = self.job.checkpoint.snapshot_every
        # The last step of the run is always captured: it is the one a resume continues from.
        if self.snapshotter is None or (self.step % every and self.step != self.job.last_step):
            return False
        self.snapshotter.capture(self.step, capture_scalars(self.engine, self.zero, self.step, self.data_cursor))
        return True

    def last_snapshot(self) -> Optional[Snapshot]:
        """The newest finished snapshot (the one of this step may still be in flight)."""
        return self.snapshotter.newest() if self.snapshotter is not None else None

    def snapshot(self, step: int) -> Snapshot:
        """This rank's snapshot of ``step``, waiting for it if it is still being taken."""
        if self.snapshotter is None:
            raise RuntimeError("snapshots are off (checkpoint.snapshot_every=0)")
        self.snapshotter.settle()  # a copy that failed leaves no snapshot of its step, and the others as they were
        snap = self.snapshotter.get(step)
        if snap is None:
            raise KeyError(f"no snapshot of step {step} on rank {self.mesh.rank} (have {self.snapshotter.steps()})")
        return snap

    def restore(self, blobs: list[bytes]) -> int:
        """Load every rank's shard of one snapshot (taken at any dp); returns the step resumed."""
        index = FragmentIndex([decode(b) for b in blobs])
        if self.snapshotter is not None:
            self.snapshotter.settle()  # a copy in flight still reads the state about to be replaced
        self.zero.load(index)
        self.step, self.data_cursor = restore_scalars(self.engine, self.zero, index.scalars)
        if self.snapshotter is not None:
            self.snapshotter.forget_after(self.step)
            # The restored state is a rollback point from now on, in this world's memory and its
            # holders: a failure before the next snapshot (an SDC scan that fails right after
            # a resume, say) goes back to it instead of finding nothing.
            self.snapshotter.capture(self.step, capture_scalars(self.engine, self.zero, self.step, self.data_cursor),
                                     after_step=False)
        return self.step

    def skip_batch(self, batch: int) -> None:
        """Never train on data batch ``batch`` (a poisoned one); the data moves past it."""
        self.skip_batches.add(batch)

    def parameters_fp32(self) -> dict[str, torch.Tensor]:
        """Full (unpartitioned) parameters as fp32 CPU tensors; collective under ZeRO-3."""
        out: dict[str, torch.Tensor] = {}
        if self.job.zero.stage == 3:
            import deepspeed

            for name, p in self.model.named_parameters():
                with deepspeed.zero.GatheredParameters([p]):
                    out[name] = p.detach().float().cpu().clone()
        else:
            for name, p in self.model.named_parameters():
                out[name] = p.detach().float().cpu().clone()
        return out

    def abort_process_groups(self) -> None:
        """Abort every process group of this rank: its connections to peers close, so a peer
        blocked on this rank fails at once; collectives in flight here end with an error."""
        if dist.is_initialized():
            from torch.distributed.distributed_c10d import _abort_process_group

            _abort_process_group()

    def leave_process_group(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

    def close(self) -> None:
        self.prefetcher.close()
        if self.snapshotter is not None:
            self.snapshotter.close()
        self.leave_process_group()
