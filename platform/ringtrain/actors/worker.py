"""TrainWorker: one rank on one device; a plain class, made a Ray actor where it is spawned."""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import threading
import time
import warnings
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence, TypeVar

from ringtrain.actors.cluster import rank_interfaces
from ringtrain.actors.holder import HolderDelivery
from ringtrain.config import JobConfig
from ringtrain.status import StepReport, WorkerInfo

if TYPE_CHECKING:
    import numpy as np
    import torch

    from ringtrain.evaluation.generation import GenerationRequest, ScoreRequest
    from ringtrain.evaluation.tally import LossTally
    from ringtrain.evaluation.text import Tokenizer
    from ringtrain.train.evalset import EvalSet
    from ringtrain.train.pairset import PairSet
    from ringtrain.train.reference_input import Reference, ReferenceWeights

T = TypeVar("T")
log = logging.getLogger(__name__)


def process_env(device_type: str) -> dict[str, str]:
    """The environment variables a worker process runs with."""
    env = {"DS_ACCELERATOR": "cuda" if device_type == "cuda" else "cpu"}
    if device_type == "cuda":
        # A failed NCCL collective aborts its communicator and raises, without tearing the
        # process down (2: clean up only): the survivor keeps its snapshots for the recovery.
        env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "2"
        # Segments that grow in place rather than new blocks per size: at long context the
        # activations' sizes vary per layer and step, and fixed segments fragment (the planner's
        # headroom assumes they do not). A user's own setting stands.
        env["PYTORCH_CUDA_ALLOC_CONF"] = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    # Quiet the per-process banners (inherited by any subprocess); errors still surface
    # through the controller.
    env["PYTHONWARNINGS"] = "ignore"
    env.update(rank_interfaces(os.environ))
    return env


