"""Cached decoding on one rank of a CP group: a batch of prompts prefilled by the layout's own
attention, then one forward of one token a row per new token, each attending the KV cache that
the group's ranks hold in shards (``attention.cached``, ``attention.kv_cache``).

The batch is left-padded to ``S`` slots, a multiple of twice the CP degree (so it shards as
training's sequences do): every prompt ends at slot ``S - 1``, padding is a document of its own
that sees nothing and is seen by none (a negative document id), and each row's positions count
from its first real token, so a row's tokens rotate as they would alone. The first new token is
the prefill's prediction at slot ``S - 1``, taken on the rank that holds that slot and handed to
the group's other ranks; every later one comes from a step in which every rank computes the new
token's hidden state (its attention merged across the group), so every rank draws the same token
and CP rank 0's is handed round all the same.

A row is done at its stop (``evaluation.stops.StopRule``); the batch stops once every row is done,
and ``agree`` (across the replicas, where ZeRO-3's parameter gathers need every rank in every
forward) says whether any row anywhere still runs.

Shape legend: B batch, S slots (padded prompt length), s this rank's slots, V vocab, E model dim.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Optional, cast

import numpy as np
import torch

from ringtrain.evaluation.generation import GREEDY, Sampling
from ringtrain.evaluation.stops import Decode, StopRule
from ringtrain.topology import sequence_positions
from ringtrain.train.attention.cached import CachedAttention, LayerAttention
from ringtrain.train.attention.implementations import ContextParallelAttention
from ringtrain.train.attention.kv_cache import KVCache, new_token_share
from ringtrain.train.attention.transport import Transport
from ringtrain.train.model import Block, Transformer
from ringtrain.train.sampling import next_tokens

Tensor = torch.Tensor
PAD_DOC = -1  # padding's document id: it attends nothing and nothing attends it
# Whether any row of any replica still runs, given whether one of this replica's does.
Agree = Callable[[bool], bool]


def _own(x: bool) -> bool:
    return x


@dataclass(frozen=True)
class PaddedBatch:
    """A batch left-padded to ``seq_len`` slots, as one rank holds it: its ``slots`` (in its
    order) and each row's ids, positions and documents there; row b starts at ``first_real[b]``."""

    seq_len: int
    lengths: list[int]
    first_real: Tensor  # [B]
    slots: np.ndarray  # [s]
    ids_Bs: Tensor
    positions_Bs: Tensor
    docs_Bs: Optional[Tensor]  # None: no row is padded

    def inputs(self, device: torch.device) -> tuple[Tensor, Tensor, Optional[Tensor]]:
        """The model's arguments: ids, positions, documents."""
        docs = None if self.docs_Bs is None else self.docs_Bs.to(device)
        return self.ids_Bs.to(device), self.positions_Bs.to(device), docs


@contextlib.contextmanager
def attention_of(model: Transformer, layer_attention: Callable[[int], LayerAttention]) -> Iterator[None]:
    """Every layer of ``model`` runs ``layer_attention(i)`` inside the block, its own after."""
    attentions = [cast(Block, layer).attention for layer in model.layers]
    saved = [attention.attention_fn for attention in attentions]
    try:
        for i, attention in enumerate(attentions):
            attention.attention_fn = layer_attention(i)
        yield
    finally:
        for attention, fn in zip(attentions, saved):
            attention.attention_fn = fn


