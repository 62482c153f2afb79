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
from typing import Optional

import numpy as np
import torch

from ringtrain.evaluation.stops import Decode, StopRule
from ringtrain.topology import CPLayout, sequence_positions
from ringtrain.train.attention.cached import CachedAttention, LayerAttention
from ringtrain.train.attention.implementations import ContextParallelAttention
from ringtrain.train.attention.kv_cache import KVCache, new_token_share
from ringtrain.train.attention.transport import Transport
from ringtrain.train.model import Transformer
from ringtrain.evaluation.generation import GREEDY, Sampling
from ringtrain.train.sampling import next_tokens

Tensor = torch.Tensor
PAD_DOC = -1  # padding's document id: it attends nothing and nothing attends it
# Whether any row of any replica still runs, given whether one of this replica's does.
Agree = Callable[[bool], bool]


def padded_length(longest: int, layout: CPLayout) -> int:
    """Slots a batch whose longest prompt has ``longest`` tokens takes under ``layout``: a
    multiple of twice the CP degree (two zigzag chunks a ring rank, split over its Ulysses
    group); pure."""
    unit = 2 * layout.cp
    return -(-longest // unit) * unit


def _own(x: bool) -> bool:
    return x


@contextlib.contextmanager
def attention_of(model: Transformer, layer_attention: Callable[[int], LayerAttention]) -> Iterator[None]:
    """Every layer of ``model`` runs ``layer_attention(i)`` inside the block, its own after."""
    saved = [layer.attention.attention_fn for layer in model.layers]
    try:
        for i, layer in enumerate(model.layers):
            layer.attention.attention_fn = layer_attention(i)
        yield
    finally:
        for layer, fn in zip(model.layers, saved):
            layer.attention.attention_fn = fn


class Decoder:
    """One rank's cached decoding with ``model`` (in eval mode, without gradients, as the caller
    sets it) whose layers run ``attention``, this rank's attention of the job's layout."""

    def __init__(self, model: Transformer, attention: ContextParallelAttention, device: torch.device,
                 agree: Agree = _own) -> None:
        self.model = model
        self.device = device
        self.agree = agree
        self.layout = attention.layout
        args = model.args
        self.cached = CachedAttention(attention, args.n_heads, args.n_kv_heads)
        self.windows = [args.window(i) for i in range(args.n_layers)]
        self.ring: Optional[Transport] = self.cached.ring
        self.ulysses: Optional[Transport] = self.cached.ulysses
        self.last_cache: Optional[KVCache] = None  # the latest batch's, for its size
        self.step_times: list[float] = []  # the latest batch's decode steps, seconds each (a bench reads them)

    def generate(self, prompts: Sequence[Sequence[int]], max_new: int, *, sampling: Sampling = GREEDY,
                 stop: StopRule = StopRule(), decode: Optional[Decode] = None, seed: int = 0) -> list[list[int]]:
        """The new tokens of each prompt of one batch (at most ``max_new``, each row cut after
        its stop). ``seed`` draws a sampled batch's tokens (the caller's: every rank passes the
        same)."""
        if max_new < 1 or not prompts:
            return [[] for _ in prompts]
        layout, cached = self.layout, self.cached
        B = len(prompts)
        lengths = [len(p) for p in prompts]
        S = padded_length(max(lengths), layout)
        first_real = torch.tensor([S - n for n in lengths], dtype=torch.long)
        ids_BS = np.zeros((B, S), dtype=np.int64)
        for b, p in enumerate(prompts):
            ids_BS[b, S - len(p):] = p
        mine = np.asarray(sequence_positions(S, layout.ring, layout.ulysses, cached.ring_idx, cached.ulysses_idx))
        held = torch.as_tensor(sequence_positions(S, layout.ring, 1, cached.ring_idx, 0), dtype=torch.long)
        slots_Bs = torch.as_tensor(mine, dtype=torch.long)[None, :].expand(B, -1)
        positions_Bs = (slots_Bs - first_real[:, None]).clamp(min=0)
        docs_Bs = None
        if min(lengths) < S:
            docs_Bs = torch.where(slots_Bs >= first_real[:, None], 0, PAD_DOC).to(self.device)
        cache = KVCache.for_windows(self.windows)
        cached.start(cache, held, S, first_real, new_token_share(max_new - 1, layout.ring, cached.ring_idx))
        self.last_cache = cache
        generator = None if sampling.greedy else torch.Generator().manual_seed(sampling.seed * 1_000_003 + seed)

        with attention_of(self.model, cached.prefill):
            h_BsE = self.model.hidden(torch.as_tensor(ids_BS[:, mine], device=self.device),
                                      positions_Bs.to(self.device), docs_Bs)
        # Every rank projects its last slot (ZeRO-3 gathers the head's weight on every rank); the
        # one holding slot S - 1 speaks for the group.
        logits_BV = self.model.output(h_BsE[:, -1:])[:, 0]
        holder = int(mine[-1]) == S - 1
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

    def _first_of_group(self) -> bool:
        return self.cached.ring_idx == 0 and self.cached.ulysses_idx == 0

    def _share(self, token_B: Tensor, mine: bool) -> Tensor:
        """The tokens of the one rank of the CP group for which ``mine`` is true, on every rank."""
        marked = torch.where(torch.tensor(mine), token_B.cpu(), torch.full_like(token_B.cpu(), -1))
        for group in (self.ring, self.ulysses):
            if group is not None:
                marked = group.all_gather(marked.to(self.device)).max(dim=0).values.cpu()
        return marked
