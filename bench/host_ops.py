"""Benchmark: the host work of one context-parallel attention layer, per rank, on the CPU.

At short blocks a GPU rank waits on its host: every aten op a rank dispatches is at least one
launch. This counts the aten ops each rank dispatches for one layer's forward + backward and
times the rank's host side, at tiny shapes with the one-op ``cpu_flash`` kernel, every rank a
thread of one process (``ringtrain_dev.emulated_cp``: the real attention code, the transport in
memory). Layouts: ring cp4 with K/V passed around the ring and with K/V all gathered, ring cp4
on packed documents, Ulysses cp4, hybrid 2 x 2, ring cp8, and a windowed ring cp4 layer (the
ring exchange, not the neighbours': as 110e587's figures were taken).

What a rank's layer is, here:
- its attention call and backward, from sharded inputs (sharding is the data loader's work) and,
  with documents, from documents made once for every call, as a forward's layers share theirs
  (their gather and the plan they cut are the forward's, done in the warm-up call);
- its ops: every aten op its thread dispatches but the emulated transport's (a job's transfers
  are the process group's; an emulator's mailbox copies stand in for the network);
- its host time: the last rank (the busiest under a causal mask) run alone in this thread on the
  benches' loopback transport (``ringtrain_dev.loopback``: same shapes, no other rank's thread to
  share the cores and caches with), its CPU time less the transport's and less the block
  kernel's own op (``_TimedKernel``: at these shapes the CPU kernel computes for 25-60 us a call,
  which a GPU does on the device; what is left is what a GPU rank's host does); one OpenMP
  thread, no garbage collection landing in a timed run, the least of ``--repeats`` runs in each
  of ``--processes`` fresh processes (as ``timeit`` advises: a machine shared with others only
  ever adds to a run's time, and a process's speed varies with where its memory lands). (With
  packed documents the loopback's gather hands the rank its own documents back as every rank's:
  the same cut before and after.)

For reference it also times the op sequences of Ulysses cp4 and of the hybrid written bare
(``_bare``: the same gather, all-to-alls, views, kernel ops, merge, ring transfers and
gather home and the copies' sum, with nothing between them): the floor of each layer's host time.

Before: the same bench at d5f494a, that commit's attention code and emulator with this
counting applied (``bench/results/host_ops-d5f494a.patch``), taken from git history into a
temporary folder and timed in this run, its processes taking turns with this tree's: host
times compare only when taken on one machine at one time (the same code reads twice as slow
on one day's machine as on another's). Its op counts, which do not depend on the machine, are
the recorded run's (``bench/results/host_ops-cpu-d5f494a.json``, made with ``--baseline-run``);
``--baseline PATH`` takes its host times from such a recorded run too, where git history is not
at hand. The figures of 110e587 (the issue's table, counted with the harness's sharding and the
mailbox copies in) are printed for reference. Targets: ring cp4 (both exchanges) at most 0.33x
the ops before; packed documents at most 1.3x the same layout without them; host time at most
0.5x before, each layout.

Usage: python bench/host_ops.py [--repeats 51] [--processes 3] [--baseline PATH] [--out PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

# One OpenMP thread a rank, set before torch starts: the ranks' threads would each start a team of
# their own otherwise (torch.set_num_threads holds for the calling thread only).
os.environ["OMP_NUM_THREADS"] = "1"
ROOT = Path(__file__).resolve().parents[1]

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from ringtrain_dev.record import RESULTS_DIR, Run  # noqa: E402

# ops a rank of each layout dispatched at 110e587 (fewest, most), counted with the harness's
# sharding and the emulator's mailbox copies in (the issue's table).
OPS_110E587: dict[str, tuple[int, int]] = {
    "ring cp4": (348, 351),
    "ring cp4 allgather": (247, 327),
    "ring cp4 packed": (495, 862),
    "ulysses cp4": (140, 140),
    "hybrid 2x2": (232, 233),
    "ring cp8": (716, 723),
}
BEFORE_COMMIT = "d5f494a"
BEFORE_PATCH = RESULTS_DIR / "host_ops-d5f494a.patch"  # that commit's emulator, counted as this bench counts
BASELINE = RESULTS_DIR / "host_ops-cpu-d5f494a.json"  # its recorded run: the op counts before
RING_OPS_TARGET = 0.33
PACKED_TARGET = 1.3
HOST_TIME_TARGET = 0.5
# The layouts whose ops are also timed written bare (``_bare``): the floor of their host time.
BARE_LAYOUTS = ("ulysses cp4", "hybrid 2x2")
B, HEADS, KV_HEADS, HEAD_DIM = 1, 4, 2, 16
TOKENS_PER_RANK = 32


@dataclass(frozen=True)
class Layout:
    name: str
    ring: int
    ulysses: int
    kv_exchange: str = "ring"
    documents: bool = False
    window: Optional[int] = None


LAYOUTS = (
    Layout("ring cp4", 4, 1),
    Layout("ring cp4 allgather", 4, 1, kv_exchange="allgather"),
    Layout("ring cp4 packed", 4, 1, documents=True),
    Layout("ulysses cp4", 1, 4),
    Layout("hybrid 2x2", 2, 2),
    Layout("ring cp8", 8, 1),
    Layout("ring cp4 window", 4, 1, window=48),
)

_kernel_time = threading.local()


def _kernel_seconds() -> float:
    return float(getattr(_kernel_time, "seconds", 0.0))


def _kernel_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, mask: Optional[torch.Tensor] = None,
               scale: float = HEAD_DIM**-0.5) -> tuple[torch.Tensor, torch.Tensor]:
    """``cpu_flash``'s forward op, its thread's CPU time kept apart (``_kernel_seconds``)."""
    started = time.thread_time()
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=mask,
                                                                         scale=scale)
    _kernel_time.seconds = _kernel_seconds() + time.thread_time() - started
    return out, lse


def _kernel_op_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                        lse: torch.Tensor, causal: bool, mask: Optional[torch.Tensor] = None,
                        scale: float = HEAD_DIM**-0.5) -> tuple[torch.Tensor, ...]:
    """``cpu_flash``'s backward op, timed as ``_kernel_op``."""
    started = time.thread_time()
    grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse, 0.0, causal, attn_mask=mask, scale=scale)
    _kernel_time.seconds = _kernel_seconds() + time.thread_time() - started
    return tuple(grads)


