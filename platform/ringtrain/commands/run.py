"""`ringtrain run JOB [key=value ...]`: train a job on an embedded local Ray cluster, or RAY_ADDRESS.

``add_arguments`` fills the ``run`` subcommand's parser and ``run`` executes it. Every input is
checked (exit 2, one line naming the key) before Ray or torch is imported; then the cluster
starts, the Controller trains, and the run directory gets its summary and report. Exit codes:
0 the run finished, 1 it did not (its summary says why).

SIGINT (Ctrl-C) and SIGTERM (``ray job stop``, Kubernetes) stop the run cleanly: the Controller
writes the newest in-memory snapshot to the store within ``checkpoint.stop_persist_timeout_s``
and says so, then the summary is written. A second signal exits at once (128 + its number),
abandoning any save in flight. The store's writer lease is sealed first and released only once
no save is writing; otherwise it is left to expire.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import signal
import sys
import threading
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Optional

from ringtrain import config
from ringtrain.commands.submit_checks import CHECKED, SUBMITTED_VARIABLE
from ringtrain.errors import EXIT_FAILED, EXIT_OK
from ringtrain.planner.fit import fit_warning

if TYPE_CHECKING:
    from ringtrain.actors.evaluation import EvalPlan
    from ringtrain.actors.persister import Persister
    from ringtrain.checkpoint import CheckpointStore, LoadedCheckpoint
    from ringtrain.checkpoint.lease import WriterLease
    from ringtrain.commands.reference import ResolvedReference
    from ringtrain.telemetry.progress import Progress
    from ringtrain.telemetry.prometheus import RunMetrics

# After a stop, how long the lease waits for a save still writing (it stops at its next write,
# the lease being sealed) before it is left to expire instead of being released.
ABANDON_WAIT_S = 2.0
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
# After the stop's save: the summary, the report, the workers and the cluster closed.
STOP_MARGIN_S = 15.0
# Ray's job supervisor reads it from the job's runtime env: seconds from its SIGTERM to SIGKILL.
STOP_WAIT_VARIABLE = "RAY_JOB_STOP_WAIT_TIME_S"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``run`` subcommand's arguments."""
    parser.add_argument("job", help="job YAML, e.g. jobs/quickstart.yaml")
    parser.add_argument("overrides", nargs="*", help="key=value config overrides, e.g. mesh.dp=2 train.steps=50")


class StopSignals:
    """SIGINT and SIGTERM alike: the first stops the run cleanly (KeyboardInterrupt, which the
    Controller turns into a stop that saves the newest snapshot); a second exits at once."""

    def __init__(self) -> None:
        self.seen = 0

    def __call__(self, signum: int, frame: Optional[FrameType]) -> None:
        self.seen += 1
        if self.seen == 1:
            raise KeyboardInterrupt
        # os.write and os._exit: nothing that could block, or run a cleanup that waits on a save.
        name = signal.Signals(signum).name
        os.write(2, f"ringtrain: {name} again: exiting now; a save in flight is abandoned, the store's writer lease expires on its own\n".encode())
        os._exit(128 + signum)

    def install(self) -> None:
        if threading.current_thread() is threading.main_thread():
            for signum in STOP_SIGNALS:
                signal.signal(signum, self)


def stop_wait_env(job: config.JobConfig) -> dict[str, str]:
    """What a submission tells Ray's job supervisor: how long to wait after its SIGTERM before it
    SIGKILLs the job (its own default is 3 s), so that a stop's save and summary get written."""
    return {STOP_WAIT_VARIABLE: str(math.ceil(job.checkpoint.stop_persist_timeout_s + STOP_MARGIN_S))}


