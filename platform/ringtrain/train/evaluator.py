"""Evaluator: one rank's share of an evaluation, under any dp x cp mesh, without gradients.

Every rank of a replica runs the same forwards over the replica's rows (the CP attention needs
all of them); each scores the positions it holds (``topology.sequence_positions``) and tallies
their losses by position bucket. Tallies simply add up across ranks, so nothing is reduced here:
the caller sums what every rank returns. Generation (passkey's, ``ringtrain generate``'s,
lm-eval's) decodes with a KV cache sharded over the CP group (``train.decode``), the prompts in
batches shared out over the replicas (``evaluation.batching``).

Shape legend: B batch (1 here), S this rank's tokens of the sequence, V vocab.
"""

from __future__ import annotations

import contextlib
from functools import lru_cache
from collections.abc import Sequence
from typing import TYPE_CHECKING, Callable, Iterator, Optional, TypeVar, cast

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from ringtrain.evaluation.batching import plan_batches, replica_batches
from ringtrain.evaluation.buckets import bucket_index
from ringtrain.evaluation.generation import GenerationRequest, ScoreRequest
from ringtrain.evaluation.stops import Decode
from ringtrain.evaluation.tally import LossTally
from ringtrain.topology import CPLayout, Topology, sequence_positions
from ringtrain.train.attention.implementations import ContextParallelAttention
from ringtrain.train.data import IGNORE_INDEX
from ringtrain.train.decode import Decoder
from ringtrain.train.evalset import EvalSet
from ringtrain.train.mesh import Mesh
from ringtrain.train.model import Block, Transformer

if TYPE_CHECKING:
    from ringtrain.train.trainer import Trainer

# (input_ids_BS, position_ids_BS) -> logits_BSV: the model's forward, or a stand-in in tests.
Forward = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
# Positions per cross-entropy chunk: bounds the fp32 copy of the logits at long context.
CHUNK = 8192
_R = TypeVar("_R")
# Padded tokens of a decoded batch where the caller sets none.
DEFAULT_BATCH_TOKENS = 8192


