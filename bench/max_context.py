"""Benchmark: the longest sequence one device trains, ringtrain against Hugging Face transformers,
and the planner's prediction of it held against the measurement.

For each model shape, two systems:

- ringtrain: the ``Trainer`` of one rank in a world of one, with the layout ``ringtrain plan``
  puts first at the try's length (ZeRO stage and offload, and the savers: chunked loss, MLP tiles,
  activation offload; ``ringtrain.planner.reach.pick``), ``model.activation_checkpointing=auto``
  (the planner's mode, explicit, where a ``--memory-gb`` cap stands in for the device's memory,
  which ``auto`` would read), snapshots off, the stdlib corpus as data.
- hf: transformers' own ``LlamaForCausalLM`` / ``Qwen3ForCausalLM`` of the same config,
  ``attn_implementation="sdpa"``, gradient checkpointing of every layer,
  ``model(input_ids=..., labels=...).loss``, bf16 weights with fp32 AdamW masters (the recipe of
  bench/train.py's hf variant).

Each try is one length in a process of its own (``ringtrain_dev.try_process``; on CUDA a spawned
one: a fresh CUDA context and allocator): ``--steps`` optimizer steps (forward, backward, step; the
second catches allocator growth), with a timeout. An out-of-memory is a result: the try is
recorded as ``oom`` with the limit that stopped it (``device``: torch's OutOfMemoryError;
``host``: a host allocation failed, or the kernel killed the process), and the search goes on.
Any other failure (an exception that is not out of memory, a process that died before
reporting) is an ``error``: it says nothing of whether the length fits, so it ends the search
there, no max is claimed from it, and the bench exits 1 after writing its JSON. A try past its
timeout (not the budget's) counts as not fitting: near the cap the allocator's retries slow the
steps down before they fail.
Each try records its length, outcome, peak device memory (``torch.cuda.max_memory_allocated``
and ``max_memory_reserved``; on a CPU the peak of torch-allocated bytes, counted by
``ringtrain_dev.live_bytes`` as bench/planner_memory.py counts them), the process's peak RSS,
the planner's predicted peak for the layout it ran, and its step times.

The search (``next_length``): start from the planner's predicted maximum (``ringtrain plan
--max-seq-len`` for one device: ``reach.longest``; for hf, the planner's reach of full
checkpointing without savers, a starting point only), grow by ``--growth`` (at least one
``--granule``) while it fits, shrink by it while it does not, then bisect to the granule; at most
``--max-tries`` tries. Lengths are multiples of the granule.

``--tolerance-edges`` puts each search's second try at the prediction target's edge instead: past
the start / 0.9 after a fit, at the start / 1.1 after a failure, so that two tries decide whether
the planner's max is within 10% of the measured one (below).

A try is not run, and its search ends saying why, where the host memory does not allow it (its
layout offloads more than the host's memory, or ``--host-memory-gb``: it could take the node's
memory from under its other processes), or where at one granule the planner's smallest layout
needs more than the device memory by over the 10% tolerance (nothing fits; a try would only
spend a process start to say so).

Time: the whole bench stays within ``--budget-s`` of device time (default 600 s on a GPU), the
GPU's probe included. Each (shape, system) search, as it starts, gets a share of what is left in
proportion to its predicted cost among the searches still to run (``share_of``; a search refused
at its first try takes none): ``--max-tries`` tries at its first length (and ringtrain's
``--peaks-at`` tries), each the planner's step estimate x steps plus a process start, so a cheap
search holds no share an expensive one needs; what a search leaves unused goes to the ones after
it. A try whose predicted time (the planner's step estimate x steps, plus the process start its
system's last try took, in any shape) exceeds what its share has left is not run, and the search
ends there, saying so. Each try's timeout is ``--try-timeout`` or what the share has left, the
smaller. Attention's work grows with the square of the length: near a million tokens one step of
a 1B model takes the planner's estimate of 13-15 minutes on an H100, so ringtrain's search there
needs a budget in hours (``--budget-s``), where the default one measures the hf searches and any
``--peaks-at`` tries.

Llama-3.1-8B (``--shapes llama3-8b``) is there for nodes whose host memory holds its offloaded
optimizer state: each shape's header says which limit (device or host memory) stops the planner
past its maximum, and each failed try which one stopped it.

Targets, each printed PASS or MISS (``--tiny`` runs are smoke runs, not held to them):

    ringtrain max / hf max                            >= 8, per shape
    ringtrain max, Llama-3.2-1B on a whole H100       >= 1,048,576 tokens (no --memory-gb
                                                         or --host-memory-gb: else not held)
    planner's predicted max vs ringtrain's measured   within 10%, per shape
    predicted vs measured peak of ringtrain's tries   within 10% at >= 3 lengths, per shape

The measured max is known as far as the tries bracket it: the longest length that fitted up to
the shortest that failed above it. The prediction's verdict holds for every max the bracket leaves
possible (PASS where all are within 10% of the planner's, MISS where none is); a bracket wider
than that decides nothing and is reported as not measured, with the error range it leaves. Each
system's summary line prints the planner's number beside its measured max (for hf, the planner's
reach of transformers' recipe).

The planner is asked about the device as torch reports it (its memory, or ``--memory-gb``) and
the host's memory (or ``--host-memory-gb``; 0 plans no offload) less the same headroom
(``ringtrain.planner.reach.device_seen``); its default 10% headroom applies (``--headroom``). The
JSON also holds its prediction with no headroom (where the predicted peak is the whole device),
which separates the memory model's error from the headroom's. On CUDA each try holds itself to
``--memory-gb`` with ``torch.cuda.set_per_process_memory_fraction`` before it allocates anything:
the caching allocator then refuses to reserve past the cap and the step raises torch's
out-of-memory error, as on a device of that size; a try whose reserved peak still ends past the
cap is recorded as out of memory, ``over_cap``.

    PYTHONPATH=platform python bench/max_context.py [--shapes llama3.2-1b,qwen3-1.7b[,llama3-8b]]
        [--systems hf,ringtrain] [--steps 2] [--granule 1024] [--growth 1.25] [--max-tries 6]
        [--tolerance-edges] [--budget-s 600] [--try-timeout 900] [--memory-gb G]
        [--host-memory-gb G] [--headroom 0.1] [--peaks-at 65536,131072] [--check] [--out PATH]

The GPU tier (bench/gpu_check.py) runs it in under two minutes: Llama-3.2-1B and Llama-3.1-8B
under a 26 GB cap with no host memory to offload to and no headroom, two tries a search at the
tolerance's edges (its part's comment has the arithmetic). A 1B model's states then leave a few
GB to activations: some 4,000 tokens for transformers and 40,000 for ringtrain, steps under 3 s,
and the planner's memory model alone decides where each ends. An 8B model's states alone exceed
the cap (and, offloaded, a 128 GiB host), so its searches end at their first try's refusal; its
own search needs a node whose host memory holds its offloaded optimizer state, and hours.

``--peaks-at`` adds ringtrain tries at fixed lengths before its search (the planner's layout at
each), for the predicted-peak target where the search's own tries are too long for the budget.

``--device cpu --tiny`` runs the same search on tiny shapes of both families (dim 64, 2 layers,
vocabulary 512) under a memory cap standing in for the GPU's (``--memory-gb``, default 0.016):
the planner plans for the cap, and a try whose peak of torch-allocated bytes exceeds it is an
``oom``. On a CPU host and device memory are one, so the planner is given no host memory to
offload to. Needs CUDA unless ``--device cpu``: without it, it exits 2 with a message.

Writes bench/results/max_context-<device>.json (``-tiny`` added for tiny shapes; or ``--out``)
through ``ringtrain_dev.record``'s Run: commit, device, every try of every search, the targets.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import math
import os
import resource
import signal
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional, Sequence

import torch

from ringtrain_dev.bench_cli import bad_input, listed, one_device_parser, slug, without_cuda
from ringtrain_dev.one_device import MasterWeightAdamW, Shape, device_of, hf_model, hf_step, join_world_of_one, model_overrides
from ringtrain_dev.record import RESULTS_DIR, Run
from ringtrain_dev.targets import SMOKE, Target
from ringtrain_dev.try_process import interrupt_on_sigint, run_to_end

if TYPE_CHECKING:
    from ringtrain.config import JobConfig
    from ringtrain.planner.layout import Layout, Workload
    from ringtrain.planner.search import Candidate, Cluster, Reach
    from ringtrain.planner.throughput import Assumptions

RATIO_MIN = 8.0  # ringtrain's longest sequence over transformers'
LLAMA_1B_MIN_TOKENS = 2**20  # on an H100
PREDICTION_TOLERANCE = 0.10  # the planner's max, and its peak, against the measured ones
PEAK_LENGTHS_MIN = 3  # lengths at which the predicted peak must hold
ERROR_LINES = 20  # of a failed try's traceback, kept in the JSON
GB = 10**9

# Outcomes of a try, and the limits an out-of-memory names.
OK, OOM, ERROR, TIMEOUT = "ok", "oom", "error", "timeout"
DEVICE_LIMIT, HOST_LIMIT = "device", "host"

# Seconds a try spends outside its steps (process start, imports, build), until one of its system
# is seen. On CUDA, bench/train.py's variants of 1-2B models at 32K tokens on one H200 spent 15 s
# (transformers) and 23 s (the Trainer) outside their steps (bench/results/train-nvidia-h200.json).
START_GUESS_S = {"cuda": 25.0, "cpu": 5.0}


# ---- shapes -----------------------------------------------------------------------------------


def _llama3_rope(factor: float) -> dict[str, Any]:
    """Llama 3.1 / 3.2's rope_scaling (their config.json)."""
    return {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}


