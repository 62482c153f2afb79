"""The reference model's completion log-probs (DPO, IPO): one pass over the preference dataset on
the job's own mesh, with the starting weights or another model's put in their place for it.

The table is ``[pairs, 2]`` fp64: each dataset pair's (chosen, rejected) summed log-probs of its
trained tokens, indexed by the pair's place in the dataset (a pair the rows dropped keeps zeros;
no step reads it). A Trainer takes it as a ``Reference``: the table itself, when the run has
one already (the driver keeps it in the checkpoint store, ``actors/reference_keeper.py``: resume,
elastic resizing and a new world after a failure all take the first world's table, never a
recomputed one whose rounding would differ at another mesh), or the weights to compute it with
(None: the starting weights; ``train/reference_input.py``).

No second model is held: another model's weights are loaded into the policy's ZeRO state for
the pass, and the starting weights put back before step 1 (a Hugging Face ``model.hf`` is read
again, a model trained from scratch restored from every rank's fragments, taken just before).

``pair_logps`` is the pass itself, over any rows of pairs: training's dataset, or the rows
``ringtrain eval`` sends (``train/pairset.py``). Each replica takes every dp-th row (a replica
past the last row repeats it, uncounted, so every rank runs as many forwards: ZeRO-3 gathers
parameters over the world in each); each CP rank sums its tokens into their pairs
(``pair_loss.completion_sums``); ring position 0 of each replica adds its rows' totals in, and
one all-reduce gives every rank the whole table.
"""

from __future__ import annotations

from typing import Callable, Optional, Protocol

import numpy as np
import torch
import torch.distributed as dist

from ringtrain.checkpoint.wire import FragmentIndex, decode, encode
from ringtrain.config import JobConfig
from ringtrain.train import pair_loss
from ringtrain.train.data import BatchPlan, MicroBatch, SampleSource, ShardedData
from ringtrain.train.mesh import Mesh
from ringtrain.train.reference_input import REFERENCE_KEY, Reference, ReferenceWeights
from ringtrain.train.zero_state import ZeroState


class TrainerView(Protocol):
    """What the pass needs of a rank's ``train.trainer.Trainer``."""

    job: JobConfig
    mesh: Mesh
    device: torch.device
    model: torch.nn.Module
    zero: ZeroState
    data: ShardedData

    def token_losses(self, mb: MicroBatch) -> torch.Tensor: ...
    def load_pretrained(self, folder: str, key: str = ...) -> None: ...


def pair_logps(trainer: TrainerView, data: ShardedData) -> tuple[np.ndarray, np.ndarray]:
    """Every pair's (chosen, rejected) completion log-prob sums under the trainer's current
    weights, and their trained-token counts: ``[pairs, 2]`` fp64 each, in eval mode, without
    gradients. Collective over the world."""
    rows = data.preference_rows()
    mesh = trainer.mesh
    topology, coord = mesh.topology, mesh.coord
    table = torch.zeros((data.num_pairs(), 4), dtype=torch.float64, device=trainer.device)
    training = trainer.model.training
    trainer.model.eval()
    try:
        with torch.no_grad():
            for first in range(0, rows, topology.dp):
                row = min(first + coord.replica, rows - 1)  # past the end: a repeat, not counted
                mb = data.row_batch(row)
                sums, counts = pair_loss.completion_sums(-trainer.token_losses(mb), mb, mesh.cp_group, trainer.device)
                if first + coord.replica < rows and coord.ring_pos == 0:
                    table[list(mb.pairs)] += torch.cat([sums.view(-1, 2), counts.view(-1, 2)], dim=1)
    finally:
        trainer.model.train(training)
    dist.all_reduce(table)
    out = table.cpu().numpy()
    return np.ascontiguousarray(out[:, :2]), np.ascontiguousarray(out[:, 2:])


def reference_table(trainer: TrainerView, given: Optional[Reference]) -> np.ndarray:
    """The table the trainer's objective scores against: the one given, else computed (with the
    given weights in the starting weights' place for the pass). Collective when computed."""
    num_pairs = trainer.data.num_pairs()
    if given is not None and given.table is not None:
        if given.table.shape != (num_pairs, 2):
            raise ValueError(f"the reference table holds {given.table.shape}, the dataset {num_pairs} pairs")
        return np.asarray(given.table, dtype=np.float64)
    weights = given.weights if given is not None else None
    if weights is None:
        return pair_logps(trainer, trainer.data)[0]
    put_back = _starting_weights(trainer)
    load_weights(trainer, weights)
    try:
        return pair_logps(trainer, trainer.data)[0]
    finally:
        put_back()


def load_weights(trainer: TrainerView, weights: ReferenceWeights) -> None:
    """Put ``weights`` into the trainer's ZeRO state (each rank reading the fragments it keeps)."""
    if weights.folder:
        trainer.load_pretrained(weights.folder, key=REFERENCE_KEY)
    else:
        trainer.zero.load(FragmentIndex([decode(blob) for blob in weights.shards]))


def _starting_weights(trainer: TrainerView) -> Callable[[], None]:
    """How to put the trainer's current (starting) weights back after another model's pass:
    ``model.hf`` read again, or, for a model trained from scratch, every rank's fragments of
    them (host copies for the length of the pass; collective)."""
    folder = trainer.job.model.hf
    if folder:
        return lambda: trainer.load_pretrained(folder)
    zero = trainer.zero
    zero.ensure_optimizer_state()
    mine = encode(0, zero.rank, zero.world_size, {},
                  [(f, {k: v.detach().cpu().numpy() for k, v in f.tensors.items()}) for f in zero.fragments()])  # fmt: skip
    blobs: list[Optional[bytes]] = [None] * zero.world_size
    dist.all_gather_object(blobs, mine)
    index = FragmentIndex([decode(b) for b in blobs if b is not None])
    return lambda: zero.load(index)


def pairs_data(trainer: TrainerView, source: SampleSource, seq_len: int) -> ShardedData:
    """This rank's view of ``source``'s rows of pairs (``ringtrain eval``'s), on the trainer's mesh."""
    topology, coord = trainer.mesh.topology, trainer.mesh.coord
    return ShardedData(source, seq_len=seq_len, seed=0, plan=BatchPlan(topology.dp, topology.dp, 1), ring=topology.ring,
                       ulysses=topology.ulysses, ring_idx=coord.ring_idx, ulysses_idx=coord.ulysses_idx,
                       vocab_size=trainer.data.vocab_size)  # fmt: skip