def run(args: argparse.Namespace) -> int:
    """Execute ``ringtrain run``; ConfigError (exit 2) for bad input, before any cluster starts."""
    from ringtrain.actors.cluster import check_embedded_capacity
    from ringtrain.commands.reference import resolve_reference
    from ringtrain.hf import resolve_job
    from ringtrain.submission_secrets import receive as receive_secrets
    from ringtrain.telemetry.trackers import check_installed as check_trackers
    from ringtrain.train.mixture import check_sources

    stop = StopSignals()
    stop.install()
    # A submitted job's secrets, before anything reads the environment for credentials.
    receive_secrets()
    job = resolve_job(config.load(args.job, args.overrides))
    if job.model.hf:
        from ringtrain.hf.weights import check_pretrained  # torch: only for a pretrained model

        check_pretrained(job)
    for note in check_sources(job):
        print(f"ringtrain: warning: {note}", file=sys.stderr)
    reference = resolve_reference(job)
    check_trackers(job)
    check_embedded_capacity(job)  # before an embedded cluster starts, and leaves a temp dir
    eval_plan = _eval_plan(job) if job.eval.every else None

    # Ray and torch are imported only once the input is known to be good.
    from ringtrain.actors.resume import open_checkpoints, store_claim
    from ringtrain.telemetry.progress import Progress
    from ringtrain.telemetry.rundir import default_run_dir

    run_path = Path(job.run_dir) if job.run_dir else default_run_dir(job)
    progress = Progress(job.train.steps, enabled=job.telemetry.progress, every=job.telemetry.log_every)
    # Before any cluster starts: a resume that cannot happen, or a store another run writes or
    # wrote, is bad input, not a failed run.
    resume_from, store = open_checkpoints(job, run_path, progress.message)
    lease = store_claim(job, store, run_path)
    if os.environ.get(SUBMITTED_VARIABLE):  # `ringtrain submit` waits for this line (commands/submit_checks)
        print(CHECKED, flush=True)
    return _train(job, run_path, progress, resume_from, store, lease, eval_plan, stop, reference)


def _chat_data_note(job: config.JobConfig, progress: "Progress") -> Optional[dict[str, int]]:
    """How the job's chat or preference data packs and what data.seq_len cost it, before the
    first step; a warning on stderr when the conversations or pairs dropped or cut hold more than
    a few percent of it. Returns the counts (``chat_packing_counts``; None for other data)."""
    from ringtrain.train.conversations import packing_note
    from ringtrain.train.mixture import chat_packing_counts

    counts = chat_packing_counts(job)
    if counts is None:
        return None
    note, warn = packing_note(counts, job.data.seq_len, job.data.chat_overlong)
    if warn:
        print(f"ringtrain: warning: {note}", file=sys.stderr, flush=True)
    else:
        progress.message(note)
    return counts