def _llama3_8b() -> dict[str, Any]:
    """Llama-3.1-8B: the planner's preset for its sizes, the release's config.json for the rest."""
    from ringtrain.planner.models import PRESETS

    spec = PRESETS["llama3-8b"]
    return {"vocab_size": spec.vocab_size, "dim": spec.dim, "n_layers": spec.n_layers, "n_heads": spec.n_heads,
            "n_kv_heads": spec.n_kv_heads, "head_dim": spec.head_dim, "ffn_dim": spec.ffn_dim,
            "rope_theta": 500000.0, "rope_scaling": _llama3_rope(8.0), "norm_eps": 1e-5, "tie_embeddings": False,
            "max_position_embeddings": 131072}


# Tiny stand-ins: head_dim x n_heads = dim, as in the real shapes (the planner assumes it).
_TINY_LLAMA = {"vocab_size": 512, "dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "head_dim": 16,
               "ffn_dim": 176}
_TINY_QWEN = {**_TINY_LLAMA, "ffn_dim": 192}

SHAPES: dict[str, Shape] = {
    # Llama-3.2-1B's config.json.
    "llama3.2-1b": Shape(
        title="Llama-3.2-1B",
        model={"vocab_size": 128256, "dim": 2048, "n_layers": 16, "n_heads": 32, "n_kv_heads": 8, "head_dim": 64,
               "ffn_dim": 8192, "rope_theta": 500000.0, "rope_scaling": _llama3_rope(32.0), "norm_eps": 1e-5,
               "tie_embeddings": True, "max_position_embeddings": 131072},
        tiny=_TINY_LLAMA,
        hf_model="LlamaForCausalLM",
        hf_config="LlamaConfig",
    ),
    # Qwen3-1.7B's config.json.
    "qwen3-1.7b": Shape(
        title="Qwen3-1.7B",
        model={"vocab_size": 151936, "dim": 2048, "n_layers": 28, "n_heads": 16, "n_kv_heads": 8, "head_dim": 128,
               "ffn_dim": 6144, "rope_theta": 1000000.0, "norm_eps": 1e-6, "qk_norm": True, "tie_embeddings": True,
               "max_position_embeddings": 40960},
        tiny=_TINY_QWEN,
        hf_model="Qwen3ForCausalLM",
        hf_config="Qwen3Config",
    ),
    "llama3-8b": Shape(
        title="Llama-3.1-8B",
        model=_llama3_8b(),
        tiny=_TINY_LLAMA,
        hf_model="LlamaForCausalLM",
        hf_config="LlamaConfig",
    ),
}
DEFAULT_SHAPES = ("llama3.2-1b", "qwen3-1.7b")
SYSTEMS = ("hf", "ringtrain")  # in the order they run: the cheap baseline first


# ---- the search: pure -------------------------------------------------------------------------


