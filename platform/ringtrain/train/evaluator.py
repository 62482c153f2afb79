"""Evaluator: one rank's share of an evaluation, under any dp x cp mesh, without gradients.

Every rank of a replica runs the same forwards over the replica's rows (the CP attention needs
all of them); each scores the positions it holds (``topology.sequence_positions``) and tallies
their losses by position bucket. Tallies simply add up across ranks, so nothing is reduced here:
the caller sums what every rank returns. Passkey generation is greedy and keeps no cache: each
new token re-runs the forward over prompt + tokens so far; the rank holding the last position
takes the argmax and an all-reduce over the CP group hands it to the replica's other ranks.

Shape legend: B batch (1 here), S this rank's tokens of the sequence, V vocab.
"""

from __future__ import annotations

import contextlib
from functools import lru_cache
from typing import TYPE_CHECKING, Callable, Iterator, Optional

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from ringtrain.evaluation.buckets import bucket_index
from ringtrain.evaluation.tally import LossTally
from ringtrain.topology import Topology, sequence_positions
from ringtrain.train.data import IGNORE_INDEX
from ringtrain.train.evalset import PAD_ID, EvalSet
from ringtrain.train.mesh import Mesh

if TYPE_CHECKING:
    from ringtrain.train.trainer import Trainer

# (input_ids_BS, position_ids_BS) -> logits_BSV: the model's forward, or a stand-in in tests.
Forward = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
# Positions per cross-entropy chunk: bounds the fp32 copy of the logits at long context.
CHUNK = 8192


class Evaluator:
    def __init__(self, model: torch.nn.Module, mesh: Mesh, device: torch.device, forward: Optional[Forward] = None) -> None:
        self.model = model
        self.mesh = mesh
        self.device = device
        self.forward: Forward = forward or model

    @classmethod
    def of(cls, trainer: "Trainer") -> "Evaluator":
        return cls(trainer.model, trainer.mesh, trainer.device)

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
        padded = evalset.padded(multiple=2 * t.cp, rows_multiple=t.dp)
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

    def generate(self, prompts: list[list[int]], num_new: int) -> list[list[int]]:
        """Greedy continuations of this replica's share of ``prompts`` (the list is padded to a
        multiple of dp with copies of its last prompt, so every replica runs as many forwards)."""
        t = self.topology
        if not prompts:
            return []
        padded = prompts + [prompts[-1]] * (-len(prompts) % t.dp)
        share = len(padded) // t.dp
        mine = padded[self.mesh.coord.replica * share : (self.mesh.coord.replica + 1) * share]
        with self._eval_mode():
            return [self._continue(list(p), num_new) for p in mine]

    def _continue(self, ids: list[int], num_new: int) -> list[int]:
        new: list[int] = []
        for _ in range(num_new):
            length = len(ids)
            seq_len = -(-length // (2 * self.topology.cp)) * 2 * self.topology.cp
            positions = self._positions(seq_len)
            full = np.full(seq_len, PAD_ID, dtype=np.int64)
            full[:length] = ids
            logits_BSV = self._logits(full[positions], positions)
            held = np.nonzero(positions == length - 1)[0]
            token = torch.full((1,), -1, dtype=torch.long, device=self.device)
            if held.size:
                token[0] = logits_BSV[0, int(held[0])].argmax()
            # Only the holder's entry is >= 0: the max hands its token to the whole replica.
            dist.all_reduce(token, op=dist.ReduceOp.MAX, group=self.mesh.cp_group)
            ids.append(int(token.item()))
            new.append(ids[-1])
        return new


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