def _timed_kernel() -> Any:
    """``cpu_flash`` whose two aten ops keep their thread's CPU time apart (``_kernel_seconds``)."""
    from ringtrain.train.attention import sdpa_kernels

    class _TimedKernel(sdpa_kernels.CpuFlashKernel):
        def _op_forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: Any) -> Any:
            mask, is_causal = sdpa_kernels.mask_as_bias(q, k, call)
            return (*_kernel_op(q, k, v, is_causal, mask, call.scale), None)

        def _op_backward(self, inputs: Any, aux: Any, call: Any) -> Any:
            dout, q, k, v, out, lse = inputs
            mask, is_causal = sdpa_kernels.mask_as_bias(q, k, call)
            return _kernel_op_backward(dout, q, k, v, out, lse, is_causal, mask, call.scale)

    return _TimedKernel()


class _CountOps(TorchDispatchMode):
    """Every aten op the thread dispatches, but the emulated transport's."""

    def __init__(self, counter: Counter[str]) -> None:
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        from ringtrain_dev.emulated_cp import in_transport

        if not in_transport():
            self.counter[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


class _PerRank:
    """Each rank thread's op counts, keyed by the thread's name."""

    def __init__(self) -> None:
        self.ops: dict[str, Counter[str]] = {}
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def context(self) -> Iterator[None]:
        counter: Counter[str] = Counter()
        with _CountOps(counter):
            yield
        with self._lock:
            self.ops[threading.current_thread().name] = counter


def _inputs(layout: Layout) -> tuple[torch.Tensor, ...]:
    world = layout.ring * layout.ulysses
    seq = TOKENS_PER_RANK * world
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, seq, HEADS, HEAD_DIM, generator=g)
    k = torch.randn(B, seq, KV_HEADS, HEAD_DIM, generator=g)
    v = torch.randn(B, seq, KV_HEADS, HEAD_DIM, generator=g)
    dout = torch.randn(B, seq, HEADS, HEAD_DIM, generator=g)
    return q, k, v, dout


