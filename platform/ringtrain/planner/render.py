"""A plan as text tables and as a JSON-ready dict; strings and dicts only, printing is the command's."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional

from ringtrain.planner.devices import GB
from ringtrain.planner.layout import Layout, Workload
from ringtrain.planner.memory import MemoryEstimate
from ringtrain.planner.models import ModelSpec
from ringtrain.planner.preference import DEFAULT_COMPLETION_TOKENS, PairFit, keeps_token_losses, needs_reference
from ringtrain.planner.search import Candidate, Cluster, Reach
from ringtrain.planner.throughput import Assumptions, attention_flops_per_token, flops_per_token


@dataclass(frozen=True)
class Plan:
    workload: Workload
    cluster: Cluster
    assume: Assumptions
    candidates: list[Candidate]  # best first
    job_layout: Optional[Candidate] = None  # the layout the job file asks for, when there is one
    job_path: str = "JOB.yaml"
    advice: list[str] = field(default_factory=list)
    completion_tokens: int = DEFAULT_COMPLETION_TOKENS  # each completion of a pair, under a preference objective

    @property
    def fitting(self) -> list[Candidate]:
        return [c for c in self.candidates if c.fits]


def _num(value: float) -> str:
    """Three significant digits at most, never an exponent: 280, 52.5, 1.1, 0.06."""
    if value >= 100:
        return f"{value:.0f}"
    if value >= 1:
        return f"{value:.1f}"
    return f"{value:.2f}"


def _gb(nbytes: float) -> str:
    return _num(nbytes / GB)


def format_count(count: int) -> str:
    for unit, size in (("T", 10**12), ("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if count >= size:
            return f"{count / size:.2f}{unit}"
    return str(count)


def header(plan: Plan) -> list[str]:
    w, c, a, d = plan.workload, plan.cluster, plan.assume, plan.cluster.device
    prec = w.precision(1)
    state = (
        f"{prec.name} params and grads, {prec.optimizer_bytes} B/param optimizer state"
        if prec.name == "bf16"
        else "fp32 params and grads, 8 B/param optimizer state at ZeRO-0, 12 B/param at ZeRO 1-3"
        if w.optimizer_bytes is None
        else f"fp32 params and grads, {prec.optimizer_bytes} B/param optimizer state"
    )
    return [
        f"ringtrain plan: {w.model.name}, {format_count(w.model.num_params)} params, seq {w.seq_len:,}, "
        f"{c.gpus} x {d.name} ({c.gpus_per_node} per node)",
        f"assumptions: {state}; kernels at MFU {a.mfu:.2f} of {d.peak_flops / 1e12:.0f} TFLOP/s (the MFU column "
        "counts model FLOPs only, so recomputation lowers it)",
        f"             links at {a.link_efficiency:.0%} of NVLink {d.nvlink_bw / GB:.0f} GB/s and InfiniBand "
        f"{d.network_bw / GB:.0f} GB/s per GPU each way; {_gb(c.usable_bytes)} of {_gb(d.memory_bytes)} GB usable "
        f"({c.headroom:.0%} headroom)",
        f"             {'flash' if w.flash else 'unfused (math)'} attention; micro batch "
        f"{plan.candidates[0].layout.micro_batch if plan.candidates else 1}; "
        f"global batch {w.global_batch} x {w.seq_len:,} = {w.global_batch_tokens:,} tokens",
        *_windows_line(w),
        *_objective_lines(w.objective, PairFit.of(w.seq_len, plan.completion_tokens)),
    ]


def _pair_words(fit: PairFit) -> str:
    """The longest pair a row holds, in words."""
    if not fit.shared_prompt:
        return f"no pair of two {fit.completion:,}-token completions (--completion-tokens)"
    two = f"a {fit.two_documents_prompt:,}-token one" if fit.two_documents_prompt else "none"
    return (f"a {fit.shared_prompt:,}-token prompt and two {fit.completion:,}-token completions (--completion-tokens) "
            f"with the prompt shared (data.prefix_sharing=true), {two} as two documents")  # fmt: skip


def _objective_lines(objective: str, fit: PairFit) -> list[str]:
    """A preference objective's rows: the pair a row holds, and the reference pass."""
    if not keeps_token_losses(objective):
        return []
    reference = "a reference pass before step 1, forward only" if needs_reference(objective) else "no reference pass"
    return [
        f"             objective {objective}: each row holds whole pairs; a {fit.row:,}-token row, {_pair_words(fit)}",
        f"             the loss keeps each token's log-prob; {reference}",
    ]


