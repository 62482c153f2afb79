"""`ringtrain submit|status|logs|stop`: the command line of jobs on a running Ray cluster.

``add_arguments`` registers the four subcommands and ``run`` executes them. Exit codes follow
`ringtrain run`: 0 success, 1 failed (the cluster cannot be reached, refuses, or the job
did not succeed), 2 bad input (a config key, a submission id the cluster does not know, a
missing or wrong token): one line, no traceback. The config, and the files the job would ship,
are checked here before anything is sent to the cluster.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Callable, Optional

from ringtrain import config
from ringtrain.commands.run import stop_wait_env
from ringtrain.commands.submit_checks import SUBMITTED_VARIABLE, await_checks
from ringtrain.config.destinations import forwarded_hosts
from ringtrain.errors import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE
from ringtrain.submission import (
    CLUSTER_PYTHON_VARIABLE,
    DEFAULT_ADDRESS,
    TOKEN_PATH_VARIABLE,
    TOKEN_VARIABLE,
    JobsClient,
    JobState,
    passed_env,
    plain_http_warning,
    resolve_address,
    resolve_cluster_python,
    resolve_token,
)
from ringtrain.submission_files import shipped_inputs
from ringtrain.submission_secrets import ENV_FLAG, SECRET_FLAG, check_env_names, check_no_password, read_secrets

STOP_POLL_S = 0.5
ADDRESS_HELP = f"the cluster's job API (default: RAY_API_SERVER_ADDRESS, RAY_ADDRESS, else {DEFAULT_ADDRESS})"
TOKEN_HELP = (
    f"the cluster's auth token (default: {TOKEN_VARIABLE}, else the file {TOKEN_PATH_VARIABLE} names); "
    "prefer --token-file or the variables, since other users of this machine can read a command line"
)
TOKEN_FILE_HELP = "a file holding the cluster's auth token (mode 0600), e.g. the local stack's auth_token"
PYTHON_HELP = (
    f"the Python on the cluster that runs the job, as an absolute path (default: {CLUSTER_PYTHON_VARIABLE}, "
    "else `python` on the PATH the head was started with); it needs ringtrain's dependencies"
)


def add_arguments(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register submit, status, logs and stop on the CLI's ``add_subparsers()`` object."""
    submit = subparsers.add_parser("submit", help="validate a job here, then run it as a Ray job on a cluster")
    submit.add_argument("job", help="job YAML; its folder becomes the job's working_dir, e.g. jobs/quickstart.yaml")
    submit.add_argument("overrides", nargs="*", help="key=value config overrides, as for `ringtrain run`")
    submit.add_argument("--address", help=ADDRESS_HELP)
    _token_arguments(submit)
    submit.add_argument("--python", metavar="PATH", help=PYTHON_HELP)
    submit.add_argument("--no-wait", action="store_true", help="return once submitted instead of following the logs")
    submit.add_argument(
        "--submission-id", help="use this id instead of ringtrain-<name>-<config hash> (to run one config twice)"
    )
    submit.add_argument(
        ENV_FLAG,
        action="append",
        default=[],
        metavar="NAME",
        help="pass this variable of your shell to the job, e.g. WANDB_PROJECT or HF_HUB_OFFLINE (repeatable); it stays "
        "readable in the job's record on the cluster, so a secret (*_KEY, *_TOKEN, *_SECRET, *PASSWORD*) is refused: use --secret",
    )
    submit.add_argument(
        SECRET_FLAG,
        action="append",
        default=[],
        metavar="NAME",
        help="pass this variable of your shell to the job's driver as a secret, e.g. WANDB_API_KEY, MLFLOW_TRACKING_TOKEN or "
        "AWS_SECRET_ACCESS_KEY (repeatable): read once by the job and deleted from the cluster, never in the job's record or "
        "Ray's logs (docs/security.md)",
    )
    submit.add_argument(
        "--no-ship-package",
        action="store_true",
        help="run the ringtrain installed on the cluster instead of shipping this one with the job",
    )

    status = subparsers.add_parser("status", help="a submitted job's status, or every job's without an id")
    status.add_argument("submission_id", nargs="?", help="the id `ringtrain submit` printed")
    status.add_argument("--address", help=ADDRESS_HELP)
    _token_arguments(status)

    logs = subparsers.add_parser("logs", help="a submitted job's output")
    logs.add_argument("submission_id", help="the id `ringtrain submit` printed")
    logs.add_argument("--follow", "-f", action="store_true", help="keep printing until the job ends")
    logs.add_argument("--address", help=ADDRESS_HELP)
    _token_arguments(logs)

    stop = subparsers.add_parser("stop", help="stop a submitted job")
    stop.add_argument("submission_id", help="the id `ringtrain submit` printed")
    stop.add_argument("--no-wait", action="store_true", help="return once the stop is requested")
    stop.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for the job to end (default 60)")
    stop.add_argument("--address", help=ADDRESS_HELP)
    _token_arguments(stop)


