"""`ringtrain run JOB [key=value ...]`: train a job on an embedded local Ray cluster, or RAY_ADDRESS.

``add_arguments`` fills the ``run`` subcommand's parser and ``run`` executes it. Every input is
checked (exit 2, one line naming the key) before Ray or torch is imported; then the cluster
starts, the Controller trains, and the run directory gets its summary and report. Exit codes:
0 the run finished, 1 it did not (its summary says why).
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from ringtrain import config
from ringtrain.planner.fit import fit_warning

if TYPE_CHECKING:
    from ringtrain.actors.evaluation import EvalPlan
    from ringtrain.checkpoint import CheckpointStore, LoadedCheckpoint
    from ringtrain.checkpoint.lease import WriterLease
    from ringtrain.telemetry.progress import Progress
    from ringtrain.telemetry.prometheus import RunMetrics

EXIT_OK, EXIT_FAILED = 0, 1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``run`` subcommand's arguments."""
    parser.add_argument("job", help="job YAML, e.g. jobs/quickstart.yaml")
    parser.add_argument("overrides", nargs="*", help="key=value config overrides, e.g. mesh.dp=2 train.steps=50")


def _stop_on_sigterm() -> None:
    """Treat SIGTERM (``ray job stop``, Kubernetes) like Ctrl-C: stop cleanly, write the summary."""

    def handler(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, handler)


def run(args: argparse.Namespace) -> int:
    """Execute ``ringtrain run``; ConfigError (exit 2) for bad input, before any cluster starts."""
    from ringtrain.actors.cluster import check_embedded_capacity
    from ringtrain.hf import resolve_job
    from ringtrain.telemetry.trackers import check_installed as check_trackers
    from ringtrain.train.mixture import check_sources

    _stop_on_sigterm()
    job = resolve_job(config.load(args.job, args.overrides))
    if job.model.hf:
        from ringtrain.hf.weights import check_pretrained  # torch: only for a pretrained model

        check_pretrained(job)
    check_sources(job)
    check_trackers(job)
    check_embedded_capacity(job)  # before an embedded cluster starts, and leaves a temp dir
    eval_plan = _eval_plan(job) if job.eval.every else None

    # Ray and torch are imported only once the input is known to be good.
    from ringtrain.actors.resume import find_resume_point, open_job_store, store_claim, store_uri
    from ringtrain.telemetry.progress import Progress
    from ringtrain.telemetry.rundir import default_run_dir

    run_path = Path(job.run_dir) if job.run_dir else default_run_dir(job)
    progress = Progress(job.train.steps, enabled=job.telemetry.progress, every=job.telemetry.log_every)
    # Before any cluster starts: a resume that cannot happen, or a store another run writes or
    # wrote, is bad input, not a failed run.
    resume_from = find_resume_point(job, run_path, progress.message)
    store = open_job_store(store_uri(job, run_path), job) if job.checkpoint.snapshot_every else None
    lease = store_claim(job, store, run_path)
    return _train(job, run_path, progress, resume_from, store, lease, eval_plan)


def _train(
    job: config.JobConfig,
    run_path: Path,
    progress: "Progress",
    resume_from: "Optional[LoadedCheckpoint]",
    store: "Optional[CheckpointStore]",
    lease: "Optional[WriterLease]",
    eval_plan: "Optional[EvalPlan]",
) -> int:
    """The run itself, on a cluster, once every input is known to be good and the store is ours."""
    from ringtrain.actors.cluster import check_capacity, connect, resolve_device
    from ringtrain.actors.controller import Controller
    from ringtrain.actors.group import WorkerGroup
    from ringtrain.actors.persister import Persister
    from ringtrain.actors.recovery import Recovery
    from ringtrain.actors.resume import checkpoint_meta, take_store
    from ringtrain.telemetry.prometheus import new_run_id
    from ringtrain.telemetry.report import write_report
    from ringtrain.telemetry.rundir import RunDir
    from ringtrain.telemetry.tensorboard import TensorBoardSink
    from ringtrain.telemetry.trackers import open_trackers, tracker_meta

    cluster = connect(job)
    job = cluster.for_workers(job)
    # ray.init replaces the SIGTERM handler (Ray's driver exits on it, and its core worker's
    # crash handler aborts the process): install ours again so a stop still writes the summary.
    _stop_on_sigterm()
    ok = False
    try:
        device = resolve_device(job)
        check_capacity(job, device)
        warning = fit_warning(job, device)
        if warning:
            print(warning, file=sys.stderr)
        persister = None
        if store is not None and lease is not None:
            # One writer per store: taken once the run is known to start, held while it trains.
            take_store(job, store, lease)
            meta = {**checkpoint_meta(job), **tracker_meta(job, run_path, resume_from.meta if resume_from else None)}
            persister = Persister(store, meta, guard=lease.check)
        run_dir = RunDir(run_path)
        run_dir.write_config(job)
        trackers = open_trackers(job, run_dir, progress.message, resume_from.meta if resume_from else None)
        run_id = new_run_id()
        telemetry = run_metrics(job, run_id) if job.telemetry.metrics else None
        topo = job.topology
        progress.message(
            f"ringtrain: {job.name}: dp {topo.dp} x cp {topo.cp} ({job.attention.impl}, "
            f"ring {topo.ring} x ulysses {topo.ulysses}), ZeRO-{job.zero.stage}, "
            f"seq {job.data.seq_len}, {device}, {'embedded Ray' if cluster.embedded else cluster.address}"
        )
        try:
            group = WorkerGroup(job, device)
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
            lease.stop()  # releases it, if it was taken
        # Ray's logs are kept when something went wrong: they hold the workers' output.
        cluster.close(keep_logs=not ok)


def _eval_plan(job: config.JobConfig) -> "EvalPlan":
    """eval.data read (and the passkey prompts built) before any cluster starts: bad input exits 2."""
    from ringtrain.actors.evaluation import model_tokenizer, plan_for

    return plan_for(job, tokenizer=model_tokenizer(job))


def run_metrics(job: config.JobConfig, run_id: str) -> "RunMetrics":
    from ringtrain.planner.models import from_job
    from ringtrain.planner.throughput import flops_per_token
    from ringtrain.telemetry.prometheus import RunMetrics

    model_flops, _ = flops_per_token(from_job(job), job.data.seq_len, checkpointing=False)
    # The peak is known once the workers report their device; the Controller sets it then.
    return RunMetrics(job, run_id, model_flops_per_token=model_flops, peak_flops_per_worker=0.0)
