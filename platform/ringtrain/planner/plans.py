"""A plan from parsed inputs: the layouts of a workload ranked, model states from a parameter
count alone, the longest sequence per layout; as text or JSON (``Request.as_json``).

``commands/plan.py`` turns the command line into a ``Request`` and a workload; everything here
is the planner's own arithmetic and rendering.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any, Optional

from ringtrain.config import JobConfig, ZeroConfig
from ringtrain.planner.devices import GB
from ringtrain.planner.layout import Layout, Workload, layout_of, precision
from ringtrain.planner.memory import MemoryEstimate, states_estimate
from ringtrain.planner.preference import DEFAULT_COMPLETION_TOKENS
from ringtrain.planner.render import Plan, format_count, plan_record, reach_record, render, render_reach, states_table
from ringtrain.planner.search import (
    Candidate,
    Cluster,
    advise,
    cluster_sizes,
    evaluate,
    fits,
    max_seq_len,
    search,
)
from ringtrain.planner.throughput import Assumptions


@dataclass(frozen=True)
class Request:
    cluster: Cluster
    assume: Assumptions
    micro_batch: int
    top: int
    as_json: bool
    completion_tokens: int = DEFAULT_COMPLETION_TOKENS  # each completion of a pair (a preference objective)


def plan_text(workload: Workload, request: Request, job_layout: Optional[Candidate], job_path: str) -> str:
    """The ranked layouts of ``workload``, the best broken down (or what would fit)."""
    plan = _make_plan(workload, request, job_layout, job_path)
    if request.as_json:
        return json.dumps(plan_record(plan, top=request.top), indent=2)
    return render(plan, top=request.top)


def reach_text(
    model: Any, dtype: str, optimizer_bytes: Optional[int], flash: bool, request: Request, objective: str = "lm",
    *, zero: ZeroConfig,
) -> str:
    """``--max-seq-len``: one sequence (a row of pairs, under a preference objective) per replica
    (the global batch is dp sequences); ``zero``: the job's buffer sizes."""
    workload = Workload(model, 0, dtype, flash, optimizer_bytes, global_batch=request.cluster.gpus, objective=objective,
                        zero=zero)  # fmt: skip
    reach = max_seq_len(workload, request.cluster, request.assume, micro_batch=request.micro_batch)
    if request.as_json:
        record = reach_record(workload, request.cluster, reach, top=request.top, completion_tokens=request.completion_tokens)
        return json.dumps(record, indent=2)
    return render_reach(workload, request.cluster, reach, top=request.top, completion_tokens=request.completion_tokens)


def _make_plan(workload: Workload, request: Request, job_layout: Optional[Candidate], job_path: str) -> Plan:
    ranked = search(workload, request.cluster, request.assume, micro_batch=request.micro_batch)
    advice: list[str] = []
    if not any(c.fits for c in ranked):
        advice = advise(workload, request.cluster, request.assume, ranked, micro_batch=request.micro_batch)
    return Plan(workload, request.cluster, request.assume, ranked, job_layout, job_path, advice, request.completion_tokens)


def job_candidate(job: Optional[JobConfig], workload: Workload, request: Request) -> Optional[Candidate]:
    """The job's own layout, when it is one of the layouts planned (same GPU count, valid sequence)."""
    if job is None or job.world_size != request.cluster.gpus or workload.seq_len % job.cp_layout.sequence_multiple:
        return None
    layout = dataclasses.replace(layout_of(job), micro_batch=request.micro_batch)
    return evaluate(workload, layout, request.cluster, request.assume)


def states_plan(num_params: int, dtype: str, optimizer_bytes: Optional[int], request: Request) -> str:
    """Model states per ZeRO stage over all GPUs, for a model known only by its parameter count."""
    cluster = request.cluster
    rows: list[tuple[Layout, MemoryEstimate, bool, Optional[int]]] = []
    for stage in (0, 1, 2, 3):
        for offload in (False, True) if stage >= 1 else (False,):
            layout = Layout(cluster.gpus, 1, 1, stage, False, offload_optimizer=offload)
            prec = precision(dtype, stage, optimizer_bytes)
            memory = states_estimate(num_params, layout, prec)
            rows.append(
                (
                    layout,
                    memory,
                    fits(memory, cluster),
                    _fewest_for_states(num_params, layout, dtype, optimizer_bytes, cluster),
                )
            )
    if request.as_json:
        record: dict[str, Any] = {
            "num_params": num_params,
            "dtype": dtype,
            "gpus": cluster.gpus,
            "gpus_per_node": cluster.gpus_per_node,
            "gpu_type": cluster.device.name,
            "usable_bytes_per_gpu": cluster.usable_bytes,
            "activations_included": False,
            "stages": [
                {
                    "zero_stage": lay.zero_stage,
                    "offload_optimizer": lay.offload_optimizer,
                    "memory_bytes": {
                        "params": m.params,
                        "grads": m.grads,
                        "optimizer": m.optimizer,
                        "zero_buffers": m.zero_buffers,
                        "total": m.total,
                        "host": m.host,
                    },
                    "fits": ok,
                    "fewest_gpus": need,
                }
                for lay, m, ok, need in rows
            ],
        }
        return json.dumps(record, indent=2)
    prec = precision(dtype, 1, optimizer_bytes)
    lines = [
        f"ringtrain plan: a {format_count(num_params)}-parameter model, model states only, {cluster.gpus} x "
        f"{cluster.device.name} ({cluster.gpus_per_node} per node)",
        f"assumptions: {dtype} params and grads, {prec.optimizer_bytes} B/param optimizer state"
        f"{' at ZeRO 1-3 (8 at ZeRO-0)' if dtype == 'fp32' and optimizer_bytes is None else ''}; ZeRO over all "
        f"{cluster.gpus} GPUs; {cluster.usable_bytes / GB:.1f} of {cluster.device.memory_bytes / GB:.1f} GB usable "
        f"({cluster.headroom:.0%} headroom); activations not included: give a job file or --model for them",
        "",
        *states_table(rows),
    ]
    return "\n".join(lines)


def _fewest_for_states(
    num_params: int, layout: Layout, dtype: str, optimizer_bytes: Optional[int], cluster: Cluster
) -> Optional[int]:
    prec = precision(dtype, layout.zero_stage, optimizer_bytes)
    for gpus in cluster_sizes(cluster.gpus_per_node):
        trial = Layout(gpus, 1, 1, layout.zero_stage, False, offload_optimizer=layout.offload_optimizer)
        if fits(states_estimate(num_params, trial, prec), cluster.with_gpus(gpus)):
            return gpus
        if layout.zero_stage == 0 and not layout.offload_optimizer:
            return None  # nothing is partitioned: more GPUs never help
    return None