def _token_arguments(parser: argparse.ArgumentParser) -> None:
    given = parser.add_mutually_exclusive_group()
    given.add_argument("--token", help=TOKEN_HELP)
    given.add_argument("--token-file", metavar="PATH", help=TOKEN_FILE_HELP)


def run(args: argparse.Namespace) -> Optional[int]:
    """The exit code of a submission command; None when ``args.command`` is not one of them. Its
    errors end it as any verb's do (``errors.ending``, in ``cli.main``)."""
    handler = _HANDLERS.get(args.command)
    return None if handler is None else handler(args)


def cmd_submit(args: argparse.Namespace) -> int:
    job_path = Path(args.job)
    # Validated before connecting: bad input never reaches the cluster.
    job = config.load(job_path, args.overrides)
    shipped_inputs(job_path, job)
    check_env_names(args.env)
    check_no_password(job.telemetry.mlflow.tracking_uri)
    secrets = read_secrets(args.secret)
    # Ray's job supervisor SIGKILLs a stopped job 3 s after its SIGTERM unless told to wait for
    # the stop's save (commands/run.py); a user's own --env value wins.
    # The tracking server this client accepted is the job's driver's to reach as well.
    env_vars = {**stop_wait_env(job), SUBMITTED_VARIABLE: "1", **forwarded_hosts(job.telemetry.mlflow.tracking_uri),
                **passed_env(args.env)}
    python = resolve_cluster_python(args.python)
    client = _client(args)
    submission_id = client.submit(
        job_path,
        list(args.overrides),
        job,
        submission_id=args.submission_id,
        ship_package=not args.no_ship_package,
        env_vars=env_vars,
        secrets=secrets,
        python=python,
    )
    # The id alone on stdout, so `ID=$(ringtrain submit ... --no-wait)` works; the rest is for people.
    print(submission_id, flush=True)
    _say(f"ringtrain: submitted {job.name} as {submission_id} to {client.address}")
    # Started only once the cluster's side of the inputs (its S3 credentials and endpoint) passed:
    # the ringtrain shipped with the job says so (a cluster's own may be older and never say it).
    verdict = await_checks(_JobLogs(client), submission_id) if not args.no_ship_package else None
    if verdict is not None and not verdict.passed:
        for line in verdict.lines:
            _say(line)
        _say(f"ringtrain: {submission_id} {verdict.status} before it started: `ringtrain logs {submission_id}` has its output")
        return EXIT_USAGE if verdict.bad_input else EXIT_FAILED
    if verdict is not None:
        _say(f"ringtrain: {submission_id} started: its inputs passed their checks on the cluster")
    for line in _next_steps(submission_id, client.address, with_token=client.token is not None):
        _say(line)
    if args.no_wait:
        return EXIT_OK
    _say(f"ringtrain: following {submission_id} (Ctrl-C stops following; the job keeps running)")
    final = _follow(client, submission_id)
    if final is None:
        return EXIT_INTERRUPTED
    _say(f"ringtrain: {submission_id} {final.status}")
    return EXIT_OK if final.status == "SUCCEEDED" else EXIT_FAILED