def _unwindowed(model: ModelSpec) -> ModelSpec:
    return dataclasses.replace(model, window=None, num_windowed_layers=0)


def _windows_line(w: Workload) -> list[str]:
    """A windowed model's attention: its layers, and its FLOPs against the same model's full."""
    m = w.model
    if not m.num_windowed_layers or m.window is None:
        return []
    attention = attention_flops_per_token(m, w.seq_len)
    full = attention_flops_per_token(_unwindowed(m), w.seq_len)
    model_flops, _ = flops_per_token(m, w.seq_len, checkpointing=False)
    return [
        f"             windowed attention: {m.num_windowed_layers} of {m.n_layers} layers windowed ({m.window:,} tokens), "
        f"{m.num_full_layers} full; attention {attention / 1e9:.3g} GFLOP/token, {attention / full:.2f} of "
        f"full causal layers' {full / 1e9:.3g}; model {model_flops / 1e9:.3g} GFLOP/token (the MFU's)",
    ]


# "savers": the recompute mode (full, selective, none) and every other saver in use, so no two
# rows differ in a knob the table does not show, as the reach table's column does.
COLUMNS = ("#", "dp", "cp", "ring", "ulysses", "ZeRO", "savers", "GB/GPU", "tokens/s", "MFU", "step s")


def _row(rank: str, c: Candidate) -> tuple[str, ...]:
    lay = c.layout
    return (
        rank,
        str(lay.dp),
        str(lay.cp),
        str(lay.ring),
        str(lay.ulysses),
        str(lay.zero_stage),
        lay.saver_column(),
        _gb(c.memory.total),
        f"{c.step.tokens_per_s:,.0f}",
        f"{c.step.mfu:.2f}",
        _num(c.step.step_s),
    )


def table(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(r[i]) for r in [COLUMNS, *rows]) for i in range(len(COLUMNS))]
    left = {COLUMNS.index("savers")}  # text columns
    out = []
    for r in [COLUMNS, *rows]:
        cells = [v.ljust(w) if i in left else v.rjust(w) for i, (v, w) in enumerate(zip(r, widths))]
        out.append("  ".join(cells).rstrip())
    return out


def breakdown(c: Candidate, cluster: Cluster, model: ModelSpec, *, title: str, job_path: str) -> list[str]:
    m, s, t, n_layers = c.memory, c.step, c.step.traffic, model.n_layers
    steps = s.micro_batches
    return [
        f"{title}: {c.layout.describe()}",
        "  memory per GPU (GB)",
        f"    parameters        {_gb(m.params):>7}",
        f"    gradients         {_gb(m.grads):>7}",
        f"    optimizer states  {_gb(m.optimizer):>7}",
        f"    ZeRO buffers      {_gb(m.zero_buffers):>7}",
        f"    activations       {_gb(m.activations):>7}   layers keep {_gb(m.kept_by_layers)}"
        + (f" (windowed layers' received K/V {_gb(m.received_kv)})" if m.received_kv else "")
        + f", logits and loss {_gb(m.logits_and_loss)}"
        + (f"; reference pass {_gb(m.reference_pass)}" if m.reference_pass else ""),
        f"    total             {_gb(m.total):>7}   of {_gb(cluster.usable_bytes)} usable"
        + (f"; host {_gb(m.host * min(cluster.gpus, cluster.gpus_per_node))} per node" if m.host else ""),
        f"  step: {steps} micro batch{'es' if steps != 1 else ''} per replica, {s.tokens_per_step:,} tokens, "
        f"{_num(s.step_s)} s = compute {_num(s.compute_s)} + exposed ring {_num(s.ring_s)}, "
        f"ulysses {_num(s.ulysses_s)}, ZeRO {_num(s.zero_s)}, offload {_num(s.offload_s)}",
        f"  sent per GPU and step (GB): ring K/V {_gb(steps * t.ring_per_micro(model))}, "
        f"Ulysses all-to-all {_gb(steps * n_layers * t.ulysses)}, "
        f"ZeRO {_gb(steps * t.zero_per_micro + t.zero_per_step)}, PCIe {_gb(t.pcie_per_step)}",
        f"  run: ringtrain run {job_path} {' '.join(c.layout.overrides())}",
    ]