class Decoder:
    """One rank's cached decoding with ``model`` (in eval mode, without gradients, as the caller
    sets it) whose layers run ``attention``, this rank's attention of the job's layout."""

    def __init__(self, model: Transformer, attention: ContextParallelAttention, device: torch.device,
                 agree: Agree = _own) -> None:
        self.model = model
        self.device = device
        self.agree = agree
        args = model.args
        # The layout, and the groups it crosses, are the cached attention's: read from it.
        self.cached = CachedAttention(attention, args.n_heads, args.n_kv_heads)
        self.windows = [args.window(i) for i in range(args.n_layers)]
        self.last_cache: Optional[KVCache] = None  # the latest batch's, for its size
        self.step_times: list[float] = []  # the latest batch's decode steps, seconds each (a bench reads them)

    def generate(self, prompts: Sequence[Sequence[int]], max_new: int, *, sampling: Sampling = GREEDY,
                 stop: StopRule = StopRule(), decode: Optional[Decode] = None, seed: int = 0) -> list[list[int]]:
        """The new tokens of each prompt of one batch (at most ``max_new``, each row cut after
        its stop). ``seed`` draws a sampled batch's tokens (the caller's: every rank passes the
        same)."""
        if max_new < 1 or not prompts:
            return [[] for _ in prompts]
        cached = self.cached
        layout = cached.layout
        batch = self._padded(prompts)
        B, S, lengths = len(prompts), batch.seq_len, batch.lengths
        cache = KVCache.for_windows(self.windows)
        held = torch.as_tensor(sequence_positions(S, layout.ring, 1, cached.ring_idx, 0), dtype=torch.long)
        cached.start(cache, held, S, batch.first_real, new_token_share(max_new - 1, layout.ring, cached.ring_idx))
        self.last_cache = cache
        generator = None if sampling.greedy else torch.Generator().manual_seed(sampling.seed * 1_000_003 + seed)

        with attention_of(self.model, cached.prefill):
            h_BsE = self.model.hidden(*batch.inputs(self.device))
        # Every rank projects its last slot (ZeRO-3 gathers the head's weight on every rank); the
        # one holding slot S - 1 speaks for the group.
        logits_BV = self.model.output(h_BsE[:, -1:])[:, 0]
        holder = int(batch.slots[-1]) == S - 1
        token_B = self._share(next_tokens(logits_BV, sampling, generator), holder)
        new: list[list[int]] = [[] for _ in range(B)]
        done = [False] * B
        self.step_times = []
        for t in range(max_new):
            for b in range(B):
                if not done[b]:
                    new[b].append(int(token_B[b]))
                    done[b] = stop.stopped(new[b], decode)
            if t == max_new - 1 or not self.agree(not all(done)):
                break
            started = time.perf_counter()
            cached.step(t, S + t)
            with attention_of(self.model, cached.decode):
                logits_BV = self.model(token_B.view(B, 1).to(self.device),
                                       (torch.tensor(lengths) + t).view(B, 1).to(self.device))[:, 0]
            # Sharing the tokens brings them to the host: the step's work is done when it returns.
            token_B = self._share(next_tokens(logits_BV, sampling, generator), self._first_of_group())
            self.step_times.append(time.perf_counter() - started)
        return new

    def score(self, sequences: Sequence[Sequence[int]], scored: Sequence[int]) -> list[tuple[float, bool]]:
        """Each sequence's last ``scored[b]`` tokens' log-probabilities given what precedes them,
        summed, and whether each was the greedy choice: ``(sum, all greedy)`` a row, the same on
        every rank. One forward of the layout's attention (no cache); each rank projects and
        scores only the slots it holds that predict a scored token, and the group adds them up."""
        inputs = [list(s[:-1]) for s in sequences]
        batch = self._padded(inputs)
        S = batch.seq_len
        h_BsE = self.model.hidden(*batch.inputs(self.device))
        # Slot p predicts slot p + 1's token: row b's scored tokens sit at its last scored[b]
        # slots of the whole sequence, so their predictions at slots S - scored[b] .. S - 1.
        slots = torch.as_tensor(batch.slots, dtype=torch.long)
        first = torch.tensor([S - n for n in scored], dtype=torch.long)
        picked_Bs = slots[None, :] >= first[:, None]
        rows, cols = picked_Bs.nonzero(as_tuple=True)
        targets = torch.tensor([sequences[b][-1 - (S - 1 - int(slots[c]))] for b, c in zip(rows.tolist(), cols.tolist())],
                               dtype=torch.long)
        # Every rank projects (ZeRO-3 gathers the head's weight on every rank), its picked slots alone.
        logits_NV = self.model.output(h_BsE[rows.to(self.device), cols.to(self.device)]).float()
        logprobs_NV = torch.log_softmax(logits_NV, dim=-1)
        gained = logprobs_NV.gather(1, targets.to(self.device)[:, None])[:, 0].double().cpu()
        missed = (logits_NV.argmax(dim=-1).cpu() != targets).double()
        B = len(sequences)
        totals = torch.zeros(B, dtype=torch.float64).index_add_(0, rows, gained)
        misses = torch.zeros(B, dtype=torch.float64).index_add_(0, rows, missed)
        for group in self._crossed():
            both = group.all_gather(torch.stack([totals, misses]).to(self.device)).cpu()
            totals, misses = both[:, 0].sum(dim=0), both[:, 1].sum(dim=0)
        return [(float(t), bool(m == 0)) for t, m in zip(totals.tolist(), misses.tolist())]

    def _padded(self, prompts: Sequence[Sequence[int]]) -> PaddedBatch:
        """``prompts`` left-padded to a length the layout shards, as this rank holds them."""
        cached = self.cached
        layout = cached.layout
        lengths = [len(p) for p in prompts]
        S = layout.padded_length(max(lengths))
        first_real = torch.tensor([S - n for n in lengths], dtype=torch.long)
        ids_BS = np.zeros((len(prompts), S), dtype=np.int64)
        for b, p in enumerate(prompts):
            ids_BS[b, S - len(p):] = p
        mine = np.asarray(sequence_positions(S, layout.ring, layout.ulysses, cached.ring_idx, cached.ulysses_idx))
        slots_Bs = torch.as_tensor(mine, dtype=torch.long)[None, :].expand(len(prompts), -1)
        positions_Bs = (slots_Bs - first_real[:, None]).clamp(min=0)
        docs_Bs = None
        if min(lengths) < S:
            docs_Bs = torch.where(slots_Bs >= first_real[:, None], 0, PAD_DOC)
        return PaddedBatch(S, lengths, first_real, mine, torch.as_tensor(ids_BS[:, mine]), positions_Bs, docs_Bs)

    def _first_of_group(self) -> bool:
        return self.cached.ring_idx == 0 and self.cached.ulysses_idx == 0

    def _crossed(self) -> list[Transport]:
        """The groups the layout crosses (a group of one rank has nothing to gather)."""
        return [group for group in (self.cached.ring, self.cached.ulysses) if group is not None]

    def _share(self, token_B: Tensor, mine: bool) -> Tensor:
        """The tokens of the one rank of the CP group for which ``mine`` is true, on every rank."""
        marked = torch.where(torch.tensor(mine), token_B.cpu(), torch.full_like(token_B.cpu(), -1))
        for group in self._crossed():
            marked = group.all_gather(marked.to(self.device)).max(dim=0).values.cpu()
        return marked