def cmd_status(args: argparse.Namespace) -> int:
    client = _client(args)
    if args.submission_id is None:
        for line in _table(client.jobs()):
            print(line)
        return EXIT_OK
    state = client.state(args.submission_id)
    print(f"{state.submission_id}: {state.status}")
    for line in state.message.splitlines():
        print(f"  {line}")
    return EXIT_OK


def cmd_logs(args: argparse.Namespace) -> int:
    client = _client(args)
    if not args.follow:
        sys.stdout.write(client.logs(args.submission_id))
        sys.stdout.flush()
        return EXIT_OK
    return EXIT_OK if _follow(client, args.submission_id) is not None else EXIT_INTERRUPTED


def cmd_stop(args: argparse.Namespace) -> int:
    client = _client(args)
    state = client.state(args.submission_id)
    if state.terminal:
        print(f"{state.submission_id}: {state.status} (already ended; nothing to stop)")
        return EXIT_OK
    client.stop(args.submission_id)
    if args.no_wait:
        print(f"{state.submission_id}: stop requested")
        return EXIT_OK
    deadline = time.monotonic() + args.timeout
    while not state.terminal and time.monotonic() < deadline:
        time.sleep(STOP_POLL_S)
        state = client.state(args.submission_id)
    print(f"{state.submission_id}: {state.status}")
    if state.terminal:
        return EXIT_OK
    _say(f"ringtrain: {state.submission_id} is still {state.status} after {args.timeout:g} s")
    return EXIT_FAILED


class _JobLogs:
    """The job's status and output, as ``await_checks`` reads them."""

    def __init__(self, client: JobsClient) -> None:
        self.client = client

    def status(self, submission_id: str) -> str:
        return self.client.state(submission_id).status

    def logs(self, submission_id: str) -> str:
        return self.client.logs(submission_id)


def _client(args: argparse.Namespace) -> JobsClient:
    """A connection to the cluster the flags and variables name, with its token; warns first
    when the way there is plain http to another machine."""
    address, token = resolve_address(args.address), resolve_token(args.token, args.token_file)
    warning = plain_http_warning(address, sends_token=token is not None)
    if warning:
        _say(f"ringtrain: warning: {warning}")
    return JobsClient(address, token)


def _follow(client: JobsClient, submission_id: str) -> Optional[JobState]:
    """The job's output until it ends; None when the user stopped following."""
    try:
        return client.follow(submission_id, sys.stdout)
    except KeyboardInterrupt:
        _say(
            f"ringtrain: stopped following {submission_id}; it keeps running "
            f"(`ringtrain stop {submission_id}` ends it)"
        )
        return None


def _next_steps(submission_id: str, address: str, *, with_token: bool) -> list[str]:
    flag = f" --address {address}"
    lines = [
        f"  follow: ringtrain logs {submission_id} --follow{flag}",
        f"      or: ray job logs {submission_id} --follow{flag}",
        f"  status: ringtrain status {submission_id}{flag}",
        f"  stop:   ringtrain stop {submission_id}{flag}",
    ]
    if with_token:
        # Never the token itself: these lines end up in terminals' scrollback and CI logs.
        lines.append(
            f"  each with the same token (--token-file, --token, {TOKEN_PATH_VARIABLE} or {TOKEN_VARIABLE}; "
            f"Ray's CLI reads the variables with RAY_AUTH_MODE=token)"
        )
    return lines


def _table(states: list[JobState]) -> list[str]:
    if not states:
        return ["no submitted jobs"]
    width = max(len("SUBMISSION ID"), *(len(s.submission_id) for s in states))
    lines = [f"{'SUBMISSION ID':<{width}}  {'STATUS':<9}  {'STARTED':<19}  ENTRYPOINT"]
    for s in states:
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(s.start_time_ms / 1000)) if s.start_time_ms else "-"
        lines.append(f"{s.submission_id:<{width}}  {s.status:<9}  {started:<19}  {s.entrypoint}")
    return lines


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


_HANDLERS: dict[str, Callable[[argparse.Namespace], int]] = {
    "submit": cmd_submit,
    "status": cmd_status,
    "logs": cmd_logs,
    "stop": cmd_stop,
}