@dataclass(frozen=True)
class SearchPolicy:
    granule: int = 1024  # every length tried is a multiple of it
    growth: float = 1.25  # the factor lengths grow or shrink by before a failure / fit brackets the max
    max_tries: int = 6
    ceiling: Optional[int] = None  # no try longer than this
    # Where set, the second try is at this tolerance's edge of the start (a prediction): past
    # start / (1 - tolerance) after a fit, at start / (1 + tolerance) after a failure, so that two
    # tries bracket the maximum inside or outside the tolerance (``prediction_error``).
    edges: Optional[float] = None

    def floor(self, length: float) -> int:
        """``length`` down to a multiple of the granule, at least one granule."""
        return max(self.granule, int(length) // self.granule * self.granule)

    def edge(self, start: float, fit: bool) -> int:
        """The tolerance's edge of ``start`` on the side the first try left open: the shortest
        multiple of the granule above start / (1 - edges) after a fit, the shortest at or above
        start / (1 + edges) after a failure."""
        assert self.edges is not None
        g = self.granule
        if fit:
            return (int(start / (1 - self.edges)) // g + 1) * g
        return max(g, -(-math.ceil(start / (1 + self.edges)) // g) * g)


def bracket(tried: Sequence[tuple[int, bool]]) -> tuple[int, Optional[int]]:
    """(the longest length that fit, 0 if none; the shortest failure above it, None if none). A
    failure below a fit (a noisy or flaky try) does not narrow the bracket."""
    longest = max((n for n, fit in tried if fit), default=0)
    above = [n for n, fit in tried if not fit and n > longest]
    return longest, min(above, default=None)


def next_length(policy: SearchPolicy, start: int, tried: Sequence[tuple[int, bool]]) -> Optional[int]:
    """The next length to try after ``tried`` ((length, fit) in order), or None when done: grow
    while everything fits, shrink while nothing does, then bisect the bracket to the granule."""
    if len(tried) >= policy.max_tries:
        return None
    g = policy.granule
    ceiling = policy.floor(policy.ceiling) if policy.ceiling else None
    if not tried:
        first = policy.floor(start)
        return min(first, ceiling) if ceiling else first
    if policy.edges is not None and len(tried) == 1:
        (length, fit), = tried
        edge = policy.edge(start, fit)
        if ceiling is not None:
            edge = min(edge, ceiling)
        if (edge > length) if fit else (edge < length):
            return edge
    longest, failure = bracket(tried)
    if failure is None:
        grown = max(longest + g, policy.floor(longest * policy.growth))
        if ceiling is not None:
            grown = min(grown, ceiling)
        nxt: Optional[int] = grown if grown > longest else None
    elif longest == 0:
        nxt = min(failure - g, policy.floor(failure / policy.growth)) if failure > g else None
    elif failure - longest <= g:
        nxt = None
    else:
        nxt = longest + (failure - longest) // (2 * g) * g
    if nxt is not None and any(n == nxt for n, _ in tried):
        return None  # a length tried before (its answer was out of line with the others): stop
    return nxt


def stop_reason(policy: SearchPolicy, tried: Sequence[tuple[int, bool]]) -> str:
    """Why ``next_length`` has nothing more to try."""
    longest, failure = bracket(tried)
    if failure is not None and failure - longest <= policy.granule:
        return "converged" if longest else "nothing fits (not even one granule)"
    if len(tried) >= policy.max_tries:
        return "max tries"
    if failure is None and policy.ceiling and longest >= policy.floor(policy.ceiling):
        return "ceiling"
    return "a length tried before"


@dataclass
class SearchResult:
    tried: list[tuple[int, bool]] = field(default_factory=list)
    stopped: str = ""

    @property
    def longest(self) -> int:
        return bracket(self.tried)[0]

    @property
    def failure(self) -> Optional[int]:
        return bracket(self.tried)[1]


def prediction_error(predicted: int, longest: int, failure: Optional[int], granule: int,
                     tolerance: float) -> tuple[Optional[float], str]:
    """The planner's error on the longest sequence, |predicted / measured - 1|, as far as the tries
    decide it. The measured max is a multiple of the granule from ``longest`` (0: nothing fitted)
    up to the one below ``failure`` (without a failure, no end). Returns (the largest error over
    those, "") when all are within ``tolerance``, (the smallest, "") when none is, else (None,
    why): a bracket the tries left too wide decides nothing, where its lower end alone would."""
    high = None if failure is None else failure - granule

    def signed(measured: Optional[int]) -> float:
        if measured is None:  # no end: the error tends to -100%
            return -1.0
        if measured == 0:
            return 0.0 if predicted == 0 else math.inf
        return predicted / measured - 1

    at_longest, at_high = signed(longest), signed(high)  # the error falls as the measured max grows
    worst = max(abs(at_longest), abs(at_high))
    best = 0.0 if at_high <= 0 <= at_longest else min(abs(at_longest), abs(at_high))
    if worst <= tolerance:
        return worst, ""
    if best > tolerance:
        return best, ""
    upto = "with no failure above it" if high is None else f"and {high:,}"
    return None, (f"the tries leave the max between {longest:,} {upto}: an error from {at_high:+.1%} to "
                  f"{at_longest:+.1%}")


def search_longest(oracle: Callable[[int], Optional[bool]], start: int, policy: SearchPolicy) -> SearchResult:
    """Run ``next_length`` against ``oracle`` (length -> fits; None ends the search, e.g. out of
    time, and the oracle knows why)."""
    result = SearchResult()
    while (length := next_length(policy, start, result.tried)) is not None:
        fit = oracle(length)
        if fit is None:
            result.stopped = "stopped by the caller"
            return result
        result.tried.append((length, fit))
    result.stopped = stop_reason(policy, result.tried)
    return result


# ---- one try, in its own process --------------------------------------------------------------


@dataclass(frozen=True)
class Try:
    """One length of one system on one shape, as its process runs it."""

    shape: str
    system: str  # hf | ringtrain
    device: str  # cuda | cpu
    tiny: bool
    seq_len: int
    steps: int
    overrides: tuple[str, ...] = ()  # ringtrain's layout, as ``ringtrain run`` arguments
    memory_fraction: Optional[float] = None  # CUDA: the share of the device a --memory-gb cap leaves

    @property
    def model(self) -> dict[str, Any]:
        return SHAPES[self.shape].model_keys(self.tiny)


def job_overrides(t: Try) -> list[str]:
    """The job a try trains: its shape at its length, one sequence per step, one device, the layout."""
    return [
        *model_overrides(t.model),
        f"data.seq_len={t.seq_len}",
        "train.global_batch=1",
        "train.micro_batch=1",
        f"train.steps={max(100, t.steps)}",
        "mesh.dp=1",
        "mesh.cp=1",
        "checkpoint.snapshot_every=0",
        f"cluster.device={t.device}",
        *t.overrides,
    ]


def load_job(t: Try) -> JobConfig:
    from ringtrain import config

    return config.load(None, job_overrides(t))


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class PeakMeter:
    """Peak device memory of a try: the CUDA allocator's peaks, or on a CPU the peak of live
    torch-allocated bytes (``ringtrain_dev.live_bytes``), which counts what the planner
    predicts and not the interpreter or libraries. ``reset`` after the build: training is measured,
    with the model states the build left counted in."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.allocated = 0
        self.reserved = 0
        self._storage: Any = None
        if device.type != "cuda":
            from ringtrain_dev.live_bytes import LiveBytes

            self._storage = LiveBytes("cpu")

    def __enter__(self) -> PeakMeter:
        if self._storage is not None:
            self._storage.mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.sample()
        if self._storage is not None:
            self._storage.mode.__exit__(*exc)

    def reset(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self._storage.reset_peak()

    def sample(self) -> None:
        """Fold in the peak since the last reset (the Trainer resets CUDA's at each step's start)."""
        if self.device.type == "cuda":
            self.allocated = max(self.allocated, int(torch.cuda.max_memory_allocated(self.device)))
            self.reserved = max(self.reserved, int(torch.cuda.max_memory_reserved(self.device)))
        else:
            self.allocated = max(self.allocated, int(self._storage.peak))


def host_peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def timed(step: Callable[[], float], device: torch.device, meter: PeakMeter) -> tuple[float, float]:
    """(seconds, loss) of one step, from a synchronized device to a synchronized device."""
    synchronize(device)
    t0 = time.perf_counter()
    loss = step()
    synchronize(device)
    meter.sample()
    return time.perf_counter() - t0, loss


def run_ringtrain(t: Try, meter: PeakMeter) -> dict[str, Any]:
    """ringtrain's Trainer, one rank in a world of one."""
    device = meter.device
    join_world_of_one(device)
    from ringtrain.train.fused import liger_ops
    from ringtrain.train.trainer import Trainer

    cuda = device.type == "cuda"
    job = load_job(t)
    with meter:
        trainer = Trainer(job, rank=0, device=device)
        try:
            meter.reset()
            steps = [timed(lambda: float(trainer.train_step().loss), device, meter) for _ in range(t.steps)]
        finally:
            trainer.close()
    return {
        "step_s": [s for s, _ in steps],
        "losses": [loss for _, loss in steps],
        "checkpointing": trainer.model.savers.checkpointing,
        "fused_kernels": "liger" if trainer.model.fused.kernels and cuda and liger_ops() is not None else "eager",
    }


def run_hf(t: Try, meter: PeakMeter) -> dict[str, Any]:
    """transformers' model of the same shape, trained the way a user would train it."""
    from ringtrain.train.engine import resolve_dtype

    device = meter.device
    job = load_job(t)
    dtype = resolve_dtype(job, device)
    with meter:
        model = hf_model(SHAPES[t.shape], job, t.seq_len, device, dtype)
        optimizer = MasterWeightAdamW(model, job, fused=device.type == "cuda")
        gen = torch.Generator(device=device).manual_seed(0)
        input_ids = torch.randint(0, job.model_int("vocab_size"), (1, t.seq_len), device=device, generator=gen)
        meter.reset()
        steps = [timed(lambda: hf_step(model, optimizer, input_ids), device, meter) for _ in range(t.steps)]
    return {"step_s": [s for s, _ in steps], "losses": [loss for _, loss in steps], "checkpointing": "full",
            "fused_kernels": "eager"}


RUNNERS: dict[str, Callable[[Try, PeakMeter], dict[str, Any]]] = {"ringtrain": run_ringtrain, "hf": run_hf}


def _chain(exc: BaseException) -> list[BaseException]:
    out: list[BaseException] = []
    while exc is not None and exc not in out:
        out.append(exc)
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]
    return out


def classify(exc: BaseException) -> tuple[str, str]:
    """(outcome, limit) of a try that raised: torch's OutOfMemoryError anywhere in the chain is the
    device's, as is a library's failed allocation on it (cuBLAS's and cuDNN's ``*_ALLOC_FAILED``:
    a cudaMalloc of their own, outside torch's allocator); a failed host allocation (MemoryError,
    ENOMEM, pinned memory) the host's. Anything else is an error, which ends the search
    (``Searcher.oracle``): a crash says nothing of what fits."""
    chain = _chain(exc)
    if any(isinstance(e, torch.OutOfMemoryError) for e in chain):
        return OOM, DEVICE_LIMIT
    if any(isinstance(e, MemoryError) for e in chain):
        return OOM, HOST_LIMIT
    for e in chain:
        text = str(e).lower()
        if "cannot allocate memory" in text or ("out of memory" in text and ("pinned" in text or "host" in text)):
            return OOM, HOST_LIMIT
        if "out of memory" in text or "_alloc_failed" in text:
            return OOM, DEVICE_LIMIT
    return ERROR, ""


Runner = Callable[[Try, PeakMeter], dict[str, Any]]


def _try_main(t: Try, runner: Optional[Runner], results: Any) -> None:
    meter: Optional[PeakMeter] = None
    try:
        device = device_of(t.device)
        if t.memory_fraction is not None:
            torch.cuda.set_per_process_memory_fraction(t.memory_fraction, device)
        meter = PeakMeter(device)
        out = (runner or RUNNERS[t.system])(t, meter)
        out["outcome"] = OK
    except BaseException as exc:  # noqa: BLE001 - a failure is a result; the parent records it
        outcome, limit = classify(exc)
        lines = traceback.format_exc().rstrip().splitlines()
        out = {"outcome": outcome, "limit": limit, "error": "\n".join(lines[-ERROR_LINES:])}
    if meter is not None:
        out["peak_device_bytes"] = meter.allocated
        if meter.device.type == "cuda":
            out["peak_reserved_bytes"] = meter.reserved
            out["device_name"] = torch.cuda.get_device_name(meter.device)
    out["host_peak_rss_bytes"] = host_peak_rss()
    results.put(out)


def run_try(t: Try, timeout_s: float, runner: Optional[Runner] = None) -> dict[str, Any]:
    """``t`` in a process of its own (``ringtrain_dev.try_process``): its result, whatever happened
    to it. The process is gone when this returns (killed if it outlives its timeout, or its grace
    after reporting)."""
    ended = run_to_end(t.device, _try_main, t, runner, timeout_s=timeout_s, poll_s=0.5)
    if ended.result is not None:
        out = dict(ended.result)
    elif ended.timed_out:
        out = {"outcome": TIMEOUT, "limit": "", "error": f"no result within {timeout_s:.0f} s"}
    elif ended.exitcode == -signal.SIGKILL:
        # Nothing here kills a try before its timeout: the kernel's OOM killer did.
        out = {"outcome": OOM, "limit": HOST_LIMIT,
               "error": "killed by SIGKILL before reporting (the kernel's out-of-memory killer)"}
    else:
        out = {"outcome": ERROR, "limit": "", "error": f"the process exited with code {ended.exitcode} before reporting"}
    out["pid"] = ended.pid
    out["wall_s"] = round(ended.wall_s, 2)
    return out


def probe_device() -> dict[str, Any]:
    """The GPU's name and memory, read in a process of its own: a CUDA context in this one would
    hold device memory through every try."""
    out = run_try(Try("", "probe", "cuda", False, 0, 0), 120, runner=_probe_runner)
    if out["outcome"] != OK:
        raise RuntimeError(f"could not read the GPU: {out.get('error', '')}")
    return out


def _probe_runner(t: Try, meter: PeakMeter) -> dict[str, Any]:
    props = torch.cuda.get_device_properties(meter.device)
    return {"total_memory": int(props.total_memory)}


# ---- the planner's side -----------------------------------------------------------------------


def host_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


@dataclass(frozen=True)
class Machine:
    """The device tries run on, as the planner is told of it."""

    device_type: str  # cuda | cpu
    name: str  # as torch reports it
    total_bytes: int  # the whole device's memory
    cap_bytes: Optional[int]  # --memory-gb, when given
    host_bytes: int  # what the planner may offload to (none on a CPU: it is the same memory)
    headroom: float
    host_total_bytes: int = 0  # the host memory a try may ask for: the host's, or --host-memory-gb
    host_cap_bytes: Optional[int] = None  # --host-memory-gb, when given

    @property
    def whole(self) -> bool:
        """Whether tries may use the whole device and host: no --memory-gb below the device's
        memory, no --host-memory-gb."""
        return self.memory_bytes == self.total_bytes and self.host_cap_bytes is None

    @property
    def memory_bytes(self) -> int:
        """What the planner plans for and a try may use: the device's memory, or the cap."""
        return self.total_bytes if self.cap_bytes is None else min(self.cap_bytes, self.total_bytes)

    def cluster(self, headroom: Optional[float] = None) -> Cluster:
        from ringtrain.planner.reach import device_seen
        from ringtrain.planner.search import Cluster

        device = device_seen(self.name, self.memory_bytes, self.host_bytes, cpu_cores=os.cpu_count() or 1)
        return Cluster(device, gpus=1, gpus_per_node=1, headroom=self.headroom if headroom is None else headroom)


def machine_for(args: argparse.Namespace) -> Machine:
    cap = int(args.memory_gb * GB) if args.memory_gb else None
    if args.device == "cpu":
        assert cap is not None  # parse_args gives --tiny a default cap
        return Machine("cpu", "cpu", cap, cap, 0, args.headroom)
    probe = probe_device()
    host_cap = None if args.host_memory_gb is None else int(args.host_memory_gb * GB)
    host_total = host_memory_bytes() if host_cap is None else host_cap
    host = int(host_total * (1 - args.headroom))
    return Machine("cuda", probe["device_name"], probe["total_memory"], cap, host, args.headroom, host_total, host_cap)


def liger_present() -> bool:
    return importlib.util.find_spec("liger_kernel") is not None


@dataclass
class ShapePlan:
    """The planner's view of one shape on the machine: what it predicts and the layout at a length."""

    name: str
    machine: Machine
    workload: Workload  # ringtrain's, as the Trainer will run it
    hf_workload: Workload  # transformers' stand-in: unfused ops
    assume: Assumptions
    reach: Optional[Reach]
    reach_no_headroom: Optional[Reach]
    hf_reach: Optional[Reach]

    @property
    def cluster(self) -> Cluster:
        return self.machine.cluster()

    def ringtrain_at(self, seq_len: int) -> Candidate:
        from ringtrain.planner.reach import pick

        leanest = self.reach.candidate.layout if self.reach else None
        return pick(self.workload, self.cluster, self.assume, seq_len, leanest=leanest)

    def hf_at(self, seq_len: int) -> Candidate:
        from ringtrain.planner.reach import at_length

        return at_length(self.hf_workload, hf_layout(), seq_len, self.cluster, self.assume)

    def at(self, system: str, seq_len: int) -> Candidate:
        """The layout ``system`` trains ``seq_len`` with, and the planner's estimate of it."""
        return self.ringtrain_at(seq_len) if system == "ringtrain" else self.hf_at(seq_len)

    def start(self, system: str) -> Optional[int]:
        """Where ``system``'s search starts: the planner's max (for hf, its reach of full
        checkpointing without savers), or None where the planner fits nothing."""
        reach = self.reach if system == "ringtrain" else self.hf_reach
        return reach.max_seq_len if reach else None

    def refusal(self, seq_len: int, cand: Candidate, granule: int) -> str:
        """Why a try at ``seq_len`` with ``cand`` is not run ("": it runs). The host memory: a
        layout that offloads more than the host holds (or --host-memory-gb lets it use) could take
        the node's memory from under its other processes. The device, at one granule only: where
        the planner's smallest layout is over the memory by more than its tolerance, nothing fits,
        and a try would spend a process start to say so."""
        machine = self.machine
        if cand.memory.host > machine.host_total_bytes:
            return (f"host memory: a try at {seq_len:,} tokens ({cand.layout.describe()}) needs "
                    f"{_gb(cand.memory.host)} GB of host memory, more than the {_gb(machine.host_total_bytes)} GB here")
        if seq_len <= granule and cand.memory.total > (1 + PREDICTION_TOLERANCE) * machine.memory_bytes:
            return (f"nothing fits: at {seq_len:,} tokens ({cand.layout.describe()}) the planner needs "
                    f"{_gb(cand.memory.total)} GB of device memory, over the {_gb(machine.memory_bytes)} GB here "
                    f"by more than {PREDICTION_TOLERANCE:.0%}")
        return ""

    def first_length(self, system: str, granule: int) -> int:
        """The length ``system``'s search tries first: its start down to the granule."""
        start = self.start(system)
        return granule if start is None else max(granule, start // granule * granule)

    def first_refusal(self, system: str, granule: int) -> str:
        """Why ``system``'s search would not run even its first try ("": it would)."""
        first = self.first_length(system, granule)
        return self.refusal(first, self.at(system, first), granule)

    def predicted(self, layout: Layout, seq_len: int, checkpointing: str) -> Candidate:
        """The planner's estimate for the layout a try ran, its recompute mode as the Trainer resolved it."""
        from ringtrain.planner.reach import at_length
        from ringtrain.planner.recompute import with_mode

        return at_length(self.workload, with_mode(layout, checkpointing), seq_len, self.cluster, self.assume)


def hf_layout() -> Layout:
    """transformers' recipe as the planner sees it: one GPU, no ZeRO, every layer checkpointed."""
    from ringtrain.planner.layout import Layout

    return Layout(dp=1, ring=1, ulysses=1, zero_stage=0, checkpointing=True)


def plan_shape(name: str, machine: Machine, tiny: bool, granule: int) -> ShapePlan:
    from ringtrain.planner.layout import workload_of
    from ringtrain.planner.reach import longest, recipe_reach
    from ringtrain.planner.throughput import Assumptions

    base = load_job(Try(name, "ringtrain", machine.device_type, tiny, granule, 1))
    workload = workload_of(base, machine.device_type)
    # The Trainer runs liger's kernels only where they import: plan for what runs.
    workload = dataclasses.replace(workload, fused=workload.fused and liger_present())
    hf_workload = dataclasses.replace(workload, fused=False)
    assume = Assumptions(gpus_per_node=1)
    cluster = machine.cluster()
    return ShapePlan(
        name=name,
        machine=machine,
        workload=workload,
        hf_workload=hf_workload,
        assume=assume,
        reach=longest(workload, cluster, assume),
        reach_no_headroom=longest(workload, machine.cluster(headroom=0.0), assume),
        hf_reach=recipe_reach(hf_workload, hf_layout(), cluster, assume),
    )


# ---- the searches: tries, budget, records ------------------------------------------------------


def start_s_of(starts: Mapping[str, float], system: str, device_type: str) -> float:
    """Seconds a try of ``system`` spends outside its steps: as its last try did, else the guess."""
    return starts.get(system, START_GUESS_S[device_type])


def search_cost_s(plan: ShapePlan, system: str, args: argparse.Namespace, start_s: float) -> float:
    """The device time ``system``'s search on ``plan`` is predicted to take: its --peaks-at tries
    (ringtrain's) and --max-tries tries, each the planner's step time x --steps plus a process
    start of ``start_s``. Where the search goes after its first try depends on the answers, so
    the first length stands in for every try of the search."""
    first = plan.first_length(system, args.granule)
    lengths = [*(args.peaks_at if system == "ringtrain" else []), *[first] * args.max_tries]
    return sum(args.steps * plan.at(system, n).step.step_s + start_s for n in lengths)


def share_of(left_s: float, cost_s: float, later_costs_s: Sequence[float]) -> float:
    """A search's part of the ``left_s`` seconds left: in proportion to its predicted cost among
    its own and the searches' after it (equal parts where none is predicted to cost anything).
    What a search leaves unused goes to the searches after it, so the last one gets all that
    is left."""
    total = cost_s + sum(later_costs_s)
    if total <= 0:
        return left_s / (1 + len(later_costs_s))
    return left_s * cost_s / total


class Budget:
    """Device time: the whole bench's, shared by the searches still to run in proportion to
    their predicted costs (``share_of``)."""

    def __init__(self, total_s: float) -> None:
        self.total_s = total_s
        self.t0 = time.monotonic()

    @property
    def used_s(self) -> float:
        return time.monotonic() - self.t0

    def share(self, cost_s: float, later_costs_s: Sequence[float]) -> float:
        """Seconds the next search, predicted to cost ``cost_s``, may use (``share_of``)."""
        return share_of(max(0.0, self.total_s - self.used_s), cost_s, later_costs_s)


@dataclass
class Schedule:
    """The searches still to run, in the order they run, and the budget they share."""

    budget: Budget
    plans: Mapping[str, ShapePlan]
    args: argparse.Namespace
    pending: list[tuple[str, str]]  # (shape, system); a search refused at its first try is not one
    starts: dict[str, float]  # shared with the searches: each try's process start, per system

    def cost_s(self, name: str, system: str) -> float:
        plan = self.plans[name]
        return search_cost_s(plan, system, self.args, start_s_of(self.starts, system, plan.machine.device_type))

    def share(self, name: str, system: str) -> float:
        """Seconds the search of ``system`` on ``name`` may use, as it starts: its share of what is
        left among the searches still to run (none where it is not one of them)."""
        if (name, system) not in self.pending:
            return 0.0
        self.pending.remove((name, system))
        return self.budget.share(self.cost_s(name, system), [self.cost_s(*later) for later in self.pending])


@dataclass
class Searcher:
    """Runs the tries of one (shape, system) search and records each; its ``oracle`` is what
    ``search_longest`` calls."""

    plan: ShapePlan
    system: str
    args: argparse.Namespace
    deadline: float  # time.monotonic() at which this search's share of the budget ends
    tries: list[dict[str, Any]] = field(default_factory=list)
    stopped: str = ""
    # Seconds a try spends outside its steps, per system, as its last try did (shared by the
    # searches of every shape; a guess until one is seen).
    starts: dict[str, float] = field(default_factory=dict)

    @property
    def start_s(self) -> float:
        return start_s_of(self.starts, self.system, self.plan.machine.device_type)

    def overrides(self, layout: Layout) -> tuple[str, ...]:
        if self.system != "ringtrain":
            return ()
        # auto on the device itself, as a user's job; under a cap the planner's mode, which auto
        # (reading the whole device, or resolving "none" on a CPU) would not pick.
        auto = self.plan.machine.device_type == "cuda" and self.plan.machine.cap_bytes is None
        return tuple("model.activation_checkpointing=auto" if auto and o.startswith("model.activation_checkpointing=")
                     else o for o in layout.overrides())

    def oracle(self, seq_len: int) -> Optional[bool]:
        cand = self.plan.at(self.system, seq_len)
        refused = self.plan.refusal(seq_len, cand, self.args.granule)
        if refused:
            self.stopped = refused
            return None
        predicted_s = self.args.steps * cand.step.step_s + self.start_s
        left = self.deadline - time.monotonic()
        if predicted_s > left:
            self.stopped = (f"budget: a try at {seq_len:,} tokens is predicted to take {predicted_s:,.0f} s "
                            f"({self.args.steps} x {cand.step.step_s:,.0f} s steps + {self.start_s:.0f} s start), "
                            f"{max(0.0, left):,.0f} s of this search's share left")
            return None
        cut = left < self.args.try_timeout  # the share, not --try-timeout, bounds this try
        record = self.run(seq_len, cand, timeout_s=min(self.args.try_timeout, left))
        if record["outcome"] == TIMEOUT and cut:
            self.stopped = f"budget: the try at {seq_len:,} tokens ran past the end of this search's share"
            return None
        if record["outcome"] == ERROR:
            # A crash says nothing of whether the length fits: read as a failure, it would narrow
            # the search and claim a max (and judge the planner) from it.
            self.stopped = f"error at {seq_len:,} tokens: {last_line(record.get('error', ''))}"
            return None
        return record["outcome"] == OK

    def run(self, seq_len: int, cand: Candidate, timeout_s: float) -> dict[str, Any]:
        machine = self.plan.machine
        fraction = None
        if machine.device_type == "cuda" and machine.cap_bytes is not None:
            fraction = machine.memory_bytes / machine.total_bytes
        t = Try(self.plan.name, self.system, machine.device_type, self.args.tiny, seq_len, self.args.steps,
                self.overrides(cand.layout), fraction)
        out = run_try(t, timeout_s)
        record = self.record(t, cand, out)
        self.tries.append(record)
        print(try_line(self.system, len(self.tries), record), flush=True)
        return record

    def record(self, t: Try, cand: Candidate, out: dict[str, Any]) -> dict[str, Any]:
        machine = self.plan.machine
        record: dict[str, Any] = {"seq_len": t.seq_len, **out}
        # Past the cap is out of memory. On a CPU the cap is only counted; on CUDA the allocator
        # enforces it (set_per_process_memory_fraction bounds what it reserves), and a reserved
        # peak past it would say it did not: either way the try did not fit the memory planned for.
        peak = out.get("peak_reserved_bytes" if machine.device_type == "cuda" else "peak_device_bytes", 0)
        if out.get("outcome") == OK and machine.cap_bytes is not None and peak > machine.cap_bytes:
            record.update(outcome=OOM, limit=DEVICE_LIMIT, over_cap=True)
        if "step_s" in out:
            self.starts[self.system] = out["wall_s"] - sum(out["step_s"])
        record["predicted_step_s"] = cand.step.step_s
        if self.system == "ringtrain":
            mode = out.get("checkpointing", cand.layout.checkpointing_mode)
            ran = self.plan.predicted(cand.layout, t.seq_len, mode)
            record.update(
                layout=ran.layout.describe(),
                overrides=list(t.overrides),
                planned_checkpointing=cand.layout.checkpointing_mode,
                predicted_peak_bytes=ran.memory.total,
                predicted_host_bytes=ran.memory.host,
                predicted_fits=ran.fits,
            )
            if record.get("peak_device_bytes") and record["outcome"] == OK:
                record["predicted_over_measured"] = ran.memory.total / record["peak_device_bytes"]
        return record


def last_line(text: str) -> str:
    """A traceback's last line: the exception and its message."""
    lines = text.strip().splitlines()
    return lines[-1].strip() if lines else "no message"


def search_system(plan: ShapePlan, system: str, args: argparse.Namespace, share_s: float,
                  starts: dict[str, float]) -> dict[str, Any]:
    """One system's search on one shape (and, for ringtrain, its --peaks-at tries first)."""
    searcher = Searcher(plan, system, args, deadline=time.monotonic() + share_s, starts=starts)
    policy = SearchPolicy(granule=args.granule, growth=args.growth, max_tries=args.max_tries,
                          edges=PREDICTION_TOLERANCE if args.tolerance_edges else None)
    predicted = plan.start(system)
    start = policy.granule if predicted is None else predicted
    source = ("the planner's predicted max" if system == "ringtrain" else
              "the planner's reach of full checkpointing without savers") if predicted else "one granule (the planner fits nothing)"
    if system == "ringtrain":
        for length in args.peaks_at:
            if searcher.oracle(length) is None:
                break
    fixed = len(searcher.tries)
    if searcher.stopped:
        result = SearchResult(stopped=searcher.stopped)
    else:
        result = search_longest(searcher.oracle, start, policy)
        result.stopped = searcher.stopped or result.stopped
    longest, failure = result.longest, result.failure
    first_failure = next((r for r in searcher.tries[fixed:] if r["seq_len"] == failure), None)
    return {
        "planner_max": predicted or 0,
        "start": policy.floor(start),
        "start_from": source,
        "tries": searcher.tries,
        "search_tries": len(result.tried),
        "max_seq_len": longest,
        "failed_at": failure,
        "stopped_by": (first_failure.get("limit") or first_failure["outcome"]) if first_failure else None,
        "converged": failure is not None and failure - longest <= policy.granule and longest > 0,
        "stopped": result.stopped,
        "wall_s": round(sum(r["wall_s"] for r in searcher.tries), 1),
    }


# ---- report -----------------------------------------------------------------------------------


def _gb(nbytes: Optional[float]) -> str:
    return "-" if nbytes is None else f"{nbytes / GB:.3g}"


def try_line(system: str, index: int, r: Mapping[str, Any]) -> str:
    outcome = r["outcome"] + (f" ({r['limit']})" if r.get("limit") else "") + (" over the cap" if r.get("over_cap") else "")
    steps = r.get("step_s") or []
    ratio = r.get("predicted_over_measured")
    return (f"  {system:<9} {index:>2} {r['seq_len']:>11,} {outcome:<17} peak {_gb(r.get('peak_device_bytes')):>7} GB"
            f"  predicted {_gb(r.get('predicted_peak_bytes')):>7} GB"
            f"  {'pred/meas ' + format(ratio, '.3f') if ratio else '':<15}"
            f"  host {_gb(r.get('host_peak_rss_bytes')):>6} GB  step {max(steps) if steps else 0:7.2f} s"
            f"  (process {r['wall_s']:.0f} s){'  ' + r['layout'] if r.get('layout') else ''}")


def shape_summary(name: str, plan: ShapePlan, systems: Mapping[str, dict[str, Any]], granule: int) -> dict[str, Any]:
    """The per-shape numbers the targets read: maxima, ratio, prediction error, peak accuracy."""
    rt, hf = systems.get("ringtrain"), systems.get("hf")
    out: dict[str, Any] = {
        "predicted_max": plan.reach.max_seq_len if plan.reach else 0,
        "predicted_max_no_headroom": plan.reach_no_headroom.max_seq_len if plan.reach_no_headroom else 0,
    }
    if rt and hf and rt["max_seq_len"] and hf["max_seq_len"]:
        out["ratio"] = rt["max_seq_len"] / hf["max_seq_len"]
    if rt:
        # |predicted / measured - 1| over the maxima ringtrain's search leaves possible, where it decides it.
        error: Optional[float] = None
        why = f"the search measured nothing ({rt['stopped']})"
        if rt["max_seq_len"] or rt["failed_at"] is not None:
            error, why = prediction_error(out["predicted_max"], rt["max_seq_len"], rt["failed_at"], granule,
                                          PREDICTION_TOLERANCE)
        out["predicted_max_error"], out["predicted_max_undecided"] = error, why
        within = sorted({r["seq_len"] for r in rt["tries"]
                         if r.get("predicted_over_measured") and abs(r["predicted_over_measured"] - 1) <= PREDICTION_TOLERANCE})
        out["peak_within_tolerance_at"] = within
        out["peak_measured_at"] = sorted({r["seq_len"] for r in rt["tries"] if r.get("predicted_over_measured")})
    return out


def targets_for(name: str, machine: Machine, summary: Mapping[str, Any],
                systems: Mapping[str, dict[str, Any]]) -> list[Target]:
    rt, hf = systems.get("ringtrain"), systems.get("hf")
    out: list[Target] = []
    if rt and hf:
        why = "; ".join(f"{system} found no length that fits ({s['stopped']})" for system, s in systems.items()
                        if not s["max_seq_len"])
        out.append(Target(name, "ringtrain max / hf max", summary.get("ratio"), RATIO_MIN, "x", missing=why))
    # A million tokens needs the whole device and the host to offload to: under a cap it is a
    # sure miss that says nothing.
    if rt and name == "llama3.2-1b" and "h100" in machine.name.lower() and machine.whole:
        value = rt["max_seq_len"] or None
        out.append(Target(name, "ringtrain max on an H100", value, LLAMA_1B_MIN_TOKENS, "tokens",
                          missing="" if value else rt["stopped"]))
    if rt:
        out.append(Target(name, "|planner's predicted max / measured - 1|", summary["predicted_max_error"],
                          PREDICTION_TOLERANCE, "%", at_most=True, missing=summary["predicted_max_undecided"]))
        measured, within = summary["peak_measured_at"], summary["peak_within_tolerance_at"]
        # Fewer lengths measured than the target counts say nothing of the peaks predicted there.
        few = (f"peaks measured at {len(measured)} length{'' if len(measured) == 1 else 's'} "
               f"({len(within)} within), fewer than {PEAK_LENGTHS_MIN}") if len(measured) < PEAK_LENGTHS_MIN else ""
        out.append(Target(name, f"lengths with the predicted peak within {PREDICTION_TOLERANCE:.0%} "
                                f"(of {len(measured)} measured)",
                          None if few else float(len(within)), PEAK_LENGTHS_MIN, "count", missing=few))
    return out


def shape_header(name: str, plan: ShapePlan, granule: int) -> list[str]:
    from ringtrain.planner.reach import binding_limit
    from ringtrain.planner.search import unit_of

    m, cluster = plan.machine, plan.cluster
    lines = [f"{name} ({SHAPES[name].title}): {m.name}, {_gb(m.memory_bytes)} GB"
             f"{' (--memory-gb cap)' if m.cap_bytes else ''}, planner usable {_gb(cluster.usable_bytes)} GB "
             f"({cluster.headroom:.0%} headroom), host {_gb(m.host_bytes)} GB for offloads, "
             f"{'fused' if plan.workload.fused else 'eager'} ops planned"]
    if plan.reach:
        c = plan.reach.candidate
        lines.append(f"  planner's max {plan.reach.max_seq_len:,} tokens ({c.layout.describe()}; predicted "
                     f"{c.memory.total / GB:.3g} GB device, {c.memory.host / GB:.3g} GB host, step {c.step.step_s:,.1f} s)")
        past = plan.ringtrain_at(plan.reach.max_seq_len + unit_of(c.layout))
        lines.append(f"  past it the limit is {' and '.join(binding_limit(past.memory, cluster)) or 'none'}; "
                     f"with no headroom the planner's max is "
                     f"{plan.reach_no_headroom.max_seq_len if plan.reach_no_headroom else 0:,}")
    else:
        leanest = plan.ringtrain_at(granule)
        lines.append(f"  the planner fits not even {granule:,} tokens: its leanest layout there "
                     f"({leanest.layout.describe()}) exceeds the {' and '.join(binding_limit(leanest.memory, cluster))} "
                     f"memory ({leanest.memory.total / GB:.3g} GB device, {leanest.memory.host / GB:.3g} GB host)")
    return lines


def summary_lines(name: str, systems: Mapping[str, dict[str, Any]], summary: Mapping[str, Any]) -> list[str]:
    lines = []
    for system, s in systems.items():
        bound = f", fails at {s['failed_at']:,}" if s["failed_at"] else ""
        by = f" ({s['stopped_by']})" if s["stopped_by"] else ""
        lines.append(f"  {system:<9} max {s['max_seq_len']:>11,}{bound}{by}; planner {s['planner_max']:,}; "
                     f"{len(s['tries'])} tries, {s['wall_s']:.0f} s; stopped: {s['stopped']}")
    if "ratio" in summary:
        lines.append(f"  ratio ringtrain / hf {summary['ratio']:.2f}x")
    if "predicted_max_error" in summary:
        error = summary["predicted_max_error"]
        off = summary["predicted_max_undecided"] if error is None else (
            f"{error:.1%} off the measured at {'most' if error <= PREDICTION_TOLERANCE else 'least'}")
        lines.append(f"  planner's predicted max {summary['predicted_max']:,}: {off}")
    return lines


# ---- command line -----------------------------------------------------------------------------


def _bad_input(message: str) -> int:
    return bad_input("max_context", message)


def _lengths(text: str) -> list[int]:
    try:
        lengths = [int(n.replace("_", "")) for n in text.split(",") if n.strip()]
    except ValueError:
        raise SystemExit(_bad_input(f"--peaks-at: {text!r} is not a comma-separated list of token counts")) from None
    if any(n < 2 for n in lengths):
        raise SystemExit(_bad_input("--peaks-at: every length must be >= 2"))
    return lengths


# The tiny cap is where ringtrain's savers start to pay (a chunked loss's logits are a fixed 8 MB
# at vocabulary 512 in fp32) and the longest steps take about a second on a CPU core.
TINY_DEFAULTS = {"memory_gb": 0.016, "granule": 256, "budget_s": 300.0}
FULL_DEFAULTS = {"memory_gb": None, "granule": 1024, "budget_s": 600.0}


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = one_device_parser(__doc__)
    p.add_argument("--shapes", default=",".join(DEFAULT_SHAPES), help="comma-separated, of: " + ", ".join(SHAPES))
    p.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated, of: " + ", ".join(SYSTEMS))
    p.add_argument("--steps", type=int, default=2, help="optimizer steps per try (the second catches allocator growth)")
    p.add_argument("--granule", type=int, default=None, help="lengths are multiples of it (1024; 256 with --tiny)")
    p.add_argument("--growth", type=float, default=1.25, help="factor to grow or shrink by until the max is bracketed")
    p.add_argument("--max-tries", type=int, default=6, help="tries per search")
    p.add_argument("--budget-s", type=float, default=None, help="device seconds for the whole bench (600; 300 with --tiny)")
    p.add_argument("--try-timeout", type=float, default=900.0, help="seconds per try, process start included")
    p.add_argument("--memory-gb", type=float, default=None,
                   help="a memory cap standing in for the device's (GB); 0.016 with --tiny")
    p.add_argument("--host-memory-gb", type=float, default=None,
                   help="host memory standing in for the host's (GB), what offloads may use; 0: none (CUDA only)")
    p.add_argument("--tolerance-edges", action="store_true",
                   help="each search's second try at the 10%% tolerance's edge of its start")
    p.add_argument("--headroom", type=float, default=0.1, help="the planner's fraction of device memory kept free")
    p.add_argument("--peaks-at", type=_lengths, default=[], help="ringtrain tries at these lengths before its search")
    p.add_argument("--check", action="store_true", help="exit 1 when a target is missed or not measured")
    p.add_argument("--out", type=Path, default=None, help="the JSON's path (default bench/results/max_context-<device>.json)")
    args = p.parse_args(argv)
    args.shapes = listed(args.shapes, tuple(SHAPES), "--shapes", "max_context")
    args.systems = [s for s in SYSTEMS if s in listed(args.systems, SYSTEMS, "--systems", "max_context")]
    for key, value in (TINY_DEFAULTS if args.tiny else FULL_DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.steps < 1 or args.granule < 2 or args.granule % 2 or args.max_tries < 1 or args.growth <= 1:
        raise SystemExit(_bad_input("--steps and --max-tries must be >= 1, --granule even and >= 2, --growth > 1"))
    if args.memory_gb is not None and args.memory_gb <= 0:
        raise SystemExit(_bad_input("--memory-gb must be > 0"))
    if args.host_memory_gb is not None and (args.host_memory_gb < 0 or args.device == "cpu"):
        raise SystemExit(_bad_input("--host-memory-gb must be >= 0, and on a CPU there is no host memory apart "
                                    "from the device's"))
    if not 0 <= args.headroom < 1:
        raise SystemExit(_bad_input("--headroom must be in [0, 1)"))
    if args.budget_s <= 0 or args.try_timeout <= 0:
        raise SystemExit(_bad_input("--budget-s and --try-timeout must be > 0"))
    args.peaks_at = [max(args.granule, n // args.granule * args.granule) for n in args.peaks_at]
    return args


def main(argv: list[str]) -> int:
    interrupt_on_sigint()
    args = parse_args(argv)
    if args.device == "cuda" and (no_gpu := without_cuda("max_context")) is not None:
        return no_gpu
    if args.device == "cpu" and not args.tiny:
        return _bad_input("--device cpu runs only with --tiny (a 1B model's longest step takes days on a CPU)")
    run = Run("max_context")
    smoke = args.device == "cpu"
    # The same allocator setting for every try (each try's process starts with this environment).
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    budget = Budget(args.budget_s)  # the GPU's probe counts
    machine = machine_for(args)
    print(f"{'tiny shapes, ' if args.tiny else ''}{args.steps} steps per try, granule {args.granule:,}, at most "
          f"{args.max_tries} tries per search, budget {args.budget_s:.0f} s{f' ({SMOKE})' if smoke else ''}")
    shapes: dict[str, Any] = {}
    targets: list[Target] = []
    plans = {name: plan_shape(name, machine, args.tiny, args.granule) for name in args.shapes}
    # The budget is shared by the searches that will try something: one refused at its first try
    # (host memory, or nothing fits) ends at once and takes no share.
    refused = {(name, system): plans[name].first_refusal(system, args.granule)
               for name in args.shapes for system in args.systems}
    starts: dict[str, float] = {}
    schedule = Schedule(budget, plans, args, [search for search, why in refused.items() if not why], starts)
    interrupted = ""
    for name in args.shapes:
        plan = plans[name]
        for line in shape_header(name, plan, args.granule):
            print(line, flush=True)
        systems: dict[str, Any] = {}
        try:
            for system in args.systems:
                systems[system] = search_system(plan, system, args, schedule.share(name, system), starts)
        except KeyboardInterrupt:
            interrupted = f"{name}: interrupted (SIGINT); what comes after it is not run"
        summary = shape_summary(name, plan, systems, args.granule)
        for line in summary_lines(name, systems, summary):
            print(line)
        targets += targets_for(name, machine, summary, systems)
        shapes[name] = {"title": SHAPES[name].title, "model": SHAPES[name].model_keys(args.tiny),
                        "planner": planner_record(plan), "systems": systems, **summary}
        if interrupted:
            print(interrupted, file=sys.stderr)
            break
    print(f"device time used: {budget.used_s:.0f} s of the {args.budget_s:.0f} s budget")
    for target in targets:
        print(target.line(smoke))
    errors = [f"{name}/{system} at {r['seq_len']:,} tokens: {last_line(r.get('error', ''))}"
              for name, shape in shapes.items() for system, s in shape["systems"].items()
              for r in s["tries"] if r["outcome"] == ERROR]
    device_label = machine.name if args.device == "cuda" else "cpu"
    run.write(
        {
            "config": {**{k: v for k, v in vars(args).items() if k != "out"}, "out": str(args.out) if args.out else None},
            "smoke": smoke,
            "machine_memory": dataclasses.asdict(machine),
            "budget_s": args.budget_s,
            "budget_used_s": round(budget.used_s, 1),
            "shapes": shapes,
            "targets": [{**dataclasses.asdict(t), "met": t.met} for t in targets],
            "errors": errors,
            "interrupted": interrupted or None,
        },
        device_type=args.device,
        out=args.out or RESULTS_DIR / f"max_context-{slug(device_label)}{'-tiny' if args.tiny else ''}.json",
    )
    if errors:
        print("failed: a try ended in an error (its traceback's last lines are in the JSON):\n  "
              + "\n  ".join(errors), file=sys.stderr)
    if interrupted or errors:
        return 1
    if args.check and not smoke and not all(t.met for t in targets):
        return 1
    return 0


def planner_record(plan: ShapePlan) -> dict[str, Any]:
    def reach(r: Optional[Reach]) -> Optional[dict[str, Any]]:
        if r is None:
            return None
        c = r.candidate
        return {"max_seq_len": r.max_seq_len, "layout": c.layout.describe(), "overrides": c.layout.overrides(),
                "predicted_peak_bytes": c.memory.total, "predicted_host_bytes": c.memory.host,
                "predicted_step_s": c.step.step_s}

    cluster = plan.cluster
    return {"usable_bytes": cluster.usable_bytes, "headroom": cluster.headroom, "fused": plan.workload.fused,
            "dtype": plan.workload.dtype, "num_params_planned": plan.workload.model.num_params,
            "reach": reach(plan.reach), "reach_no_headroom": reach(plan.reach_no_headroom),
            "hf_start_reach": reach(plan.hf_reach)}


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