def _train(
    job: config.JobConfig,
    run_path: Path,
    progress: "Progress",
    resume_from: "Optional[LoadedCheckpoint]",
    store: "Optional[CheckpointStore]",
    lease: "Optional[WriterLease]",
    eval_plan: "Optional[EvalPlan]",
    stop: StopSignals,
    reference: "Optional[ResolvedReference]",
) -> int:
    """The run itself, on a cluster, once every input is known to be good and the store is ours;
    ``reference``: DPO's and IPO's reference model, when the objective scores against one."""
    from ringtrain.actors.cluster import check_capacity, connect, resolve_device
    from ringtrain.actors.controller import Controller
    from ringtrain.actors.group import WorkerGroup
    from ringtrain.actors.persister import Persister
    from ringtrain.actors.recovery import Recovery
    from ringtrain.actors.reference_keeper import ReferenceKeeper, run_key
    from ringtrain.actors.resume import checkpoint_meta, take_store
    from ringtrain.telemetry.prometheus import new_run_id
    from ringtrain.telemetry.report import write_report
    from ringtrain.telemetry.rundir import RunDir
    from ringtrain.telemetry.tensorboard import TensorBoardSink
    from ringtrain.telemetry.trackers import open_trackers, tracker_meta

    address = job.cluster.address or os.environ.get("RAY_ADDRESS")
    progress.waiting(f"the Ray cluster at {address}" if address else "an embedded Ray cluster to start")
    cluster = connect(job)
    job = cluster.for_workers(job)
    # ray.init replaces the SIGTERM handler (Ray's driver exits on it, and its core worker's
    # crash handler aborts the process): install ours again so a stop still writes the summary.
    stop.install()
    ok = False
    persister: "Optional[Persister]" = None
    try:
        device = resolve_device(job)
        check_capacity(job, device)
        warning = fit_warning(job, device)
        if warning:
            print(warning, file=sys.stderr)
        if store is not None and lease is not None:
            # One writer per store: taken once the run is known to start, held while it trains.
            take_store(job, store, lease)
            meta = {**checkpoint_meta(job), **tracker_meta(job, run_path, resume_from.meta if resume_from else None)}
            persister = Persister(store, meta, fence=lease)
        run_dir = RunDir(run_path)
        run_dir.write_config(job)
        trackers = open_trackers(job, run_dir, progress.message, resume_from.meta if resume_from else None)
        run_id = new_run_id()
        telemetry = run_metrics(job, run_id) if job.telemetry.metrics else None
        topo = job.topology
        progress.message(
            f"ringtrain: {job.name}: dp {topo.dp} x cp {topo.cp} ({job.cp_layout.runs}, "
            f"ring {topo.ring} x ulysses {topo.ulysses}), ZeRO-{job.zero.stage}, "
            f"seq {job.data.seq_len}, {device}, {'embedded Ray' if cluster.embedded else cluster.address}"
        )
        packed = _chat_data_note(job, progress)
        try:
            group = WorkerGroup(job, device)
            if reference is not None:
                group.reference = ReferenceKeeper(run_key(job, reference.identity, device), reference.weights,
                                                  store=store, fence=lease, say=progress.message,
                                                  rows=packed["rows"] if packed else None)  # fmt: skip
            controller = Controller(
                job,
                group,
                run_dir,
                progress,
                persister=persister,
                resume_from=resume_from,
                telemetry=telemetry,
                run_id=run_id,
                sinks=[*([TensorBoardSink(run_path)] if job.telemetry.tensorboard else []), *([trackers] if trackers is not None else [])],
                elastic=Recovery(group),
                eval_plan=eval_plan,
                startup=cluster.startup,
            )
            summary = controller.run()
        finally:
            run_dir.close()
        progress.summary(summary)
        if summary.get("durable_stopped"):
            print(
                f"ringtrain: warning: durable checkpoints stopped during the run (the newest is step "
                f"{summary['last_durable_step']}): {summary['durable_stopped']}",
                file=sys.stderr,
            )
        try:
            report_path, _ = write_report(run_path)
            progress.message(f"report: {report_path}")
        except OSError as exc:
            # The run's outcome stands; `ringtrain report` can write the page later.
            print(f"ringtrain: warning: could not write {run_path / 'report.html'}: {exc}", file=sys.stderr)
        if trackers is not None:
            trackers.finish(summary["status"])  # after the report, which it sends
        ok = summary["status"] == "finished"
        if not ok and cluster.temp_dir:
            progress.message(f"Ray logs of the embedded cluster: {cluster.temp_dir}")
        return EXIT_OK if ok else EXIT_FAILED
    finally:
        if lease is not None:
            # No write after this point; the lease goes only once no save is writing under it.
            lease.seal()
            idle = persister.close(timeout_s=ABANDON_WAIT_S) if persister is not None else True
            lease.stop(release=idle)
        # Ray's logs are kept when something went wrong: they hold the workers' output.
        cluster.close(keep_logs=not ok)


def _eval_plan(job: config.JobConfig) -> "EvalPlan":
    """eval.data read (the passkey prompts built, eval.tasks found and their data loaded) before
    any cluster starts: bad input exits 2."""
    from ringtrain.actors.evaluation import model_tokenizer, plan_for

    tokenizer = model_tokenizer(job)  # read once: for the plan, and for eval.tasks' check that it is there
    plan = plan_for(job, tokenizer=tokenizer)
    e = job.eval
    if not e.tasks:
        return plan
    from ringtrain.commands.eval_tasks import training_tasks

    tasks = training_tasks(e.tasks, include_path=e.include_path, limit=e.limit, num_fewshot=e.num_fewshot,
                           max_length=e.seq_len or job.data.seq_len, tokenizer_folder=job.model.hf, tokenizer=tokenizer)
    return dataclasses.replace(plan, tasks=tasks)


def run_metrics(job: config.JobConfig, run_id: str) -> "RunMetrics":
    from ringtrain.planner.models import from_job
    from ringtrain.planner.throughput import flops_per_token
    from ringtrain.telemetry.prometheus import RunMetrics

    model_flops, _ = flops_per_token(from_job(job), job.data.seq_len, checkpointing=False)
    # The peak is known once the workers report their device; the Controller sets it then.
    return RunMetrics(job, run_id, model_flops_per_token=model_flops, peak_flops_per_worker=0.0)