def _doc_ids(seq: int) -> torch.Tensor:
    # Five documents of uneven lengths, so blocks are cut at boundaries inside and across shards.
    bounds = torch.tensor([0, seq // 7, seq // 3, seq // 2, (4 * seq) // 5])
    return (torch.arange(seq)[None, :, None] >= bounds[None, None, :]).sum(-1) - 1


def _documents(layout: Layout) -> Optional[list[Any]]:
    """Each rank's documents, made once for every call of a layout (see the module doc)."""
    if not layout.documents:
        return None
    from ringtrain.train.attention.documents import Documents
    from ringtrain.train.attention.zigzag import cp_shard

    docs = _doc_ids(TOKENS_PER_RANK * layout.ring * layout.ulysses)
    return [Documents.of(cp_shard(docs, dim=1, ring=layout.ring, ulysses=layout.ulysses, cp_rank=r))
            for r in range(layout.ring * layout.ulysses)]


def _call(layout: Layout, kernel: Any, rank_context: Callable[[], Any], documents: Optional[list[Any]]) -> None:
    from ringtrain_dev.emulated_cp import emulated_attention, emulated_ring

    q, k, v, dout = _inputs(layout)
    if layout.window is not None:
        emulated_ring(q, k, v, dout, world=layout.ring, kernel=kernel, causal=True, scale=HEAD_DIM**-0.5,
                      window=layout.window, rank_context=rank_context)
        return
    docs = _doc_ids(q.shape[1]) if layout.documents else None
    emulated_attention(q, k, v, dout, ring=layout.ring, ulysses=layout.ulysses, kernel=kernel,
                       doc_ids_BS=docs, kv_exchange=layout.kv_exchange, rank_context=rank_context,
                       documents=documents)


class _TimedLoopback:
    """The benches' loopback transport (``ringtrain_dev.loopback``: what a rank sends comes back to
    it), its transfers' CPU time kept apart: a transfer is the network's work, not the rank's host's."""

    seconds = 0.0

    def __init__(self, index: int, world: int) -> None:
        from ringtrain_dev.loopback import LoopbackTransport

        self._inner = LoopbackTransport(index, world)
        self.rank, self.size = self._inner.rank, self._inner.size

    def _timed(self, method: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        started = time.thread_time()
        try:
            return method(*args, **kwargs)
        finally:
            _TimedLoopback.seconds += time.thread_time() - started

    def send_recv(self, *args: Any, **kwargs: Any) -> Any:
        return self._timed(self._inner.send_recv, *args, **kwargs)

    def all_to_all(self, *args: Any) -> Any:
        return self._timed(self._inner.all_to_all, *args)

    def all_gather(self, *args: Any) -> Any:
        return self._timed(self._inner.all_gather, *args)

    def reduce_scatter(self, *args: Any) -> Any:
        return self._timed(self._inner.reduce_scatter, *args)


Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _rank_inputs(layout: Layout) -> tuple[torch.Tensor, ...]:
    """q, k, v and the output's gradient of the last rank (the busiest under a causal mask)."""
    from ringtrain.train.attention.zigzag import cp_shard

    rank = layout.ring * layout.ulysses - 1
    return tuple(cp_shard(x, dim=1, ring=layout.ring, ulysses=layout.ulysses, cp_rank=rank).contiguous()
                 for x in _inputs(layout))


def _layout_attention(layout: Layout, kernel: Any) -> Attention:
    """The last rank's attention as the product runs it, on loopback transports."""
    from ringtrain.topology import CPLayout
    from ringtrain.train.attention.call import AttentionCall
    from ringtrain.train.attention.documents import Documents
    from ringtrain.train.attention.implementations import build_attention
    from ringtrain.train.attention.loop import attend
    from ringtrain.train.attention.zigzag import cp_shard

    world = layout.ring * layout.ulysses
    rank = world - 1
    ring_idx, ulysses_idx = divmod(rank, layout.ulysses)
    docs = None
    if layout.documents:
        ids = _doc_ids(TOKENS_PER_RANK * world)
        docs = Documents.of(cp_shard(ids, dim=1, ring=layout.ring, ulysses=layout.ulysses, cp_rank=rank))
    ring = _TimedLoopback(ring_idx, layout.ring)
    if layout.window is not None:  # the ring exchange, as asked (see the module doc)
        call = AttentionCall(ring, ring_idx, layout.ring, TOKENS_PER_RANK, True, None, layout.window,
                             HEAD_DIM**-0.5, kernel, "ring")
        return lambda q, k, v: attend(call, q, k, v)
    built = build_attention(CPLayout(layout.ring, layout.ulysses, layout.kv_exchange), kernel, ring_group=ring,
                            ulysses_group=_TimedLoopback(ulysses_idx, layout.ulysses))
    return lambda q, k, v: built(q, k, v, causal=True, doc_ids=docs)


def _layer(attention: Attention, inputs: tuple[torch.Tensor, ...]) -> Callable[[], list[torch.Tensor]]:
    """One layer's forward and backward from fresh leaves; returns their gradients."""
    q, k, v, dout = inputs

    def layer() -> list[torch.Tensor]:
        leaves = [x.detach().requires_grad_() for x in (q, k, v)]
        attention(*leaves).backward(dout)
        return [x.grad for x in leaves if x.grad is not None]

    return layer


def _alone(layout: Layout, kernel: Any, repeats: int) -> tuple[float, float]:
    """(CPU seconds, host seconds) of the last rank's layer run alone on a loopback transport, no
    other thread and no garbage collection running: the least of the runs (what the work takes
    when nothing else on the machine takes turns with it)."""
    return _least_of(_layer(_layout_attention(layout, kernel), _rank_inputs(layout)), repeats)


def _least_of(layer: Callable[[], object], repeats: int) -> tuple[float, float]:
    """(CPU seconds, host seconds) of ``layer``, each the least of ``repeats`` runs: its thread's
    CPU time less the loopback's transfers, and that less the block kernel's op (``_kernel_seconds``)."""
    totals, hosts = [], []
    # As timeit does, no garbage collection in the timed runs (one landing in a run would be timed
    # as its work); collected once before them, not between (a collection leaves the caches cold).
    gc.collect()
    gc.disable()
    try:
        for _ in range(3):
            layer()
        for _ in range(repeats):
            started, kernel_s, transport_s = time.thread_time(), _kernel_seconds(), _TimedLoopback.seconds
            layer()
            total = time.thread_time() - started - (_TimedLoopback.seconds - transport_s)
            totals.append(total)
            hosts.append(total - (_kernel_seconds() - kernel_s))
    finally:
        gc.enable()
    return min(totals), min(hosts)


class _BareLocal:
    """Bare attention over a gathered sequence: the kernel's one call (head-major in and out)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out, lse = _kernel_op(q, k, v, True)
        self.saved = (q, k, v, out, lse)
        return out

    def backward(self, dout: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return _kernel_op_backward(dout, *self.saved, True)


class _BareRingOfTwo:
    """Bare zigzag ring attention on the last rank of a ring of two: its own K/V causally, the
    first rank's first chunk whole (its other chunk is later than all of this rank's), merged
    through the LSEs in place; the backward passes K/V again and the dK/dV accumulator home, as
    the ring does. Its receive buffers and their column views are made once, as the ring's are."""

    def __init__(self, kv_shape: tuple[int, ...]) -> None:
        self.group = _TimedLoopback(1, 2)
        self.buffers = (torch.empty(kv_shape), torch.empty(kv_shape))
        half = kv_shape[2] // 2
        self.first_chunk = tuple(b[:, :, :half] for b in self.buffers)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        own = (k.contiguous(), v.contiguous())
        pending = self.group.send_recv({0: own}, {0: self.buffers}, tag=0)
        out, lse = _kernel_op(q, *own, True)
        pending.wait()
        seen, seen_lse = _kernel_op(q, *self.first_chunk, False)
        out.lerp_(seen, (seen_lse - lse).sigmoid_().unsqueeze(-1))
        torch.logaddexp(lse, seen_lse, out=lse)
        self.saved = (q, *own, out, lse)
        return out

    def backward(self, dout: torch.Tensor) -> tuple[torch.Tensor, ...]:
        q, k, v, out, lse = self.saved
        pending = self.group.send_recv({0: (k, v)}, {0: self.buffers}, tag=0)
        dq, dk, dv = _kernel_op_backward(dout, q, k, v, out, lse, True)
        dkv = torch.stack((dk, dv))
        accumulator = torch.empty_like(dkv)
        passed = self.group.send_recv({0: [dkv]}, {0: [accumulator]}, tag=8)
        pending.wait()
        dq_seen, dk_seen, dv_seen = _kernel_op_backward(dout, q, *self.first_chunk, out, lse, False)
        dq.add_(dq_seen)
        passed.wait()
        accumulator[:, :, :, : dk_seen.shape[2]].add_(torch.stack((dk_seen, dv_seen)))
        home = torch.empty_like(accumulator)
        self.group.send_recv({0: [accumulator]}, {0: [home]}, tag=8).wait()
        return (dq, *home.unbind(0))


def _bare(layout: Layout, kernel: Any, repeats: int) -> tuple[float, float]:
    """(CPU seconds, host seconds) of a Ulysses layout's op sequence written bare, timed as
    ``_alone`` times the layout, once its gradients are checked to be the product's, bit for bit
    (the same ops in the same order): the packing gather, the four all-to-alls and their buffers, the
    layout views and the gather home (and the copies' sum) around the attention over the gathered
    sequence (the kernel's one call for Ulysses, a ring of two for the hybrid: ``_BareLocal``,
    ``_BareRingOfTwo``), with no loop, no checks and no transport seam between the ops. What the
    layout's host cannot go below, whatever holds its ops together."""
    from ringtrain.train.attention.ulysses import routing_of

    rank, U = layout.ring * layout.ulysses - 1, layout.ulysses
    inputs = _rank_inputs(layout)
    q, k = inputs[:2]
    B, s, H, D = q.shape
    K = k.shape[2]
    routing = routing_of(B, s, H, K, U, q.device)  # made once, as the product's is: not timed
    h, g, rows, home, parts = routing.routes.h, routing.routes.g, routing.gather, routing.home, routing.home_parts
    group = _TimedLoopback(rank % U, U)
    attention = _BareLocal() if layout.ring == 1 else _BareRingOfTwo((B, g, U * s, D))

    class Bare(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            sent = torch.cat((q, k, v), dim=2).view(-1, D).index_select(0, rows)
            received = torch.empty_like(sent)
            group.all_to_all(received, sent)
            qg, kg, vg = received.view(B, U * s, -1, D).transpose(1, 2).split_with_sizes((h, g, g), dim=1)
            out = attention.forward(qg, kg, vg)
            back = out.transpose(1, 2).view(U, B, s, h, D).contiguous()
            arrived = torch.empty_like(back)
            group.all_to_all(arrived, back)
            return arrived.permute(1, 2, 0, 3, 4).reshape(B, s, U * h, D)

        @staticmethod
        def backward(ctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor, ...]:
            sent = dout.reshape(B, s, U, h, D).permute(2, 0, 1, 3, 4).contiguous()
            received = torch.empty_like(sent)
            group.all_to_all(received, sent)
            grads = attention.backward(received.view(B, U * s, h, D).transpose(1, 2))
            back = torch.cat([grad.transpose(1, 2) for grad in grads], dim=2).view(U, B, s, -1, D)
            arrived = torch.empty_like(back)
            group.all_to_all(arrived, back)
            dq, dkv, *copies = arrived.view(-1, D).index_select(0, home).split_with_sizes(parts)
            if copies:  # the layouts timed bare copy a KV head twice at most: one add sums the copies
                (second,) = copies
                dkv.add_(second)
            dk, dv = dkv.view(2, B, s, K, D).unbind(0)
            return dq.view(B, s, H, D), dk, dv

    layer = _layer(Bare.apply, inputs)
    expected = _layer(_layout_attention(layout, kernel), inputs)()
    if not all(torch.equal(got, want) for got, want in zip(layer(), expected, strict=True)):
        raise AssertionError(f"{layout.name}: the bare op sequence's gradients are not the product's")
    return _least_of(layer, repeats)


Timings = dict[str, tuple[float, float]]  # layout -> (CPU seconds, host seconds)


@contextlib.contextmanager
def before_tree() -> Iterator[Path]:
    """d5f494a's bench, attention code and emulator with the counting patch applied, in a
    temporary folder for as long as the context lasts."""
    with tempfile.TemporaryDirectory(prefix=f"host_ops-{BEFORE_COMMIT}-") as tmp:
        try:
            tree = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", BEFORE_COMMIT, "bench",
                                   "platform", "tests"], check=True, capture_output=True).stdout
            subprocess.run(["tar", "-x", "-C", tmp], input=tree, check=True, capture_output=True)
            subprocess.run(["git", "apply", str(BEFORE_PATCH)], cwd=tmp, check=True, capture_output=True)
        except (OSError, subprocess.CalledProcessError) as exc:
            failed = isinstance(exc, subprocess.CalledProcessError)
            detail = exc.stderr.decode(errors="replace").strip() if failed else exc
            raise SystemExit(f"host_ops: cannot set up the before tree ({BEFORE_COMMIT} from git history, with "
                             f"{BEFORE_PATCH.name}): {detail}; pass --baseline {BASELINE.relative_to(ROOT)} to "
                             "compare with its recorded run instead") from None
        yield Path(tmp)


def _alone_process(bench: Path, repeats: int) -> Timings:
    """One fresh process of ``bench --alone``: every layout's timings."""
    done = subprocess.run([sys.executable, str(bench), "--alone", "--repeats", str(repeats)], check=True,
                          capture_output=True, text=True, cwd=bench.parents[1])
    return {name: (cpu_s, host_s) for name, (cpu_s, host_s) in json.loads(done.stdout.splitlines()[-1]).items()}


def _keep_least(best: Timings, run: Timings) -> None:
    for name, (cpu_s, host_s) in run.items():
        prior = best.get(name, (cpu_s, host_s))
        best[name] = (min(prior[0], cpu_s), min(prior[1], host_s))


def _alone_in_processes(repeats: int, processes: int, before: Optional[Path]) -> tuple[Timings, Timings]:
    """``_alone`` for every layout in ``processes`` fresh processes, the least of each: a run's
    speed here varies with the process (where its memory lands) more than from run to run. With
    ``before`` (a tree of the before's bench), its processes take turns with these, so a machine
    that slows down or speeds up during the run does so for both."""
    after: Timings = {}
    then: Timings = {}
    for _ in range(processes):
        if before is not None:
            _keep_least(then, _alone_process(before / "bench" / "host_ops.py", repeats))
        _keep_least(after, _alone_process(Path(__file__).resolve(), repeats))
    return after, then


def measure(layout: Layout) -> dict[str, Any]:
    kernel = _timed_kernel()
    documents = _documents(layout)
    _call(layout, kernel, contextlib.nullcontext, documents)  # warm-up: caches, lazy imports, the forward's work
    counted = _PerRank()
    _call(layout, kernel, counted.context, documents)
    ops = sorted(sum(c.values()) for c in counted.ops.values())
    busiest = max(counted.ops.values(), key=lambda c: sum(c.values()))  # the op mix: where the launches go
    return {"ops_min": ops[0], "ops_max": ops[-1], "top_ops": dict(busiest.most_common(12))}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=51, help="timed runs of a layer in each process")
    parser.add_argument("--processes", type=int, default=3, help="fresh processes the timing runs in")
    parser.add_argument("--alone", action="store_true", help=argparse.SUPPRESS)  # one timing process
    parser.add_argument("--baseline", type=Path, default=None,
                        help="a recorded before run's JSON of this bench, its host times taken instead of "
                             f"timing {BEFORE_COMMIT} in this run")
    parser.add_argument("--baseline-run", action="store_true", help="measure only (no before, no targets)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.alone:
        kernel = _timed_kernel()
        alone: dict[str, tuple[float, float]] = {}
        for layout in LAYOUTS:  # a layout's bare ops right after it, in the state its run left
            alone[layout.name] = _alone(layout, kernel, args.repeats)
            if layout.name in BARE_LAYOUTS:
                alone[f"{layout.name} bare"] = _bare(layout, kernel, args.repeats)
        print(json.dumps(alone))
        return 0

    run = Run("host_ops")
    before: dict[str, Any] = {}
    if args.baseline_run or args.baseline is not None:
        alone, _ = _alone_in_processes(args.repeats, args.processes, None)
        before = {} if args.baseline_run else json.loads(args.baseline.read_text())["layouts"]
    else:
        with before_tree() as tree:
            alone, then = _alone_in_processes(args.repeats, args.processes, tree)
        recorded = json.loads(BASELINE.read_text())["layouts"]
        before = {name: {**recorded[name], "cpu_s": cpu_s, "host_s": host_s} for name, (cpu_s, host_s) in then.items()}
    results: dict[str, Any] = {}
    checks: list[tuple[str, bool]] = []
    print(f"{'layout':<20} {'ops':>8} {'before':>8} {'ratio':>6} {'110e587':>8} "
          f"{'host ms':>8} {'before':>7} {'ratio':>6} {'cpu ms':>7}")
    for layout in LAYOUTS:
        r = measure(layout)
        r["cpu_s"], r["host_s"] = alone[layout.name]
        prior = before.get(layout.name)
        r["ops_before"] = [prior["ops_min"], prior["ops_max"]] if prior else None
        r["ops_ratio"] = r["ops_max"] / prior["ops_max"] if prior else None
        r["host_ratio"] = r["host_s"] / prior["host_s"] if prior else None
        r["ops_110e587"] = list(OPS_110E587[layout.name]) if layout.name in OPS_110E587 else None
        results[layout.name] = r

        def cell(value: Optional[float], spec: str) -> str:
            return "-" if value is None else format(value, spec)

        print(f"{layout.name:<20} {r['ops_min']:>3}-{r['ops_max']:<4} "
              f"{cell(prior and prior['ops_max'], 'd'):>8} {cell(r['ops_ratio'], '.2f'):>6} "
              f"{cell(r['ops_110e587'] and r['ops_110e587'][1], 'd'):>8} {r['host_s'] * 1e3:>8.2f} "
              f"{cell(prior and prior['host_s'] * 1e3, '.2f'):>7} {cell(r['host_ratio'], '.2f'):>6} "
              f"{r['cpu_s'] * 1e3:>7.2f}")
        if r["host_ratio"] is not None:
            checks.append((f"{layout.name}: host time <= {HOST_TIME_TARGET}x before ({r['host_ratio']:.2f})",
                           r["host_ratio"] <= HOST_TIME_TARGET))
    bare: dict[str, Any] = {}
    for name in BARE_LAYOUTS:
        bare_cpu_s, bare_host_s = alone[f"{name} bare"]
        bare_ratio = bare_host_s / before[name]["host_s"] if before else None
        bare[f"{name} bare".replace(" ", "_")] = {"cpu_s": bare_cpu_s, "host_s": bare_host_s, "host_ratio": bare_ratio}
        print(f"{name + ' bare':<20} {'':>22} {bare_host_s * 1e3:>17.2f} {'':>7} "
              f"{'-' if bare_ratio is None else format(bare_ratio, '.2f'):>6} {bare_cpu_s * 1e3:>7.2f}  (reference)")
    if before:
        for name in ("ring cp4", "ring cp4 allgather"):
            ratio = results[name]["ops_ratio"]
            checks.append((f"{name}: ops <= {RING_OPS_TARGET}x before ({ratio:.2f})", ratio <= RING_OPS_TARGET))
    packed = results["ring cp4 packed"]["ops_max"] / results["ring cp4"]["ops_max"]
    checks.append((f"packed documents: ops <= {PACKED_TARGET}x unpacked ({packed:.2f})", packed <= PACKED_TARGET))
    for what, ok in checks:
        print(f"{'PASS' if ok else 'FAIL'}  {what}")
    ok = all(passed for _, passed in checks)
    out = run.write({"layouts": results, **bare,
                     "checks": [{"check": c, "pass": p} for c, p in checks], "pass": ok,
                     "before": None if args.baseline_run else (
                         str(args.baseline) if args.baseline is not None else
                         f"{BEFORE_COMMIT} timed in this run (with {BEFORE_PATCH.name}); its op counts from "
                         f"{BASELINE.name}"),
                     "before_layouts": before,
                     "shapes": {"batch": B, "heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM,
                                "tokens_per_rank": TOKENS_PER_RANK}}, device_type="cpu", out=args.out)  # fmt: skip
    print(f"wrote {out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
