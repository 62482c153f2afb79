"""`ringtrain plan`: the planner's flags, read into a request; the plan itself is ``planner.plans``.

``add_arguments`` fills the ``plan`` subcommand's parser and ``run`` executes it: exit 0 with
the plan (text, or ``--json``), exit 2 with one line naming the flag or config key on bad
input. The check ``ringtrain run`` makes before it launches a job is ``planner.fit``.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Callable, Optional

from ringtrain import config
from ringtrain.config import JobConfig
from ringtrain.errors import ConfigError
from ringtrain.planner import devices
from ringtrain.planner.layout import DTYPES, Workload, resolve_dtype, workload_of
from ringtrain.planner.models import PRESETS, preset
from ringtrain.planner.plans import Request, job_candidate, plan_text, reach_text, states_plan
from ringtrain.planner.search import Cluster
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


def load_job(path: Optional[str], overrides: list[str]) -> JobConfig:
    """The job file with overrides, its model read from ``model.hf`` when that folder is here
    (a recipe planned on a laptop names a folder only the cluster has: its own keys stand)."""
    from ringtrain.hf import resolve_job

    job = config.load(path, overrides)
    return resolve_job(job) if job.model.hf and Path(job.model.hf).is_dir() else job


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
    request = Request(
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
        return states_plan(_count(args.params), dtype, optimizer_bytes, request)

    if job is not None:
        base = workload_of(job, "cuda", optimizer_bytes=optimizer_bytes)
        # The run line repeats the user's overrides; the layout's own come after them and win.
        model, seq, name = base.model, base.seq_len, " ".join([args.job, *args.overrides])
    else:
        model, seq, name = preset(args.model), 0, "JOB.yaml"
    if args.seq_len is not None:
        seq = _int(args.seq_len, "--seq-len")
    if getattr(args, "max_seq_len", False):
        return reach_text(model, dtype, optimizer_bytes, not args.no_flash and (job is None or job.attention.kernel != "math"), request)
    if seq == 0:
        raise ConfigError("--seq-len", "is required with --model")
    if args.global_batch is not None:
        global_batch = _int(args.global_batch, "--global-batch")
    else:
        global_batch = job.train.global_batch if job is not None else max(1, DEFAULT_GLOBAL_BATCH_TOKENS // seq)
    flash = not args.no_flash and (job is None or job.attention.kernel != "math")
    workload = Workload(model, seq, dtype, flash, optimizer_bytes, global_batch)
    return plan_text(workload, request, job_candidate(job, workload, request), name)


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
