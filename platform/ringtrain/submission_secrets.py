"""Secrets of a submitted job (``ringtrain submit --secret NAME``): sealed into the cluster's store, opened once by the job.

A variable passed with ``--env`` travels in the job's runtime env, which Ray keeps: after the
job ends anyone holding the cluster's token reads it with ``GET /api/jobs/``, and Ray writes it
in plain text to ``runtime_env_agent.log``. A secret takes another way. The client reads it from
its own shell and uploads it, through the job API's package upload (the way a job's files
travel), as an object of the cluster's internal store under a random name that is in no file
and no log; Ray deletes such an object ten minutes later unless something holds it
(``RAY_RUNTIME_ENV_TEMPORARY_REFERENCE_EXPIRATION_S``), so one whose job never started does not
stay. Only its name goes in the job's environment (``RINGTRAIN_SECRETS``). The job's driver
(``ringtrain run``) reads the object first thing, deletes it from the store, and keeps the
values in its own environment (which only the job's user can read) for the clients that read
them there: MLflow, W&B, boto3 for the checkpoint store. They end with the process.

The workers get none of them: they reach nothing that needs one, but the datasets read from
``s3://``, which take the cluster's own credentials (a node's role, a Kubernetes secret).

``--env`` of a name that looks like a secret (``*_KEY``, ``*_TOKEN``, ``*_SECRET``,
``*PASSWORD*``) is refused, naming ``--secret``.
"""

from __future__ import annotations

import json
import os
import re
import secrets
from collections.abc import Mapping
from typing import Any, Optional
from urllib.parse import urlsplit

from ringtrain.config.destinations import TRACKING_KEY
from ringtrain.errors import ConfigError

SECRETS_VARIABLE = "RINGTRAIN_SECRETS"
SECRET_FLAG, ENV_FLAG = "--secret", "--env"
# Names of variables that hold a secret, by the conventions of the clients that read them.
SECRET_NAME = re.compile(r"(.*_(KEY|TOKEN|SECRET)|.*PASSWORD.*)", re.IGNORECASE)
VARIABLE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# The sealed object's first bytes. Ray quotes the first 15 bytes of a package whose upload failed
# in its error: they are these, never a secret.
MAGIC = b"ringtrain-secrets/1\n"
# A name the job API takes for a package (it must end in .zip), random: nothing else names it.
NAME_PREFIX = "ringtrain_secrets_"
MAX_SECRETS_BYTES = 64 << 10


def looks_secret(name: str) -> bool:
    return SECRET_NAME.fullmatch(name) is not None


def check_env_names(names: list[str]) -> None:
    """``--env NAME`` of a name that looks like a secret is bad input that says the way to pass it."""
    for name in names:
        if looks_secret(name):
            raise ConfigError(
                ENV_FLAG,
                f"{name} looks like a secret, and a variable passed with --env stays readable after the job "
                f"(`GET /api/jobs/` with the cluster's token, Ray's runtime_env_agent.log): pass it with "
                f"{SECRET_FLAG} {name}, which the job reads once and Ray keeps nowhere (on Kubernetes, "
                "a Secret in the chart's env works too)",
            )


def check_no_password(uri: str) -> None:
    """A password written into the tracking URI would be in the job's record (its entrypoint or
    its job file), where --env's values are: refused, naming the way."""
    if urlsplit(uri).password:
        raise ConfigError(
            TRACKING_KEY,
            "holds a password, which a submitted job's record would keep readable on the cluster: take it out of the URI "
            f"and pass MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD with {SECRET_FLAG}",
        )


def shell_values(flag: str, names: list[str], environ: Optional[Mapping[str, str]] = None) -> dict[str, str]:
    """The values in this shell of the variables ``flag NAME`` names (``--env``, ``--secret``): a
    name only, its value read here; a name that is no variable name, or not set, is bad input."""
    environ = os.environ if environ is None else environ
    for name in names:
        if VARIABLE_NAME.fullmatch(name) is None:
            raise ConfigError(flag, f"{name!r} is not a variable name: give the name only; its value is read from your shell")
        if name not in environ:
            raise ConfigError(flag, f"{name} is not set in this shell")
    return {name: environ[name] for name in names}


def read_secrets(names: list[str], environ: Optional[Mapping[str, str]] = None) -> dict[str, str]:
    """The values of ``--secret NAME`` in this shell (``shell_values``), within the size a sealed
    object may have."""
    values = shell_values(SECRET_FLAG, names, environ)
    if len(seal(values)) > MAX_SECRETS_BYTES:
        raise ConfigError(SECRET_FLAG, f"the secrets come to more than {MAX_SECRETS_BYTES:,} bytes: pass files' contents another way")
    return values


def seal(values: Mapping[str, str]) -> bytes:
    return MAGIC + json.dumps(dict(values), sort_keys=True).encode("utf-8")


def unseal(data: bytes) -> dict[str, str]:
    if not data.startswith(MAGIC):
        raise ValueError("not a ringtrain secrets object")
    values = json.loads(data[len(MAGIC) :].decode("utf-8"))
    if not isinstance(values, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in values.items()):
        raise ValueError("not a ringtrain secrets object")
    return values


def new_uri() -> str:
    return f"gcs://{NAME_PREFIX}{secrets.token_hex(16)}.zip"


def upload(client: Any, values: Mapping[str, str]) -> dict[str, str]:
    """Put ``values`` in the cluster's store through ``client`` (a Ray JobSubmissionClient);
    the variable that names them, for the job's environment. Asked for first, as Ray's client
    asks for a package before uploading it: that asking is what makes Ray delete the object
    within minutes when no job takes it."""
    uri = new_uri()
    path = "/api/packages/gcs/" + uri.removeprefix("gcs://")
    asked = client._do_request("GET", path)
    if asked.status_code not in (200, 404):
        client._raise_error(asked)
    put = client._do_request("PUT", path, data=seal(values))
    if put.status_code != 200:
        # The answer's text is Ray's traceback, which quotes nothing of the object but MAGIC.
        client._raise_error(put)
    return {SECRETS_VARIABLE: uri}


def receive(environ: Optional[dict[str, str]] = None) -> list[str]:
    """In a submitted job's driver: take the secrets ``RINGTRAIN_SECRETS`` names out of the
    cluster's store (deleting them there) into this process's environment; the names set.
    Nothing to do outside a job submitted with ``--secret``."""
    environ = os.environ if environ is None else environ  # type: ignore[assignment]
    uri = environ.pop(SECRETS_VARIABLE, "")
    if not uri:
        return []
    from ray._raylet import GcsClient  # Ray's own client of its store, as its daemons use it

    address = environ.get("RAY_ADDRESS", "")
    key = uri.encode("utf-8")
    try:
        client = GcsClient(address=address)
        data = client.internal_kv_get(key, None)
        client.internal_kv_del(key, False, None)
    except Exception as exc:  # noqa: BLE001 - any failure to reach the store: the job cannot have its secrets
        raise ConfigError(SECRET_FLAG, f"cannot read the job's secrets from the cluster at {address}: {type(exc).__name__}: {exc}") from None
    if data is None:
        raise ConfigError(
            SECRET_FLAG,
            f"the job's secrets ({uri}) are not in the cluster's store: read by another job, or expired "
            "before the job started (Ray keeps them ten minutes); submit it again",
        )
    try:
        values = unseal(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ConfigError(SECRET_FLAG, f"the object {uri} in the cluster's store is not the job's secrets: {exc}") from None
    environ.update(values)
    return sorted(values)