def render(plan: Plan, *, top: int) -> str:
    lines = header(plan)
    fitting = plan.fitting
    lines.append("")
    if plan.job_layout is not None:
        j = plan.job_layout
        verdict = "fits" if j.fits else "does NOT fit"
        lines.append(
            f"the job's layout ({j.layout.describe()}) {verdict}: {_gb(j.memory.total)} GB per GPU, "
            f"{j.step.tokens_per_s:,.0f} tokens/s"
        )
    if fitting:
        lines.append(f"{len(fitting)} of {len(plan.candidates)} layouts fit; the fastest {min(top, len(fitting))}:")
        lines += table([_row(str(i + 1), c) for i, c in enumerate(fitting[:top])])
        lines.append("")
        lines += breakdown(fitting[0], plan.cluster, plan.workload.model, title="best", job_path=plan.job_path)
    else:
        lines.append(f"no layout of {plan.cluster.gpus} GPUs fits ({len(plan.candidates)} tried):")
        lines += [f"  - {line}" for line in plan.advice]
    return "\n".join(lines)


def candidate_record(c: Candidate, model: ModelSpec) -> dict[str, Any]:
    lay, m, s, t, n_layers = c.layout, c.memory, c.step, c.step.traffic, model.n_layers
    return {
        "layout": {
            "dp": lay.dp,
            "cp": lay.cp,
            "ring": lay.ring,
            "ulysses": lay.ulysses,
            "impl": lay.impl,
            "zero_stage": lay.zero_stage,
            "activation_checkpointing": lay.checkpointing,
            "offload_optimizer": lay.offload_optimizer,
            "offload_params": lay.offload_params,
            "micro_batch": lay.micro_batch,
            "checkpointing_mode": lay.checkpointing_mode,
            "activation_offload_layers": lay.offload_layers,
            "mlp_tiles": lay.mlp_tiles,
            "loss_chunk_tokens": lay.loss_chunk,
            "overrides": lay.overrides(),
        },
        "fits": c.fits,
        "memory_bytes": _memory_record(m),
        "step": {
            "micro_batches": s.micro_batches,
            "tokens_per_step": s.tokens_per_step,
            "step_s": s.step_s,
            "compute_s": s.compute_s,
            "ring_s": s.ring_s,
            "ulysses_s": s.ulysses_s,
            "zero_s": s.zero_s,
            "offload_s": s.offload_s,
            "tokens_per_s": s.tokens_per_s,
            "mfu": s.mfu,
        },
        "bytes_sent_per_step": {
            "ring": s.micro_batches * t.ring_per_micro(model),
            "ulysses": s.micro_batches * n_layers * t.ulysses,
            "zero": s.micro_batches * t.zero_per_micro + t.zero_per_step,
            "pcie": t.pcie_per_step,
        },
    }


def _memory_record(m: MemoryEstimate) -> dict[str, int]:
    return {
        "params": m.params,
        "grads": m.grads,
        "optimizer": m.optimizer,
        "zero_buffers": m.zero_buffers,
        "activations": m.activations,
        "kept_by_layers": m.kept_by_layers,
        "logits_and_loss": m.logits_and_loss,
        "received_kv": m.received_kv,
        "token_losses": m.token_losses,
        "reference_pass": m.reference_pass,
        "total": m.total,
        "host": m.host,
    }


