"""What `ringtrain submit` waits for before it calls a job started: the job's own input checks,
made on the cluster.

The client checks the config and the files it ships, but only the cluster can tell whether the
job's S3 URIs work there: the head's environment, not the submitting shell's, holds the
credentials and endpoint a job reads (the local stack hands its own to every job; another cluster
may have none). So a submitted ``ringtrain run`` (``SUBMITTED_VARIABLE`` set in its runtime env)
prints ``CHECKED`` once every input passed, before it joins the cluster; ``await_checks`` follows
the job's log until that line, or until the job ends without it, and then the job's own error
lines are the verdict, with the ``--env`` (or ``--secret``) flags that would pass this shell's
AWS settings along.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Callable, Mapping, Optional, Protocol

from ringtrain.errors import ConfigError, DataError, line_start
from ringtrain.submission_secrets import ENV_FLAG, SECRET_FLAG, looks_secret

SUBMITTED_VARIABLE = "RINGTRAIN_SUBMITTED"
CHECKED = "ringtrain: the job's inputs passed their checks on the cluster"
# A job's start: the runtime env unpacked, Python and ringtrain imported, every input read.
CHECK_TIMEOUT_S = 600.0
POLL_S = 1.0
# What of this shell's S3 settings a job can be given. Not AWS_SHARED_CREDENTIALS_FILE nor
# AWS_PROFILE: a path, or a profile, in this machine's files, which the cluster's nodes do not have
# (a profile a node lacks breaks every S3 client there, even one with good credentials).
CREDENTIAL_VARIABLES = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")
ENDPOINT_VARIABLES = ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_DEFAULT_REGION")
TERMINAL = frozenset({"SUCCEEDED", "FAILED", "STOPPED"})
# How the lines begin that a job ends with on bad input (errors.ending: the classes that exit 2).
BAD_INPUT = tuple(line_start(error.label) for error in (ConfigError, DataError))


class JobLogs(Protocol):
    def logs(self, submission_id: str) -> str: ...
    def status(self, submission_id: str) -> str: ...


@dataclass(frozen=True)
class Verdict:
    passed: bool
    status: str  # the job's status when the verdict was reached
    lines: tuple[str, ...]  # the job's own error lines, and the hints (empty when it passed)
    bad_input: bool  # the job refused its input (its `config error` lines), rather than failed


def await_checks(
    client: JobLogs,
    submission_id: str,
    *,
    timeout_s: float = CHECK_TIMEOUT_S,
    environ: Optional[Mapping[str, str]] = None,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> Verdict:
    """Follow the job until its inputs passed their checks, or it ended without (or the time ran
    out, which counts as passed: the job is running, only slowly)."""
    deadline = clock() + timeout_s
    while True:
        status = client.status(submission_id)
        logs = client.logs(submission_id)
        if CHECKED in logs:
            return Verdict(True, status, (), False)
        if status in TERMINAL:
            errors = tuple(line for line in logs.splitlines() if line.startswith("ringtrain:"))
            bad_input = any(line.startswith(BAD_INPUT) for line in errors)
            hints = tuple(env_hints(errors, dict(os.environ) if environ is None else environ))
            return Verdict(status == "SUCCEEDED", status, errors + hints, bad_input)
        if clock() >= deadline:
            return Verdict(True, status, (), False)
        sleep(POLL_S)


def env_hints(errors: tuple[str, ...], environ: Mapping[str, str]) -> list[str]:
    """What of this shell's AWS settings would reach the job with --env (--secret for a name that
    looks like a secret), for an S3 failure the job reported (its line names the variables the
    cluster lacks)."""
    text = " ".join(errors)
    wanted: tuple[str, ...] = ()
    if "no AWS credentials were found" in text or "AWS credentials are incomplete" in text:
        wanted = CREDENTIAL_VARIABLES
    elif "cannot reach the S3 endpoint" in text or "no such bucket" in text:
        wanted = ENDPOINT_VARIABLES
    here = [name for name in wanted if environ.get(name)]
    if not here:
        return []
    # A secret-looking name passed with --env is refused by submit itself (submission_secrets);
    # and credentials travel together: a key id on the workers without its secret would stop
    # boto3 there (partial credentials) instead of falling back to the cluster's own.
    secret = any(looks_secret(name) for name in here)
    flags = " ".join(f"{SECRET_FLAG if secret else ENV_FLAG} {name}" for name in here)
    # As docs/security.md says: a secret reaches the job's driver, never its workers.
    where = (f" (a {SECRET_FLAG} reaches the job's driver only, which writes the checkpoints; a dataset on s3:// is read "
             "by the workers with the cluster's own credentials)") if secret else ""  # fmt: skip
    return [f"ringtrain: this shell sets {', '.join(here)}: give them to the job with {flags}{where}, or set them on the cluster"]
