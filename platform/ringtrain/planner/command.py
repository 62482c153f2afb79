"""`ringtrain plan` and the pre-launch fit check: the planner's only door to the command line.

``add_arguments`` fills the ``plan`` subcommand's parser and ``run`` executes it: exit 0 with
the plan (text, or ``--json``), exit 2 with one line naming the flag or config key on bad
input. ``fit_warning`` is the check ``ringtrain run`` makes before it launches a job.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
from dataclasses import dataclass
from typing import Any, Callable, Optional

from ringtrain import config
from ringtrain.config import JobConfig
from ringtrain.errors import ConfigError
from ringtrain.planner import devices
from ringtrain.planner.devices import GB
from ringtrain.planner.layout import DTYPES, Layout, Workload, layout_of, precision, resolve_dtype, workload_of
from ringtrain.planner.memory import MemoryEstimate, states_estimate
from ringtrain.planner.models import PRESETS, preset
from ringtrain.planner.render import Plan, format_count, plan_record, reach_record, render, render_reach, states_table
from ringtrain.planner.search import (
    MAX_GPUS,
    Candidate,
    Cluster,
    advise,
    cluster_sizes,
    evaluate,
    fewest_gpus,
    fits,
    max_seq_len,
    search,
)
from ringtrain.planner.throughput import Assumptions

EXIT_OK, EXIT_USAGE = 0, 2
# Without a job file the global batch is this many tokens (at least one sequence): Llama 3's
# initial pre-training batch (Dubey et al. 2024, "The Llama 3 Herd of Models", section 3.4.1).
DEFAULT_GLOBAL_BATCH_TOKENS = 4 * 2**20
_SUFFIXES = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "t": 10**12}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``plan`` subcommand's arguments. Values are parsed in ``run`` so errors stay one line."""
    parser.add_argument("job", nargs="?", help="job YAML to plan for (its model, sequence, batch and mesh)")
    parser.add_argument("overrides", nargs="*", help="key=value config overrides, as for `ringtrain run`")
    parser.add_argument("--model", help=f"a preset instead of a job file: {', '.join(PRESETS)}")
    parser.add_argument("--params", help="only a parameter count (e.g. 70e9 or 70B): model states per ZeRO stage")
    parser.add_argument("--seq-len", help="tokens per sequence (default: the job's data.seq_len)")
    parser.add_argument("--gpus", help="GPUs to plan for (default: the job's dp x cp, else 8)")
    parser.add_argument("--gpu-type", default="h100", help=f"one of {', '.join(devices.DEVICES)} (default h100)")
    parser.add_argument("--gpus-per-node", default="8", help="GPUs per node (default 8)")
    parser.add_argument("--dtype", help="bf16 or fp32 training (default: the job's train.dtype on a GPU, else bf16)")
    parser.add_argument("--micro-batch", help="sequences per micro batch (default: the job's, else 1)")
    parser.add_argument(
        "--global-batch",
        help="sequences per optimizer step (default: the job's train.global_batch, "
        f"else {DEFAULT_GLOBAL_BATCH_TOKENS:,} tokens' worth)",
    )
    parser.add_argument("--mfu", default="0.45", help="assumed fraction of peak FLOP/s reached (default 0.45)")
    parser.add_argument(
        "--optimizer-bytes", help="optimizer state bytes per parameter, K (default 12 with bf16: fp32 master, m, v)"
    )
    parser.add_argument("--headroom", default="0.1", help="fraction of GPU memory kept free (default 0.1)")
    parser.add_argument("--no-flash", action="store_true", help="plan for the unfused 'math' attention kernel")
    parser.add_argument("--top", default="10", help="layouts to list (default 10)")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.add_argument(
        "--max-seq-len",
        action="store_true",
        help="the longest sequence that fits per layout (with the long-context savers), instead of a plan at --seq-len",
    )


JobLoader = Callable[[Optional[str], list[str]], JobConfig]


