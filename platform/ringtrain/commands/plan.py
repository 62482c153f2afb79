"""`ringtrain plan`: the planner's flags, read into a request; the plan itself is ``planner.plans``.

``add_arguments`` fills the ``plan`` subcommand's parser and ``run`` executes it: exit 0 with
the plan (text, or ``--json``), exit 2 with one line naming the flag or config key on bad
input. The check ``ringtrain run`` makes before it launches a job is ``planner.fit``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import sys
import time
from pathlib import Path
from typing import Callable, Optional

from ringtrain import config
from ringtrain.commands.destination import check_writable
from ringtrain.config import OBJECTIVES, PREFERENCE_OBJECTIVES, JobConfig
from ringtrain.errors import EXIT_OK, ConfigError, end
from ringtrain.planner import devices, goodput_report
from ringtrain.planner.failures import PROFILES, profile
from ringtrain.planner.goodput import MODES, Costs, Job
from ringtrain.planner.layout import DTYPES, Workload, resolve_dtype, workload_of
from ringtrain.planner.models import PRESETS, preset
from ringtrain.planner.plans import Request, job_candidate, plan_text, reach_text, states_plan
from ringtrain.planner.preference import DEFAULT_COMPLETION_TOKENS, keeps_token_losses
from ringtrain.planner.reach import MAX_TOKENS
from ringtrain.planner.search import MAX_GPUS, Cluster, advise, search
from ringtrain.planner.throughput import Assumptions

# Without a job file the global batch is this many tokens (at least one sequence): Llama 3's
# initial pre-training batch (Dubey et al. 2024, "The Llama 3 Herd of Models", section 3.4.1).
DEFAULT_GLOBAL_BATCH_TOKENS = 4 * 2**20
_SUFFIXES = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "t": 10**12}
# Bounds on what a person plans: past them a plan is no plan (a hang, or figures past any
# machine), so they are refused (exit 2) and stated in the help.
MAX_PARAMS = 10**15
MAX_DAYS = 365.0
MAX_SEEDS = 100
# Failures one simulated run may hold (its days x the profile's rate x the GPUs): the runs are
# event by event, and past this a study would run for hours.
MAX_FAILURES_PER_RUN = 100_000
# A study that runs longer than this says how far it got, every PROGRESS_EVERY_S.
PROGRESS_AFTER_S = 3.0
PROGRESS_EVERY_S = 5.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``plan`` subcommand's arguments. Values are parsed in ``run`` so errors stay one line."""
    parser.add_argument("job", nargs="?", help="job YAML to plan for (its model, sequence, batch and mesh)")
    parser.add_argument("overrides", nargs="*", help="key=value config overrides, as for `ringtrain run`")
    parser.add_argument("--model", help=f"a preset instead of a job file: {', '.join(PRESETS)}")
    parser.add_argument(
        "--params", help=f"only a parameter count (e.g. 70e9 or 70B, at most {MAX_PARAMS:.0e}): model states per ZeRO stage"
    )
    parser.add_argument("--seq-len", help="tokens per sequence (default: the job's data.seq_len)")
    parser.add_argument("--gpus", help=f"GPUs to plan for, at most {MAX_GPUS:,} (default: the job's dp x cp, else 8)")
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
    parser.add_argument(
        "--objective",
        help=f"what a step minimises: {', '.join(OBJECTIVES)} (default: the job's train.objective, else lm); a "
        "preference objective trains rows of whole pairs, and --max-seq-len then gives the longest pair",
    )
    parser.add_argument(
        "--completion-tokens",
        help=f"with a preference objective: each completion's tokens, for the longest prompt a row holds "
        f"(default {DEFAULT_COMPLETION_TOKENS:,})",
    )
    goodput = parser.add_argument_group("goodput under failures (--goodput; docs/planner.md)")
    goodput.add_argument("--goodput", action="store_true", help="simulate the job's goodput under failures instead")
    goodput.add_argument("--failures", default="llama3", help=f"a failure profile ({', '.join(PROFILES)}) or a JSON file of rates")
    goodput.add_argument("--recovery", default="ringtrain", help=f"how failures are recovered from: {' or '.join(MODES)}")
    goodput.add_argument("--days", default="30", help=f"days simulated, at most {MAX_DAYS:g} (default 30)")
    goodput.add_argument(
        "--seeds", default="5", help=f"failure timelines simulated per setting, at most {MAX_SEEDS} (default 5)"
    )
    goodput.add_argument("--step-s", help="seconds a step takes (default: the planner's estimate for the layout)")
    goodput.add_argument("--costs", help="JSON file of recovery costs in seconds (planner.goodput.Costs' keys)")
    goodput.add_argument("--chart", help="write an SVG of goodput against the settings swept to this path")


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
        return end(exc)
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
    if args.goodput and (args.params or args.max_seq_len):
        raise ConfigError("--goodput", "simulates a job on a layout: give a job file or --model, without --params or --max-seq-len")
    if args.chart:
        check_writable(args.chart, "--chart")
    if args.params and (args.objective or args.completion_tokens):
        given = "--objective" if args.objective else "--completion-tokens"
        raise ConfigError(given, "plans activations, which --params leaves out: give a job file or --model")
    job = load_job(args.job, args.overrides) if args.job else None
    objective = _objective(args.objective, job)
    completion_tokens = DEFAULT_COMPLETION_TOKENS
    if args.completion_tokens is not None:
        if not keeps_token_losses(objective):
            raise ConfigError("--completion-tokens", f"sizes a preference pair: give --objective, one of {', '.join(PREFERENCE_OBJECTIVES)}")
        completion_tokens = _int(args.completion_tokens, "--completion-tokens", maximum=MAX_TOKENS)

    device = devices.device(args.gpu_type)
    gpus = _int(args.gpus, "--gpus", maximum=MAX_GPUS) if args.gpus is not None else (job.world_size if job else 8)
    per_node = _int(args.gpus_per_node, "--gpus-per-node", maximum=MAX_GPUS)
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
        completion_tokens=completion_tokens,
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
        model, seq, name, zero = base.model, base.seq_len, " ".join([args.job, *args.overrides]), base.zero
    else:
        model, seq, name, zero = preset(args.model), 0, "JOB.yaml", config.ZeroConfig()
    if args.seq_len is not None:
        seq = _int(args.seq_len, "--seq-len")
    flash = not args.no_flash and (job is None or job.attention.kernel != "math")
    if getattr(args, "max_seq_len", False):
        return reach_text(model, dtype, optimizer_bytes, flash, request, objective, zero=zero)
    if seq == 0:
        raise ConfigError("--seq-len", "is required with --model")
    if args.global_batch is not None:
        global_batch = _int(args.global_batch, "--global-batch")
    else:
        global_batch = job.train.global_batch if job is not None else max(1, DEFAULT_GLOBAL_BATCH_TOKENS // seq)
    workload = Workload(model, seq, dtype, flash, optimizer_bytes, global_batch, objective=objective, zero=zero)
    if args.goodput:
        return _goodput_text(args, job, workload, request, name)
    return plan_text(workload, request, job_candidate(job, workload, request), name)


def _goodput_text(args: argparse.Namespace, job: Optional[JobConfig], workload: Workload, request: Request, job_path: str) -> str:
    """The job's goodput under failures (``planner.goodput_report``): on the job's own layout
    when it has --gpus GPUs, else on the planner's best; in ringtrain mode every failure is
    decided by the Controller itself, replayed on a simulated cluster (``actors.decisions``).
    A job file's recovery settings (spares, min_dp, snapshot and persist cadence) apply. The
    best setting comes as a ``run:`` line of the job's keys, the layout's first."""
    if args.recovery not in MODES:
        raise ConfigError("--recovery", f"{args.recovery!r} is not one of {', '.join(MODES)}")
    failures = profile(args.failures)
    days = _positive(args.days, "--days", maximum=MAX_DAYS)
    seeds = _int(args.seeds, "--seeds", maximum=MAX_SEEDS)
    costs = _costs(args.costs)
    own = job_candidate(job, workload, request)
    ranked = [] if own is not None else search(workload, request.cluster, request.assume, micro_batch=request.micro_batch)
    picked = own or next((c for c in ranked if c.fits), None)
    if picked is None:
        why = advise(workload, request.cluster, request.assume, ranked, micro_batch=request.micro_batch)
        raise ConfigError("--gpus", f"no layout fits {workload.model.name} at {workload.seq_len} tokens on {request.cluster.gpus} GPUs: {'; '.join(why)}")
    dp, cp = picked.layout.dp, picked.layout.ring * picked.layout.ulysses
    step_s = _positive(args.step_s, "--step-s") if args.step_s is not None else picked.step.step_s
    step_from = "given" if args.step_s is not None else f"the planner's estimate at --mfu {request.assume.mfu:g}"
    settings = job
    sim = Job(
        dp=dp,
        gpus_per_replica=cp,
        step_s=step_s,
        gpus_per_node=request.cluster.gpus_per_node,
        min_dp=min(settings.mesh.min_dp, dp) if settings else 1,
        spares=settings.mesh.spares if settings else 0,
        snapshot_every=settings.checkpoint.snapshot_every if settings else 1,
        persist_every_s=settings.checkpoint.persist_every * step_s if settings and settings.checkpoint.persist_every else 1800.0,
        sdc_every_steps=settings.controllers.sdc_every_steps if settings else 100,
    )
    _check_failures_per_run(failures.total_per_gpu_hour, sim.gpus, days)
    decider = None
    if args.recovery == "ringtrain":
        from ringtrain.actors.decisions import ControllerDecisions

        decider = ControllerDecisions(_shape_job(settings, dp, cp, workload, request), gpus_per_node=request.cluster.gpus_per_node)
    done = goodput_report.study(
        sim, failures, costs, mode=args.recovery, days=days, seeds=seeds, decider=decider, on_run=StudyProgress()
    )
    replays = decider.replays if decider is not None else None
    name = job_path if job is not None else str(args.model)
    run = f"ringtrain run {job_path} {' '.join(picked.layout.overrides())}"
    if args.chart:
        Path(args.chart).write_text(goodput_report.chart(done) + "\n")
    if args.json:
        return json.dumps(goodput_report.record(done, name, step_from, replays, run), indent=2)
    text = goodput_report.text(done, name, step_from, replays, run)
    return text + (f"\nchart: {args.chart}" if args.chart else "")


def _check_failures_per_run(per_gpu_hour: float, gpus: int, days: float) -> None:
    """A study whose runs would hold more failures than MAX_FAILURES_PER_RUN is refused: it
    would run for hours (the failure profile or --days is then what to change)."""
    expected = per_gpu_hour * gpus * days * 24
    if expected > MAX_FAILURES_PER_RUN:
        raise ConfigError(
            "--failures",
            f"{expected:,.0f} failures expected in {days:g} days on {gpus:,} GPUs, more than the "
            f"{MAX_FAILURES_PER_RUN:,} a simulated run holds: lower --days or the profile's rates",
        )


class StudyProgress:
    """A long study's progress on stderr: nothing for its first PROGRESS_AFTER_S, then a line
    every PROGRESS_EVERY_S saying how many runs are done."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, out: Optional[Callable[[str], None]] = None) -> None:
        self.clock = clock
        self.out = out or (lambda line: print(line, file=sys.stderr, flush=True))
        self.started = clock()
        self.next_at = self.started + PROGRESS_AFTER_S

    def __call__(self, done: int, total: int) -> None:
        now = self.clock()
        if now < self.next_at or done == total:
            return
        self.next_at = now + PROGRESS_EVERY_S
        elapsed = now - self.started
        left = elapsed * (total - done) / done
        self.out(f"ringtrain plan: simulated {done} of {total} runs in {elapsed:.0f} s, about {left:.0f} s left")


def _shape_job(job: Optional[JobConfig], dp: int, cp: int, workload: Workload, request: Request) -> JobConfig:
    """The job the Controller decides for: the job file's settings (or the defaults) on the
    layout simulated."""
    base = job or config.JobConfig()
    shaped = dataclasses.replace(
        base,
        mesh=dataclasses.replace(base.mesh, dp=dp, cp=cp, ulysses=1, max_dp=None, min_dp=min(base.mesh.min_dp, dp)),
        train=dataclasses.replace(base.train, global_batch=workload.global_batch, micro_batch=request.micro_batch),
    )
    config.validate(shaped)
    return shaped


def _costs(path: Optional[str]) -> Costs:
    """Costs() with the keys a JSON file gives (seconds; snapshot_overhead a fraction)."""
    if path is None:
        return Costs()
    known = {f.name for f in dataclasses.fields(Costs)} - {"source"}
    try:
        given = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError("--costs", f"{path}: {exc}") from None
    unknown = sorted(set(given) - known) if isinstance(given, dict) else ["(not an object)"]
    if unknown:
        raise ConfigError("--costs", f"{path}: unknown keys {unknown}; the keys are {', '.join(sorted(known))}")
    try:
        values = {k: float(v) for k, v in given.items()}
    except (TypeError, ValueError) as exc:
        raise ConfigError("--costs", f"{path}: {exc}") from None
    bad = sorted(k for k, v in values.items() if not (math.isfinite(v) and v >= 0))
    if bad:
        raise ConfigError("--costs", f"{path}: {', '.join(bad)}: costs must be finite numbers >= 0")
    if values.get("save_s", Costs.save_s) <= 0:
        raise ConfigError("--costs", f"{path}: save_s must be > 0: a blocking save takes time")
    return dataclasses.replace(Costs(), **values, source=path)


def _positive(value: str, flag: str, *, maximum: float = math.inf) -> float:
    try:
        number = float(value)
    except ValueError:
        raise ConfigError(flag, f"{value!r} is not a number") from None
    if not (number > 0 and math.isfinite(number)):
        raise ConfigError(flag, f"must be a finite number > 0 (got {value})")
    if number > maximum:
        raise ConfigError(flag, f"must be at most {maximum:g} (got {value})")
    return number


def _objective(value: Optional[str], job: Optional[JobConfig]) -> str:
    if value is None:
        return job.train.objective if job is not None else "lm"
    if value not in OBJECTIVES:
        raise ConfigError("--objective", f"{value!r} is not one of {', '.join(OBJECTIVES)}")
    return value


def _dtype(value: Optional[str], job: Optional[JobConfig]) -> str:
    if value is None:
        return resolve_dtype(job, "cuda") if job is not None else "bf16"
    if value not in DTYPES:
        raise ConfigError("--dtype", f"{value!r} is not one of {', '.join(DTYPES)}")
    return value


def _int(value: str, flag: str, *, minimum: int = 1, maximum: Optional[int] = None) -> int:
    try:
        number = int(value.replace("_", "").replace(",", ""))
    except ValueError:
        raise ConfigError(flag, f"{value!r} is not a whole number") from None
    if number < minimum:
        raise ConfigError(flag, f"must be >= {minimum} (got {number})")
    if maximum is not None and number > maximum:
        raise ConfigError(flag, f"must be at most {maximum:,} (got {number:,})")
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
    number = float(match.group(1)) * _SUFFIXES[match.group(2)]
    if not number <= MAX_PARAMS:  # inf too (1e999)
        raise ConfigError("--params", f"must be at most {MAX_PARAMS:.0e} (got {value})")
    count = int(number)
    if count < 1:
        raise ConfigError("--params", f"must be >= 1 (got {value})")
    return count