class TrainWorker:
    """Owns one device, joins the job's process group, and trains one step per call.

    Construction is cheap (no torch import), so a failed placement costs nothing. ``join``
    builds the rank: it is collective, so every rank of a world calls it together, and it can
    be called again to move a live process into a new world (another rank, another dp) after a
    failure or a resize. A worker that has not joined yet is a spare; ``warm`` loads torch and
    DeepSpeed so that taking a seat costs no cold start.
    """

    def __init__(self, job: JobConfig, rank: int, device_type: str, own_process: bool = False) -> None:
        if own_process:
            # An actor's process is its own: set its environment before anything reads it
            # (DeepSpeed picks its accelerator on import). Set here rather than as a Ray
            # runtime_env, which would make Ray start a fresh process instead of a prestarted one.
            os.environ.update(process_env(device_type))
            warnings.simplefilter("ignore")
        self.job = job
        self.rank = rank
        self.device_type = device_type
        self._store: Any = None  # rank 0's rendezvous store, kept alive until the next world's
        self._trainer: Any = None
        self._connections: dict[int, str] = {}  # sockets this world's process groups opened
        self._busy = False  # a train_step call is running
        self._bad_device: Any = None  # a chaos bitflip struck this process's device: it stays bad
        self._pin_seq = 0  # sequence number of the newest pin_snapshot applied
        self._pin_lock = threading.Lock()
        self._device: Optional[torch.device] = None  # bound by the last warm or join
        # The model's tokenizer by its folder: read at the first generation that stops on text.
        self._text: Optional[tuple[str, Tokenizer]] = None

    def info(self) -> WorkerInfo:
        return WorkerInfo(
            rank=self.rank,
            host=_node_ip(),
            pid=os.getpid(),
            device=self.device_type,
            node_id=_node_id(),
            device_name=_device_name(self._device) if self._device is not None else self.device_type,
        )

    def warm(self, rehearse: bool = True) -> WorkerInfo:
        """Load what ``join`` and the first step need and say where this worker runs. With
        ``rehearse``, also train one step of a one-layer model alone (the rest of a cold start:
        DeepSpeed's deferred imports, op builders, kernels), so that joining later is quick;
        the workers of the first world skip it, as they all pay that cost together anyway."""
        from ringtrain.train import forensics
        from ringtrain.train.trainer import warm_up

        _quiet_deepspeed()
        device = self._bind_device(self.job)
        # torch reads the flight recorder's buffer size when a process group is created, and
        # the rehearsal creates this process's first one: armed any later, a spare that takes
        # a seat would have no trace of its collectives to show after a stall.
        forensics.arm_flight_recorder()
        if rehearse:
            warm_up(self.job, device)
        return self.info()

    def _bind_device(self, job: JobConfig) -> torch.device:
        """This worker's torch device, made current (CUDA) or given its CPU threads."""
        import torch

        if self.device_type == "cuda":
            device = torch.device("cuda", _assigned_cuda_index())
            torch.cuda.set_device(device)
        else:
            device = torch.device("cpu")
            # Ray sets OMP_NUM_THREADS=1 only for actors with num_cpus < 1; be explicit either way.
            torch.set_num_threads(max(1, int(job.cluster.cpus_per_worker)))
        self._device = device
        return device

    def heartbeat(self) -> int:
        """Answered on the second concurrency slot while a step runs: the process is alive."""
        return os.getpid()

    def create_store(self, world_size: int) -> tuple[str, int]:
        """Rank 0 only: open the world's rendezvous store on a free port and say where it is."""
        from ringtrain.train.mesh import create_store

        host = _node_ip()
        self._store, port = create_store(host, world_size, self.job.controllers.start_timeout_s)
        return host, port

    def drop_store(self) -> None:
        """Rank 0 only, answered while its join may be blocked: close the world's rendezvous
        store, so every rank still waiting in it for a peer that died fails now instead of at
        the store's timeout (the recovery then forms another world)."""
        self._store = None

    def join(self, job: JobConfig, rank: int, host: str, port: int, holders: Sequence[Any] = (),
             reference: Optional["Reference"] = None) -> int:  # fmt: skip
        """Become ``rank`` of ``job``'s world: join the process group and build model, engine
        and data. Any earlier world of this process is left first. Returns the parameter count.

        ``holders`` are the SnapshotHolder actors every snapshot of this rank is handed to;
        ``reference`` DPO's and IPO's reference table, or the weights to take it with.
        """
        from ringtrain.train import collectives, forensics
        from ringtrain.train.mesh import init_process_group, open_sockets
        from ringtrain.train.model import num_params
        from ringtrain.train.trainer import Trainer, set_rank_env

        self.leave()
        # A world this process joined without finishing (a join whose Trainer failed, before
        # that cleanup existed, or an init_process_group elsewhere) would make this join fail
        # with "trying to initialize the default process group twice".
        _leave_default_group(self.device_type, {})
        self.job, self.rank = job, rank
        device = self._bind_device(job)
        set_rank_env(rank=rank, world_size=job.world_size, device=device)
        _quiet_deepspeed()
        forensics.arm_flight_recorder()  # torch's own trace of the collectives, read after a stall
        before = open_sockets()
        init_process_group(
            backend="nccl" if device.type == "cuda" else "gloo",
            host=host,
            port=port,
            rank=rank,
            world_size=job.world_size,
            timeout_s=job.controllers.join_timeout_s,  # the Trainer's mesh gives it step_timeout_s
            # NCCL binds its communicators to this device at once, instead of guessing one
            # from the current device at the first collective.
            device_id=device if device.type == "cuda" else None,
        )
        try:
            # Every collective of the world is recorded, so a stall can be diagnosed; a new world
            # restarts the per-group sequence numbers.
            collectives.install().reset()
            self._trainer = Trainer(job, rank=rank, device=device, deliver=HolderDelivery(holders), reference=reference)
            self._trainer.bad_device = self._bad_device  # a new world does not heal the device
            collectives.install()  # points the DeepSpeed engine just built at the recorder too
        except BaseException:
            # The process group formed, the rank did not (a peer died in DeepSpeed's broadcast,
            # say): leave the group now, so the next join can form another, and close its
            # sockets, so the peers still building this world fail at once.
            self._abandon_join(before)
            raise
        # The sockets that appeared while joining are the world's (gloo pairs, the store client);
        # should Ray's own threads have opened one meanwhile, severing it on a failure costs
        # this worker its Ray connection, and it is replaced like a dead one.
        self._connections = {fd: s for fd, s in open_sockets().items() if before.get(fd) != s}
        return num_params(self._trainer.model)

    def _abandon_join(self, before: dict[int, str]) -> None:
        """Undo a join that failed after its process group formed; never raises (the join's
        own error is the one to report)."""
        from ringtrain.train.mesh import open_sockets

        trainer, self._trainer = self._trainer, None
        try:
            _leave_default_group(self.device_type, {fd: s for fd, s in open_sockets().items() if before.get(fd) != s})
            if trainer is not None:
                trainer.close()
        except Exception:
            log.warning("leaving the process group of a failed join failed", exc_info=True)

    def leave(self) -> None:
        """Drop this process's rank: snapshots in its memory and its process group go."""
        if self._trainer is not None:
            self._trainer.close()
            self._trainer = None

    def train_step(self, probe: bool = False) -> StepReport:
        """One optimizer step; with ``probe``, followed by an SDC probe round (collective, so
        every rank of the world is asked for one together)."""
        from ringtrain.train import collectives

        trainer = self._trainer
        assert trainer is not None, "join() must run before train_step()"
        self._busy = True
        try:
            recorder = collectives.active()
            blocked_before, started = (recorder.blocked_s() if recorder else 0.0), time.perf_counter()
            report = trainer.train_step()
            # The whole call (a chaos slow fault's delay included) less the time blocked in
            # collectives, i.e. waiting on peers: this rank's own share of the step.
            blocked = (recorder.blocked_s() - blocked_before) if recorder else 0.0
            report = dataclasses.replace(report, compute_s=max(0.0, time.perf_counter() - started - blocked))
            self._bad_device = trainer.bad_device
            if probe:
                report = dataclasses.replace(report, probes=trainer.probe_round())
            return report
        except BaseException:
            self._break_world()
            raise
        finally:
            self._busy = False

    def evaluate(self, evalset: "EvalSet", bucket_tokens: int) -> "LossTally":
        """This rank's loss tally of ``evalset`` (no gradients, the training state untouched).
        Collective: every rank of the world is asked together, between steps."""
        from ringtrain.train.evaluator import Evaluator

        return self._collective(lambda trainer: Evaluator.of(trainer).losses(evalset, bucket_tokens))

    def generate(self, request: "GenerationRequest") -> list[Optional[list[int]]]:
        """The new tokens of this rank's replica's prompts of ``request`` (None for the other
        replicas'), through the KV cache sharded over its CP group; collective."""
        from ringtrain.train.evaluator import Evaluator

        # Stop strings are matched in the text the model's tokenizer makes (bytes without one).
        decode = self._text_tokenizer().decode if request.stop.strings else None
        return self._collective(lambda trainer: Evaluator.of(trainer).generate(request, decode))

    def _text_tokenizer(self) -> "Tokenizer":
        """The job's model's tokenizer (bytes where its folder has none), read once per folder:
        every generation of a run or an lm-eval task would otherwise parse tokenizer.json again."""
        from ringtrain.evaluation.text import ByteTokenizer
        from ringtrain.evaluation.tokenizer import find_tokenizer

        folder = self.job.model.hf
        if self._text is None or self._text[0] != folder:
            self._text = (folder, find_tokenizer(folder) or ByteTokenizer())
        return self._text[1]

    def score(self, request: "ScoreRequest") -> list[Optional[tuple[float, bool]]]:
        """This rank's replica's sequences of ``request`` scored (None for the other replicas');
        collective."""
        from ringtrain.train.evaluator import Evaluator

        return self._collective(lambda trainer: Evaluator.of(trainer).score(request))

    def reference_table(self) -> Optional["np.ndarray"]:
        """DPO's and IPO's reference table this rank's world took (the same on every rank), or None."""
        return self._trainer.reference if self._trainer is not None else None

    def score_pairs(self, pairs: "PairSet", weights: Optional["ReferenceWeights"]) -> tuple["np.ndarray", "np.ndarray"]:
        """Every pair of ``pairs`` scored on this world's mesh (``train.reference.pair_logps``),
        ``weights`` first put in the model's place when given; collective."""
        from ringtrain.train.reference import load_weights, pair_logps, pairs_data

        def score(trainer: Any) -> tuple["np.ndarray", "np.ndarray"]:
            if weights is not None:
                load_weights(trainer, weights)
            return pair_logps(trainer, pairs_data(trainer, pairs, pairs.seq_len))

        return self._collective(score)

    def _collective(self, call: Callable[[Any], T]) -> T:
        """Run ``call(trainer)``; a failure cuts this rank off its world, as in a step."""
        trainer = self._trainer
        assert trainer is not None, "join() must run first"
        self._busy = True
        try:
            return call(trainer)
        except BaseException:
            self._break_world()
            raise
        finally:
            self._busy = False

    def pin_snapshot(self, step: int, seq: int) -> None:
        """Hold the newest snapshot at or before ``step`` (the last clean scan's) in memory,
        unless a later pin (higher ``seq``) already arrived."""
        with self._pin_lock:
            if seq <= self._pin_seq:
                return
            self._pin_seq = seq
            trainer = self._trainer
        if trainer is not None and trainer.snapshotter is not None:
            trainer.snapshotter.pin(step)

    def diagnostics(self) -> dict[str, Any]:
        """Answered on the second concurrency slot while a step may be stuck: this rank's
        recent collectives, where it is now, every thread's stack, and whether it is in a step."""
        from ringtrain.train import collectives, forensics

        recorder = collectives.active()
        if recorder is None:
            return {"records": [], "state": {}, "stacks": forensics.snapshot_stacks(), "busy": self._busy}
        # NCCL's flight recorder sees what the host-side records cannot: kernels still running.
        return {**recorder.diagnostics(flight_recorder=self.device_type == "cuda"), "busy": self._busy}

    def abort(self) -> str:
        """Answered on the second concurrency slot while a step may be blocked: leave the
        world's collectives now (NCCL: abort the process groups; CPU: shut the gloo sockets).
        The trainer and its snapshots stay, so recovery can read them. Says what was done."""
        if self._trainer is None:
            return ""
        if self.device_type == "cuda":
            from ringtrain.train.mesh import abort_all

            return abort_all()
        from ringtrain.train.mesh import sever

        return f"severed {sever(self._connections)} sockets"

    def _break_world(self) -> None:
        """Cut this rank off its world at once: peers blocked on it in a collective fail now,
        not at the process-group timeout, so a failure spreads through the world in
        milliseconds. The trainer (and its snapshots) stays until the next join, so recovery
        can still read them."""
        try:
            if self.device_type == "cuda":
                self._trainer.abort_process_groups()  # NCCL's abort does what it says
            else:
                from ringtrain.train.mesh import sever

                sever(self._connections)
        except Exception:  # the step's own error is the one to report
            pass

    def snapshot(self, step: int) -> tuple[bytes, str]:
        """This rank's snapshot of ``step`` and its checksum (waits if still being taken)."""
        assert self._trainer is not None
        snap = self._trainer.snapshot(step)
        # A copy: the blob is a view of the snapshotter's buffer, and this answer is pickled (by
        # Ray, or a caller's process group) or kept while training moves on.
        return bytes(snap.blob), snap.checksum

    def snapshot_blob(self, step: int) -> bytes:
        """This rank's snapshot of ``step``, as a restore reads it."""
        return self.snapshot(step)[0]

    def snapshot_steps(self) -> list[int]:
        """Steps of the finished snapshots this process holds (none once it left its world)."""
        if self._trainer is None or self._trainer.snapshotter is None:
            return []
        self._trainer.snapshotter.settle()
        return self._trainer.snapshotter.steps()

    def rebuildable(self) -> Optional[tuple[int, int]]:
        """(step, world size) of the newest snapshot whose every rank's shard this rank can
        write from its live state: under ZeRO-0 every rank holds the whole state, and it is
        still that step's while no optimizer step ran since (a failed step stops before its
        optimizer step or after it, and the optimizer's step count tells which). None otherwise."""
        trainer = self._trainer
        if trainer is None or trainer.snapshotter is None or trainer.zero.stage != 0:
            return None
        trainer.snapshotter.settle()
        snap = trainer.snapshotter.newest()
        if snap is None or snap.scalars.get("optimizer_steps") != trainer.zero.optimizer_steps():
            return None
        return snap.step, snap.world_size

    def rebuild_shard(self, rank: int, step: int) -> bytes:
        """Rank ``rank``'s shard of snapshot ``step``, written from this rank's live state (see
        ``rebuildable``) with this rank's own scalars of that step."""
        import copy

        from ringtrain.checkpoint.wire import encode

        trainer = self._trainer
        assert trainer is not None and trainer.snapshotter is not None
        snap = trainer.snapshotter.get(step)
        if self.rebuildable() != (step, snap.world_size if snap else -1) or snap is None:
            raise RuntimeError(f"rank {self.rank} cannot write rank {rank}'s shard of step {step}: its state moved on")
        zero = copy.copy(trainer.zero)  # the same live tensors, sliced as ``rank`` slices them
        zero.rank, zero.world_size = rank, snap.world_size
        arrays = [(f, {k: t.detach().float().cpu().numpy() for k, t in f.tensors.items()}) for f in zero.fragments()]
        return encode(step, rank, snap.world_size, snap.scalars, arrays)

    def restore(self, *blobs: bytes, chaos_exit: bool = False) -> int:
        """Load a snapshot (every rank's shard, any dp); returns the step to continue after.
        ``chaos_exit``: a crash_restoring fault strikes this rank in this recovery (the recovery
        decides which: ``actors.recovery.restoring_crashes``)."""
        assert self._trainer is not None
        if chaos_exit:
            os._exit(1)  # chaos: die inside the recovery, as a killed process would
        return self._trainer.restore(list(blobs))

    def skip_batch(self, batch: int) -> None:
        assert self._trainer is not None
        self._trainer.skip_batch(batch)

    def shutdown(self) -> None:
        self.leave()