def plan_record(plan: Plan, *, top: int) -> dict[str, Any]:
    w, c, a = plan.workload, plan.cluster, plan.assume
    n_layers = w.model.n_layers
    model_flops, _ = flops_per_token(w.model, w.seq_len, checkpointing=False)
    return {
        "model": {
            "name": w.model.name,
            "num_params": w.model.num_params,
            "vocab_size": w.model.vocab_size,
            "dim": w.model.dim,
            "n_layers": n_layers,
            "n_heads": w.model.n_heads,
            "n_kv_heads": w.model.n_kv_heads,
            "ffn_dim": w.model.ffn_dim,
            "num_windowed_layers": w.model.num_windowed_layers,
            "window": w.model.window,
        },
        "flops_per_token": {
            "model": model_flops,
            "attention": attention_flops_per_token(w.model, w.seq_len),
            "attention_if_full": attention_flops_per_token(_unwindowed(w.model), w.seq_len),
        },
        "seq_len": w.seq_len,
        "objective": w.objective,
        "longest_pair": PairFit.of(w.seq_len, plan.completion_tokens).record() if keeps_token_losses(w.objective) else None,
        "dtype": w.dtype,
        "flash_attention": w.flash,
        "global_batch": w.global_batch,
        "global_batch_tokens": w.global_batch_tokens,
        "gpus": c.gpus,
        "gpus_per_node": c.gpus_per_node,
        "gpu_type": c.device.name,
        "usable_bytes_per_gpu": c.usable_bytes,
        "assumptions": {
            "mfu": a.mfu,
            "link_efficiency": a.link_efficiency,
            "host_memory_efficiency": a.host_memory_efficiency,
            "headroom": c.headroom,
            "optimizer_bytes": w.precision(1).optimizer_bytes,
        },
        "num_layouts": len(plan.candidates),
        "num_fitting": len(plan.fitting),
        "layouts": [candidate_record(x, w.model) for x in plan.fitting[:top]],
        "job_layout": candidate_record(plan.job_layout, w.model) if plan.job_layout else None,
        "advice": plan.advice,
    }


STATE_COLUMNS = ("ZeRO", "offload", "params", "grads", "optimizer", "buffers", "GB/GPU", "fits", "fewest GPUs")


def states_table(rows: list[tuple[Layout, MemoryEstimate, bool, Optional[int]]]) -> list[str]:
    """Model states per ZeRO stage for a model known only by its parameter count."""
    cells = [
        (
            str(lay.zero_stage),
            "optimizer" if lay.offload_optimizer else "-",
            _gb(m.params),
            _gb(m.grads),
            _gb(m.optimizer),
            _gb(m.zero_buffers),
            _gb(m.total),
            "yes" if ok else "no",
            str(need) if need is not None else "-",
        )
        for lay, m, ok, need in rows
    ]
    widths = [max(len(r[i]) for r in [STATE_COLUMNS, *cells]) for i in range(len(STATE_COLUMNS))]
    out = []
    for r in [STATE_COLUMNS, *cells]:
        out.append(
            "  ".join(v.rjust(w) if i not in (1, 7) else v.ljust(w) for i, (v, w) in enumerate(zip(r, widths))).rstrip()
        )
    return out


def _host_line(cluster: Cluster) -> str:
    d = cluster.device
    return (
        f"host memory: {_gb(d.host_memory_bytes)} GB per node of {cluster.gpus_per_node} GPUs ({d.name}'s reference "
        f"system), shared by their offloaded activations, optimizer states and parameters; PCIe {_gb(d.pcie_bw)} GB/s per GPU each way"
    )


REACH_COLUMNS = ("#", "max seq", "dp", "cp", "ring", "ulysses", "ZeRO", "savers", "GB/GPU", "host GB/node", "tokens/s")
# Under a preference objective the longest sequence is a row of pairs, and the pair it holds is
# told by its prompt per pair layout (planner/preference.py).
PAIR_COLUMNS = ("max row", "prompt, shared", "prompt, 2 docs")