class Evaluator:
    def __init__(self, model: Transformer, mesh: Mesh, device: torch.device, forward: Optional[Forward] = None, *,
                 lockstep: bool = False, batch_tokens: int = DEFAULT_BATCH_TOKENS) -> None:
        """``lockstep``: every rank of the world takes part in every forward (ZeRO-3), so the
        replicas decode as many steps; ``batch_tokens``: the padded tokens of a decoded batch."""
        self.model = model
        self.mesh = mesh
        self.device = device
        self.forward: Forward = forward or model
        self.lockstep = lockstep
        self.batch_tokens = batch_tokens

    @classmethod
    def of(cls, trainer: "Trainer") -> "Evaluator":
        job = trainer.job
        return cls(trainer.model, trainer.mesh, trainer.device, lockstep=job.zero.stage == 3,
                   batch_tokens=job.data.seq_len * job.train.micro_batch)

    @property
    def topology(self) -> Topology:
        return self.mesh.topology

    @contextlib.contextmanager
    def _eval_mode(self) -> Iterator[None]:
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                yield
        finally:
            self.model.train(was_training)

    def _positions(self, seq_len: int) -> np.ndarray:
        t, c = self.topology, self.mesh.coord
        return _positions(seq_len, t.ring, t.ulysses, c.ring_idx, c.ulysses_idx)

    def _logits(self, ids: np.ndarray, positions: np.ndarray) -> torch.Tensor:
        ids_BS = torch.as_tensor(ids, dtype=torch.long, device=self.device).unsqueeze(0)
        pos_BS = torch.as_tensor(positions, dtype=torch.long, device=self.device).unsqueeze(0)
        return self.forward(ids_BS, pos_BS)

    def losses(self, evalset: EvalSet, bucket_tokens: int) -> LossTally:
        """This rank's tally of ``evalset`` (unpadded: it is padded for the mesh here)."""
        t = self.topology
        padded = evalset.padded(multiple=CPLayout.sequence_multiple_of(t.cp), rows_multiple=t.dp)
        positions = self._positions(padded.seq_len)
        buckets = torch.as_tensor(_bucket_indices(positions, bucket_tokens), device=self.device)
        num_buckets = int(buckets.max()) + 1 if buckets.numel() else 1
        sums = torch.zeros(num_buckets, dtype=torch.float64, device=self.device)
        counts = torch.zeros(num_buckets, dtype=torch.float64, device=self.device)
        with self._eval_mode():
            # Every row of the replica, all-padding ones included: the forwards must pair up
            # across the world (ZeRO-3 gathers parameters over every rank in each one).
            rows = padded.replica_rows(self.mesh.coord.replica, t.dp)
            row_sums = torch.zeros(len(rows), dtype=torch.float64, device=self.device)
            row_counts = torch.zeros(len(rows), dtype=torch.float64, device=self.device)
            for i, row in enumerate(rows):
                logits_BSV = self._logits(padded.inputs[row, positions], positions)
                labels = torch.as_tensor(padded.labels[row, positions], dtype=torch.long, device=self.device)
                keep = labels != IGNORE_INDEX
                loss = _token_losses(logits_BSV[0], labels)
                sums += torch.bincount(buckets[keep], weights=loss[keep].double(), minlength=num_buckets)
                counts += torch.bincount(buckets[keep], minlength=num_buckets).double()
                row_sums[i] = loss[keep].double().sum()
                row_counts[i] = keep.sum()
        tally = LossTally(bucket_tokens)
        tally.add_all(sums.tolist(), [int(c) for c in counts.tolist()])
        for row, loss_sum, count in zip(rows, row_sums.tolist(), row_counts.tolist()):
            tally.add_row(row, loss_sum, int(count))
        return tally

    def generate(self, request: GenerationRequest, decode: Optional[Decode] = None) -> list[Optional[list[int]]]:
        """The new tokens of this replica's prompts of ``request`` (None for the other
        replicas'), decoded with a KV cache sharded over the CP group (``train.decode``), in
        batches of at most ``batch_tokens`` padded tokens (``evaluation.batching``); ``decode``
        turns ids into text where stop strings are asked for."""
        decoder = Decoder(self.model, self._attention(), self.device, self._agree)

        def run(batch: Sequence[int]) -> list[list[int]]:
            return decoder.generate([request.prompts[i] for i in batch], request.max_new, sampling=request.sampling,
                                    stop=request.stop, decode=decode, seed=batch[0])

        return self._batched([len(p) for p in request.prompts], run)

    def score(self, request: ScoreRequest) -> list[Optional[tuple[float, bool]]]:
        """Each of this replica's sequences of ``request`` scored (None for the other
        replicas'): ``(summed log-probability, all greedy)``."""
        decoder = Decoder(self.model, self._attention(), self.device, self._agree)

        def run(batch: Sequence[int]) -> list[tuple[float, bool]]:
            return decoder.score([request.sequences[i] for i in batch], [request.scored[i] for i in batch])

        return self._batched([len(s) for s in request.sequences], run)

    def _batched(self, lengths: list[int], run: Callable[[Sequence[int]], list[_R]]) -> list[Optional[_R]]:
        """``run`` over this replica's batches of the items of ``lengths``, results in item order."""
        t = self.topology
        batches = plan_batches(lengths, self.batch_tokens, t.dp)
        out: list[Optional[_R]] = [None] * len(lengths)
        with self._eval_mode():
            for batch in replica_batches(batches, t.dp, self.mesh.coord.replica):
                for i, result in zip(batch, run(batch)):
                    out[i] = result
        return out

    def _attention(self) -> ContextParallelAttention:
        attention = cast(Block, self.model.layers[0]).attention.attention_fn
        if not isinstance(attention, ContextParallelAttention):
            raise TypeError(f"cached decoding runs a CP layout's attention, not {attention!r}")
        return attention

    def _agree(self, running: bool) -> bool:
        """Whether any replica's batch still runs: under ZeRO-3 every rank takes part in every
        forward (its parameters gathered over the world), so the replicas stop together."""
        if not self.lockstep:
            return running
        flag = torch.tensor([int(running)], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.mesh.dp_group)
        return bool(flag.item())


def _token_losses(logits_SV: torch.Tensor, labels_S: torch.Tensor) -> torch.Tensor:
    """Per-position cross-entropy (0 where ignored), in fp32 one chunk at a time."""
    pieces = [
        F.cross_entropy(logits_SV[i : i + CHUNK].float(), labels_S[i : i + CHUNK], ignore_index=IGNORE_INDEX, reduction="none")
        for i in range(0, logits_SV.shape[0], CHUNK)
    ]
    return torch.cat(pieces) if pieces else logits_SV.new_zeros(0)


@lru_cache(maxsize=8)
def _positions(seq_len: int, ring: int, ulysses: int, ring_idx: int, ulysses_idx: int) -> np.ndarray:
    return np.asarray(sequence_positions(seq_len, ring, ulysses, ring_idx, ulysses_idx), dtype=np.int64)


def _bucket_indices(positions: np.ndarray, first: int) -> np.ndarray:
    return np.fromiter((bucket_index(int(p), first) for p in positions), dtype=np.int64, count=positions.size)