def _leave_default_group(device_type: str, connections: dict[int, str]) -> None:
    """Leave this process's default process group (and every group made from it), if it has
    one. ``connections`` (the group's sockets) are shut down first on CPU: a half-built
    trainer still referencing the groups keeps gloo's connections open, and peers blocked on
    them would wait out the process-group timeout. On CUDA the groups are aborted, since a
    destroy may wait on a communicator a dead peer left broken."""
    import torch.distributed as dist

    from ringtrain.train.mesh import abort_all, sever

    if not dist.is_initialized():
        return
    if device_type == "cuda":
        abort_all()
        return
    sever(connections)
    dist.destroy_process_group()


def _device_name(device: torch.device) -> str:
    """The bound device's model name ("cpu" on a CPU worker)."""
    if device.type != "cuda":
        return "cpu"
    import torch

    return str(torch.cuda.get_device_name(device))


def _assigned_cuda_index() -> int:
    """This actor's CUDA device index, from the GPUs Ray assigned it (see ``cuda_device_index``)."""
    import ray

    from ringtrain.actors.cluster import cuda_device_index

    if not ray.is_initialized():
        raise RuntimeError("a CUDA TrainWorker runs as a Ray actor with GPUs (cluster.gpus_per_worker >= 1)")
    return cuda_device_index(ray.get_gpu_ids(), os.environ.get("CUDA_VISIBLE_DEVICES"))


def _node_id() -> str:
    try:
        import ray

        return str(ray.get_runtime_context().get_node_id())
    except Exception:
        return ""


def _node_ip() -> str:
    try:
        import ray

        return str(ray.util.get_node_ip_address())
    except Exception:  # outside Ray (tests that use the class as a plain object)
        return socket.gethostbyname(socket.gethostname())


def _quiet_deepspeed(level: Optional[int] = None) -> None:
    import logging

    from ringtrain.train.deepspeed_import import import_deepspeed

    import_deepspeed()  # the package first, without what its import would pull in
    from deepspeed.utils import logger

    logger.setLevel(level or logging.WARNING)