def render_reach(
    workload: Workload, cluster: Cluster, reach: list[Reach], *, top: int,
    completion_tokens: int = DEFAULT_COMPLETION_TOKENS,
) -> str:  # fmt: skip
    """``ringtrain plan --max-seq-len``: the longest sequence per layout, longest first; under a
    preference objective, the longest row of pairs and the longest pair's prompt in it."""
    w = workload
    pairs = keeps_token_losses(w.objective)
    flag = f" --objective {w.objective}" if pairs else ""
    lines = [
        f"ringtrain plan --max-seq-len{flag}: {w.model.name}, {format_count(w.model.num_params)} params, "
        f"{cluster.gpus} x {cluster.device.name}, {w.dtype}, one {'row of pairs' if pairs else 'sequence'} per replica",
        f"assumptions: {_gb(cluster.usable_bytes)} of {_gb(cluster.device.memory_bytes)} GB usable per GPU; "
        + _host_line(cluster),
    ]
    if pairs:
        lines.append(
            f"a pair of a P-token prompt and two {completion_tokens:,}-token completions (--completion-tokens) takes P + "
            f"{2 * completion_tokens + 1:,} tokens of a row with its prompt shared (data.prefix_sharing=true), 2P + "
            f"{2 * completion_tokens:,} as two documents; the loss keeps each token's log-prob"
            + ("; the reference pass before step 1 is forward only" if needs_reference(w.objective) else "")
        )
    lines.append("")
    if not reach:
        return "\n".join(lines + ["no layout fits even the shortest sequence tried (2 x cp x 64 tokens)"])
    columns = (REACH_COLUMNS[0], *PAIR_COLUMNS, *REACH_COLUMNS[2:]) if pairs else REACH_COLUMNS
    rows = []
    for i, r in enumerate(reach[:top]):
        c, lay = r.candidate, r.candidate.layout
        host = c.memory.host * min(cluster.gpus, cluster.gpus_per_node)
        fit = PairFit.of(r.max_seq_len, completion_tokens)
        lengths = [f"{r.max_seq_len:,}"] + ([f"{fit.shared_prompt:,}", f"{fit.two_documents_prompt:,}"] if pairs else [])
        rows.append(
            (str(i + 1), *lengths, str(lay.dp), str(lay.cp), str(lay.ring), str(lay.ulysses),
             str(lay.zero_stage), lay.saver_column(), _gb(c.memory.total), _gb(host), f"{c.step.tokens_per_s:,.0f}")
        )
    widths = [max(len(r[i]) for r in [columns, *rows]) for i in range(len(columns))]
    left = columns.index("savers")
    for r in [columns, *rows]:
        lines.append("  ".join(v.ljust(w) if i == left else v.rjust(w) for i, (v, w) in enumerate(zip(r, widths))).rstrip())
    best, longest = reach[0].candidate, reach[0].max_seq_len
    run = f"run: ringtrain run JOB.yaml{' train.objective=' + w.objective if pairs else ''} data.seq_len={longest} {' '.join(best.layout.overrides())}"
    if not pairs:
        return "\n".join(lines + ["", f"longest: {longest:,} tokens; {run}"])
    lines += ["", f"longest pair: a {longest:,}-token row, {_pair_words(PairFit.of(longest, completion_tokens))}"]
    if best.memory.reference_pass:
        lines.append(f"reference pass: its activations peak at {_gb(best.memory.reference_pass)} GB per GPU, the step's at "
                     f"{_gb(best.memory.activations)}")  # fmt: skip
    return "\n".join(lines + [run])


def reach_record(
    workload: Workload, cluster: Cluster, reach: list[Reach], *, top: int,
    completion_tokens: int = DEFAULT_COMPLETION_TOKENS,
) -> dict[str, Any]:  # fmt: skip
    """``--max-seq-len --json``: ``max_seq_len`` per layout, with the host-memory assumption;
    under a preference objective, each layout's longest pair (``longest_pair``) too."""
    pairs = keeps_token_losses(workload.objective)

    def pair(row: int) -> dict[str, Any]:
        return {"longest_pair": PairFit.of(row, completion_tokens).record()} if pairs else {}

    return {
        "model": {"name": workload.model.name, "num_params": workload.model.num_params},
        "dtype": workload.dtype,
        "objective": workload.objective,
        "gpus": cluster.gpus,
        "gpus_per_node": cluster.gpus_per_node,
        "gpu_type": cluster.device.name,
        "usable_bytes_per_gpu": cluster.usable_bytes,
        "host_memory_bytes_per_node": cluster.device.host_memory_bytes,
        "pcie_bytes_per_s": cluster.device.pcie_bw,
        "max_seq_len": reach[0].max_seq_len if reach else 0,
        **pair(reach[0].max_seq_len if reach else 0),
        "layouts": [{"max_seq_len": r.max_seq_len, **pair(r.max_seq_len), **candidate_record(r.candidate, workload.model)}
                    for r in reach[:top]],
    }
