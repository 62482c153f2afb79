"""Submitting ringtrain jobs to a Ray cluster's job API: entrypoint, runtime env, submission ids, client calls.

A submitted job runs ``<python> -m ringtrain run <job file> <overrides>`` as a Ray job driver,
where ``<python>`` is the cluster's interpreter as the user names it (``--python``, else
RINGTRAIN_CLUSTER_PYTHON, which ``infra/local-stack.sh env`` exports), else a bare ``python``:
the entrypoint is a shell command on the head, and a bare name is looked up on the PATH of
whoever started the head, which need not be the Python Ray runs with. Its working_dir holds the job file and the relative inputs it declares, nothing else
(``submission_files``), and the ringtrain package of this client travels as a ``py_modules``
entry, so a cluster without ringtrain installed runs it and one with ringtrain installed runs
the same code the client validated the config with (a py_modules entry comes first on the
driver's and every worker's ``sys.path``). Inside the job Ray sets ``RAY_ADDRESS``, so
``ringtrain run`` joins the cluster instead of starting an embedded one.

A cluster with token authentication (the chart's, the local stack's, and by default a new
``ray.init()`` cluster's) answers only requests that carry its token as ``Authorization: Bearer
<token>``; the token comes from ``--token``, ``--token-file``, ``RAY_AUTH_TOKEN`` or the file
``RAY_AUTH_TOKEN_PATH`` names (Ray's own variables), and is sent on every call, the log stream
included. Without one, or with a wrong one, the cluster's refusal says which to pass.
Plain http to an address off this machine sends the token and the job's files readable by anyone
on the path: the command warns about it.

Submission ids are deterministic: ``ringtrain-<name>-<first 10 hex of sha256(resolved config
YAML)>``. The resolved config already holds the overrides, so ``mesh.dp=2`` given or left at
its default is the same submission. The same submission while one is pending or running is
refused; once it has ended, the next free ``-2``, ``-3``, ... suffix is used.

Ray is imported only when a client connects, so the command line stays light until then.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import re
import shlex
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, TextIO
from urllib.parse import urlsplit

from ringtrain import config
from ringtrain.config import JobConfig
from ringtrain.config.destinations import is_loopback
from ringtrain.errors import EXIT_USAGE, ClusterError, ConfigError, RingtrainError, first_line
from ringtrain.submission_files import working_dir
from ringtrain.submission_secrets import ENV_FLAG, shell_values
from ringtrain.submission_secrets import upload as upload_secrets

if TYPE_CHECKING:
    from ray.job_submission import JobDetails, JobSubmissionClient

DEFAULT_ADDRESS = "http://127.0.0.1:8265"
# Ray's own variables for the job API's address, most specific first (as the Ray CLI reads them).
ADDRESS_VARIABLES = ("RAY_API_SERVER_ADDRESS", "RAY_ADDRESS")
TERMINAL_STATUSES = frozenset({"SUCCEEDED", "FAILED", "STOPPED"})
ACTIVE_STATUSES = frozenset({"PENDING", "RUNNING"})
ID_HASH_CHARS = 10
# The variables Ray's own clients read a cluster's token from, the token itself first, as Ray
# reads them; ``--token`` and ``--token-file`` win over both.
TOKEN_VARIABLE = "RAY_AUTH_TOKEN"
TOKEN_PATH_VARIABLE = "RAY_AUTH_TOKEN_PATH"
TOKEN_HINT = (
    f"pass the cluster's token with --token-file PATH or --token TOKEN, "
    f"or set {TOKEN_PATH_VARIABLE} or {TOKEN_VARIABLE}"
)
# A token is a few dozen characters; a file much larger is not one (and is not read whole).
TOKEN_FILE_MAX_BYTES = 4096
# The interpreter a job's entrypoint runs on the cluster: ``--python``, else this variable, else
# whatever ``python`` the head's PATH finds.
CLUSTER_PYTHON_VARIABLE = "RINGTRAIN_CLUSTER_PYTHON"
DEFAULT_CLUSTER_PYTHON = "python"
QUIET_LOGGERS = (
    "ray.dashboard.modules.dashboard_sdk",
    "ray.dashboard.modules.job.sdk",
    "ray._private.runtime_env.packaging",
    # Warns that no token was found; the refusal that follows says what to pass.
    "ray._private.authentication.http_token_authentication",
)
# Compiled leftovers are never needed on the cluster and differ between machines.
PACKAGE_EXCLUDES = ["__pycache__/", "*.pyc"]


class SubmissionError(RingtrainError):
    """The cluster refused a submission, or the same submission is still pending or running."""


class UnknownJobError(SubmissionError):
    """No job with the given submission id exists on the cluster."""

    exit_code = EXIT_USAGE  # the id given is at fault
    label = ""  # its message says so alone


class TokenRefused(SubmissionError):
    """The cluster authenticates with a token and the request carried none, or a wrong one."""

    exit_code = EXIT_USAGE  # the token given is at fault
    label = ""  # its message says so alone


@dataclass(frozen=True)
class JobState:
    """What the cluster knows about one submitted job."""

    submission_id: str
    status: str
    message: str
    entrypoint: str
    start_time_ms: Optional[int] = None

    @property
    def terminal(self) -> bool:
        return self.status in TERMINAL_STATUSES


def resolve_address(explicit: Optional[str] = None) -> str:
    """The job API address: the given one, else RAY_API_SERVER_ADDRESS, RAY_ADDRESS, the local default."""
    if explicit:
        return explicit
    for name in ADDRESS_VARIABLES:
        value = os.environ.get(name)
        if value:
            return value
    return DEFAULT_ADDRESS


def resolve_token(explicit: Optional[str] = None, file: Optional[str] = None) -> Optional[str]:
    """The cluster's token: the given one, else the given file's, else RAY_AUTH_TOKEN, else the
    file RAY_AUTH_TOKEN_PATH names, else None (send none)."""
    if explicit is not None:
        return explicit.strip() or None
    if file is not None:
        return read_token_file(file, "--token-file")
    token = os.environ.get(TOKEN_VARIABLE, "").strip()
    if token:
        return token
    path = os.environ.get(TOKEN_PATH_VARIABLE, "")
    return read_token_file(path, TOKEN_PATH_VARIABLE) if path else None


def read_token_file(path: str, key: str) -> str:
    """The token a file holds (surrounding whitespace dropped); a missing, unreadable, empty or
    oversized file is bad input naming ``key`` and the file."""
    try:
        with open(path, "rb") as f:
            data = f.read(TOKEN_FILE_MAX_BYTES + 1)
    except OSError as exc:
        raise ConfigError(key, f"cannot read the token file {path}: {exc.strerror or exc}") from None
    if len(data) > TOKEN_FILE_MAX_BYTES:
        raise ConfigError(key, f"{path} is over {TOKEN_FILE_MAX_BYTES} bytes: not a token file")
    token = data.decode("utf-8", errors="replace").strip()
    if not token:
        raise ConfigError(key, f"the token file {path} is empty")
    return token


def resolve_cluster_python(explicit: Optional[str] = None) -> str:
    """The interpreter a job runs with on the cluster: the given one, else RINGTRAIN_CLUSTER_PYTHON,
    else ``python``. A relative path is refused: the entrypoint runs in Ray's copy of the job's
    folder on the head, where it would name nothing."""
    key = "--python" if explicit is not None else CLUSTER_PYTHON_VARIABLE
    chosen = explicit if explicit is not None else os.environ.get(CLUSTER_PYTHON_VARIABLE, "")
    chosen = chosen.strip()
    if explicit is None and not chosen:
        return DEFAULT_CLUSTER_PYTHON
    if not chosen:
        raise ConfigError(key, "empty: name the cluster's Python, e.g. /opt/venv/bin/python")
    if "/" in chosen and not chosen.startswith("/"):
        raise ConfigError(
            key,
            f"{chosen} is a relative path, which the job would resolve in its own folder on the "
            "cluster: give an absolute path (or a command name on the head's PATH)",
        )
    return chosen


def auth_headers(token: Optional[str]) -> dict[str, str]:
    """The header Ray's dashboard checks a request's token in (``Bearer``, as Ray's own clients send it)."""
    return {"Authorization": f"Bearer {token}"} if token else {}


def plain_http_warning(address: str, *, sends_token: bool) -> Optional[str]:
    """A warning when ``address`` is reached over plain http on another machine, else None.

    An address without a scheme (``host:6379``, a GCS address the job client looks the
    dashboard up through) is reached over http too; ``auto`` is this machine's cluster.
    """
    if address == "auto":
        return None
    parts = urlsplit(address if "://" in address else f"http://{address}")
    if parts.scheme != "http" or is_loopback(parts.hostname or ""):
        return None
    what = "the token and the job's files" if sends_token else "the job's files and logs"
    return (
        f"{address} is plain http to another machine: {what} cross the network unencrypted; "
        "use https:// or a tunnel to the cluster (kubectl port-forward, ssh -L)"
    )


def config_digest(job: JobConfig) -> str:
    return hashlib.sha256(config.to_yaml(job).encode("utf-8")).hexdigest()


def base_submission_id(job: JobConfig) -> str:
    """``ringtrain-<name>-<hash>``: the same resolved config always gives the same id."""
    return f"ringtrain-{job.name}-{config_digest(job)[:ID_HASH_CHARS]}"


def family_ids(base: str, known: set[str]) -> list[str]:
    """The known ids that are ``base`` or one of its resubmissions ``base-N``."""
    pattern = re.compile(re.escape(base) + r"(-[0-9]+)?")
    return sorted(i for i in known if pattern.fullmatch(i))


# What the job API answers while the head's job agent is still starting, and how long a
# submission waits for it.
NO_AGENT = "No available agent to submit job"
AGENT_WAIT_S = 60.0


def next_free_id(base: str, known: set[str]) -> str:
    if base not in known:
        return base
    n = 2
    while f"{base}-{n}" in known:
        n += 1
    return f"{base}-{n}"


def entrypoint(job_path: Path, overrides: list[str], python: str = DEFAULT_CLUSTER_PYTHON) -> str:
    """The driver command, relative to the working_dir that holds the job file, run by ``python``
    (the cluster's interpreter, see ``resolve_cluster_python``)."""
    args = [python, "-m", "ringtrain", "run", job_path.name, *overrides]
    return " ".join(shlex.quote(a) for a in args)


def package_dir() -> Path:
    """The folder of the ringtrain package this process imported: what gets shipped."""
    import ringtrain

    return Path(ringtrain.__file__).resolve().parent


def runtime_env(folder: Path, *, ship_package: bool = True, env_vars: Optional[dict[str, str]] = None) -> dict[str, Any]:
    """working_dir: ``folder`` (see ``submission_files.working_dir``); py_modules: this
    ringtrain, unless the cluster's is wanted; env_vars: what the user chose to pass (``--env``)."""
    env: dict[str, Any] = {"working_dir": str(folder), "excludes": list(PACKAGE_EXCLUDES)}
    if ship_package:
        env["py_modules"] = [str(package_dir())]
    if env_vars:
        env["env_vars"] = dict(env_vars)
    return env


def passed_env(names: list[str], environ: Optional[Mapping[str, str]] = None) -> dict[str, str]:
    """The variables ``--env NAME`` passes from the submitting shell (tracker settings, say):
    their values travel in the submission, never in the job file. Read as ``--secret``'s are
    (``shell_values``): a name that is no variable name, or not set, is bad input."""
    return shell_values(ENV_FLAG, names, environ)


@contextmanager
def _address_variables_cleared() -> Iterator[None]:
    """Ray's client lets RAY_API_SERVER_ADDRESS / RAY_ADDRESS override the address it is given;
    the address was already resolved (an explicit one wins), so they are hidden while it connects."""
    saved = {name: os.environ.pop(name) for name in ADDRESS_VARIABLES if name in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)


class JobsClient:
    """One connection to a cluster's job API; every failure becomes a one-line RingtrainError."""

    def __init__(self, address: str, token: Optional[str] = None) -> None:
        self.address = address
        self.token = token
        self._client = self._connect(address, token)

    def _refused(self) -> TokenRefused:
        if self.token is None:
            return TokenRefused(f"the Ray job API at {self.address} requires a token: {TOKEN_HINT}")
        return TokenRefused(f"the Ray job API at {self.address} refused the token given: {TOKEN_HINT}")

    def _connect(self, address: str, token: Optional[str]) -> JobSubmissionClient:
        from ray.exceptions import AuthenticationError, RayError
        from ray.job_submission import JobSubmissionClient

        # Ray's job client logs every package upload and socket close at INFO on stderr; the
        # command prints what matters itself.
        for name in QUIET_LOGGERS:
            logging.getLogger(name).setLevel(logging.ERROR)
        try:
            with _address_variables_cleared():
                # An explicit header: Ray's client adds one of its own only when its process runs
                # with RAY_AUTH_MODE=token, and never overrides one given.
                return JobSubmissionClient(address, headers=auth_headers(token))
        except AuthenticationError:
            raise self._refused() from None
        # RayError: a GCS address (host:6379) is looked up through the GCS first, which can time out.
        except (ConnectionError, OSError, ValueError, RuntimeError, RayError) as exc:
            raise ClusterError(f"cannot reach the Ray job API at {address}: {first_line(exc)}") from None

    @contextmanager
    def _calls(self, submission_id: Optional[str] = None) -> Iterator[None]:
        """Translate what Ray's client raises into errors that name the job and the address."""
        from ray.exceptions import AuthenticationError

        try:
            yield
        except AuthenticationError:
            raise self._refused() from None
        except OSError as exc:  # requests' connection errors are OSErrors
            raise ClusterError(f"lost the Ray job API at {self.address}: {first_line(exc)}") from None
        except (RuntimeError, ValueError) as exc:  # ValueError: a working_dir Ray cannot package
            text = first_line(exc)
            if submission_id is not None and "status code 404" in text:
                raise UnknownJobError(
                    f"no job {submission_id} on {self.address} (`ringtrain status` lists them)"
                ) from None
            raise SubmissionError(f"the Ray job API at {self.address}: {text}") from None

    def jobs(self) -> list[JobState]:
        """Every submitted job, oldest first (drivers started outside the job API have no id)."""
        with self._calls():
            details = self._client.list_jobs()
        states = [_state(d) for d in details if d.submission_id]
        return sorted(states, key=lambda s: (s.start_time_ms or 0, s.submission_id))

    def state(self, submission_id: str) -> JobState:
        with self._calls(submission_id):
            return _state(self._client.get_job_info(submission_id))

    def choose_id(self, job: JobConfig, requested: Optional[str] = None) -> str:
        """The id for a new submission of ``job``; refuses one that would run the same config twice."""
        states = {s.submission_id: s for s in self.jobs()}
        if requested:
            if requested in states:
                taken = states[requested]
                raise SubmissionError(
                    f"submission id {requested} is already used on {self.address} ({taken.status}); choose another"
                )
            return requested
        base = base_submission_id(job)
        for existing in family_ids(base, set(states)):
            if states[existing].status in ACTIVE_STATUSES:
                raise SubmissionError(
                    f"this config is already {states[existing].status.lower()} as {existing} on {self.address}; "
                    f"follow it with `ringtrain logs {existing} --follow`, or pass --submission-id to run it twice"
                )
        return next_free_id(base, set(states))

    def submit(
        self,
        job_path: Path,
        overrides: list[str],
        job: JobConfig,
        *,
        submission_id: Optional[str] = None,
        ship_package: bool = True,
        env_vars: Optional[dict[str, str]] = None,
        secrets: Optional[Mapping[str, str]] = None,
        python: str = DEFAULT_CLUSTER_PYTHON,
    ) -> str:
        """Submit a validated job, run by the cluster's ``python``; returns its submission id.
        ``secrets`` reach the job's driver through the cluster's store (``submission_secrets``)."""
        chosen = self.choose_id(job, submission_id)
        with working_dir(job_path, job) as folder, self._calls():
            if secrets:
                env_vars = {**(env_vars or {}), **upload_secrets(self._client, secrets)}
            deadline = time.monotonic() + AGENT_WAIT_S
            while True:
                try:
                    return self._client.submit_job(
                        entrypoint=entrypoint(job_path, overrides, python),
                        submission_id=chosen,
                        runtime_env=runtime_env(folder, ship_package=ship_package, env_vars=env_vars),
                        metadata={"ringtrain_job": job.name, "ringtrain_config_sha256": config_digest(job)},
                    )
                except RuntimeError as exc:
                    # A head that has just started answers before its job agent is up.
                    if NO_AGENT not in str(exc) or time.monotonic() > deadline:
                        raise
                    time.sleep(1.0)

    def logs(self, submission_id: str) -> str:
        with self._calls(submission_id):
            return self._client.get_job_logs(submission_id)

    def follow(self, submission_id: str, out: TextIO) -> JobState:
        """Stream the job's output to ``out`` until it ends; returns its final state."""
        import aiohttp

        # Asked first: the log stream of an unknown id fails with a handshake error, not a 404.
        self.state(submission_id)
        with self._calls(submission_id):
            try:
                asyncio.run(_stream(self._client, submission_id, out))
            except aiohttp.ClientError as exc:
                raise ClusterError(
                    f"lost the log stream of {submission_id} from {self.address}: {first_line(exc)}"
                ) from None
        return self.state(submission_id)

    def stop(self, submission_id: str) -> bool:
        """Ask the job to stop; False when it had already ended."""
        with self._calls(submission_id):
            return self._client.stop_job(submission_id)


async def _stream(client: JobSubmissionClient, submission_id: str, out: TextIO) -> None:
    async for chunk in client.tail_job_logs(submission_id):
        out.write(chunk)
        out.flush()


def _state(details: JobDetails) -> JobState:
    assert details.submission_id is not None
    return JobState(
        submission_id=details.submission_id,
        status=str(details.status),
        message=details.message or "",
        entrypoint=details.entrypoint,
        start_time_ms=details.start_time,
    )