def run(args: argparse.Namespace, load_job: JobLoader = config.load) -> int:
    """Execute ``ringtrain plan``; prints the plan and returns the exit code. ``load_job`` reads
    the job file (the CLI's also reads a ``model.hf`` folder's config.json when there is one)."""
    try:
        text = _plan_text(args, load_job)
    except ConfigError as exc:
        print(f"ringtrain: config error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    print(text)
    return EXIT_OK


def fit_warning(job: JobConfig, device_type: str) -> Optional[str]:
    """A one-line warning when ``job``'s layout is predicted not to fit on ``device_type``, else None.

    ``device_type`` is "cpu" (host memory is not checked: None), "cuda" (an 80 GB H100 is
    assumed) or a GPU type of the device table.
    """
    if device_type == "cpu":
        return None
    try:
        device = devices.device(device_type, key="cluster.device")
    except ConfigError:
        device = devices.H100
    workload = workload_of(job, "cuda")
    cluster = Cluster(device, job.world_size)
    assume = Assumptions()
    mine = evaluate(workload, layout_of(job), cluster, assume)
    if mine.fits:
        return None
    m = mine.memory
    line = (
        f"ringtrain: warning: predicted peak {m.total / GB:.1f} GB per GPU exceeds the "
        f"{cluster.usable_bytes / GB:.1f} GB usable on an {device.memory_bytes / GB:.0f} GB {device.name} "
        f"(activations {m.activations / GB:.1f}, model states {m.model_states / GB:.1f}, "
        f"ZeRO buffers {m.zero_buffers / GB:.1f})"
    )
    host_per_node = m.host * min(cluster.gpus, cluster.gpus_per_node)
    if host_per_node > device.host_memory_bytes:
        line += f", host memory {host_per_node / GB:.0f} GB per node"
    ranked = search(workload, cluster, assume, micro_batch=job.train.micro_batch)
    if ranked and ranked[0].fits:
        return line + f"; predicted to fit: {' '.join(ranked[0].layout.overrides())}"
    more = fewest_gpus(workload, cluster, assume, micro_batch=job.train.micro_batch)
    if more is not None:
        return line + f"; no layout of {job.world_size} GPUs fits, {more.layout.world} would ({more.layout.describe()})"
    return line + f"; no layout fits on up to {MAX_GPUS} GPUs"


@dataclass(frozen=True)
class _Request:
    cluster: Cluster
    assume: Assumptions
    micro_batch: int
    top: int
    as_json: bool


def _plan_text(args: argparse.Namespace, load_job: JobLoader) -> str:
    sources = [
        name for name, given in (("a job file", args.job), ("--model", args.model), ("--params", args.params)) if given
    ]
    if len(sources) != 1:
        which = " and ".join(sources) if sources else "none"
        raise ConfigError("--model", f"give exactly one of a job file, --model or --params (got {which})")
    if args.overrides and not args.job:
        raise ConfigError(args.overrides[0], "key=value overrides apply to a job file; give one first")
    job = load_job(args.job, args.overrides) if args.job else None

    device = devices.device(args.gpu_type)
    gpus = _int(args.gpus, "--gpus") if args.gpus is not None else (job.world_size if job else 8)
    per_node = _int(args.gpus_per_node, "--gpus-per-node")
    headroom = _fraction(args.headroom, "--headroom", upper_open=True)
    mfu = _fraction(args.mfu, "--mfu", lower_open=True)
    micro_batch = job.train.micro_batch if job else 1
    if args.micro_batch is not None:
        micro_batch = _int(args.micro_batch, "--micro-batch")
    request = _Request(
        cluster=Cluster(device, gpus, per_node, headroom),
        assume=Assumptions(mfu=mfu, gpus_per_node=per_node),
        micro_batch=micro_batch,
        top=_int(args.top, "--top"),
        as_json=bool(args.json),
    )
    optimizer_bytes = None
    if args.optimizer_bytes is not None:
        optimizer_bytes = _int(args.optimizer_bytes, "--optimizer-bytes", minimum=0)
    dtype = _dtype(args.dtype, job)
    if args.params:
        return _states_plan(_count(args.params), dtype, optimizer_bytes, request)

    if job is not None:
        base = workload_of(job, "cuda", optimizer_bytes=optimizer_bytes)
        # The run line repeats the user's overrides; the layout's own come after them and win.
        model, seq, name = base.model, base.seq_len, " ".join([args.job, *args.overrides])
    else:
        model, seq, name = preset(args.model), 0, "JOB.yaml"
    if args.seq_len is not None:
        seq = _int(args.seq_len, "--seq-len")
    if getattr(args, "max_seq_len", False):
        return _reach_text(model, dtype, optimizer_bytes, not args.no_flash and (job is None or job.attention.kernel != "math"), request)
    if seq == 0:
        raise ConfigError("--seq-len", "is required with --model")
    if args.global_batch is not None:
        global_batch = _int(args.global_batch, "--global-batch")
    else:
        global_batch = job.train.global_batch if job is not None else max(1, DEFAULT_GLOBAL_BATCH_TOKENS // seq)
    flash = not args.no_flash and (job is None or job.attention.kernel != "math")
    workload = Workload(model, seq, dtype, flash, optimizer_bytes, global_batch)

    job_layout = _job_candidate(job, workload, request)
    plan = _make_plan(workload, request, job_layout, name)
    if request.as_json:
        return json.dumps(plan_record(plan, top=request.top), indent=2)
    return render(plan, top=request.top)


def _reach_text(model: Any, dtype: str, optimizer_bytes: Optional[int], flash: bool, request: _Request) -> str:
    """``--max-seq-len``: one sequence per replica (the global batch is dp sequences)."""
    workload = Workload(model, 0, dtype, flash, optimizer_bytes, global_batch=request.cluster.gpus)
    reach = max_seq_len(workload, request.cluster, request.assume, micro_batch=request.micro_batch)
    if request.as_json:
        return json.dumps(reach_record(workload, request.cluster, reach, top=request.top), indent=2)
    return render_reach(workload, request.cluster, reach, top=request.top)


def _make_plan(workload: Workload, request: _Request, job_layout: Optional[Candidate], job_path: str) -> Plan:
    ranked = search(workload, request.cluster, request.assume, micro_batch=request.micro_batch)
    advice: list[str] = []
    if not any(c.fits for c in ranked):
        advice = advise(workload, request.cluster, request.assume, ranked, micro_batch=request.micro_batch)
    return Plan(workload, request.cluster, request.assume, ranked, job_layout, job_path, advice)


def _job_candidate(job: Optional[JobConfig], workload: Workload, request: _Request) -> Optional[Candidate]:
    """The job's own layout, when it is one of the layouts planned (same GPU count, valid sequence)."""
    if job is None or job.world_size != request.cluster.gpus or workload.seq_len % (2 * job.mesh.cp):
        return None
    layout = dataclasses.replace(layout_of(job), micro_batch=request.micro_batch)
    return evaluate(workload, layout, request.cluster, request.assume)


def _states_plan(num_params: int, dtype: str, optimizer_bytes: Optional[int], request: _Request) -> str:
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


def _dtype(value: Optional[str], job: Optional[JobConfig]) -> str:
    if value is None:
        return resolve_dtype(job, "cuda") if job is not None else "bf16"
    if value not in DTYPES:
        raise ConfigError("--dtype", f"{value!r} is not one of {', '.join(DTYPES)}")
    return value


def _int(value: str, flag: str, *, minimum: int = 1) -> int:
    try:
        number = int(value.replace("_", "").replace(",", ""))
    except ValueError:
        raise ConfigError(flag, f"{value!r} is not a whole number") from None
    if number < minimum:
        raise ConfigError(flag, f"must be >= {minimum} (got {number})")
    return number


def _fraction(value: str, flag: str, *, lower_open: bool = False, upper_open: bool = False) -> float:
    try:
        number = float(value)
    except ValueError:
        raise ConfigError(flag, f"{value!r} is not a number") from None
    low_ok = number > 0 if lower_open else number >= 0
    high_ok = number < 1 if upper_open else number <= 1
    if not (low_ok and high_ok):
        bounds = f"{'(' if lower_open else '['}0, 1{')' if upper_open else ']'}"
        raise ConfigError(flag, f"must be in {bounds} (got {value})")
    return number


def _count(value: str) -> int:
    """A parameter count: 70000000000, 70e9, 70B or 8.03b (suffixes k, m, b, t)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([kmbt]?)\s*", value.lower())
    if match is None:
        raise ConfigError("--params", f"{value!r} is not a parameter count (e.g. 70e9, 70B, 8.03b)")
    count = int(float(match.group(1)) * _SUFFIXES[match.group(2)])
    if count < 1:
        raise ConfigError("--params", f"must be >= 1 (got {value})")
    return count
