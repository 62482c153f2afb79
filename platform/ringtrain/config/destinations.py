"""Where a job's credentials go: the tracker hosts a job file may name, and credentials in URIs masked.

MLflow attaches the user's credentials (``MLFLOW_TRACKING_TOKEN``, the username and password,
``~/.mlflow/credentials``, ...) to every request to the tracking server, whatever its host, and the
run sends it every config value, each step's metrics, every incident's text and the run's files.
So a job file someone hands you must not choose that server: ``telemetry.mlflow.tracking_uri``
reaches a host only when it comes from the user's own command line (an override, the same URI
repeated), from the user's environment (``MLFLOW_TRACKING_URI``), or names a host the user
allows in ``RINGTRAIN_TRACKING_HOSTS``; else it is refused naming the key and the host, before
anything is sent. It is the attack the refusal of ``${oc.env:...}`` exists to stop. W&B's
server is the user's own setting (``WANDB_BASE_URL``, ``wandb login``), which no job key sets.

Credentials sent over plain http to another machine cross the network readable: refused
wherever the URI comes from. And credentials written into a URI (``http://alice:pw@host``) are
masked as ``***`` wherever the URI is shown or saved (``mask_credentials``).
"""

from __future__ import annotations

import ipaddress
import os
import re
from collections.abc import Mapping
from typing import Any, Optional
from urllib.parse import urlsplit

from ringtrain.errors import ConfigError

TRACKING_KEY = "telemetry.mlflow.tracking_uri"
TRACKING_HOSTS_VARIABLE = "RINGTRAIN_TRACKING_HOSTS"
MLFLOW_URI_VARIABLE = "MLFLOW_TRACKING_URI"
# What MLflow's client attaches to its requests (mlflow.utils.credentials), from the environment
# or its credentials file.
MLFLOW_CREDENTIAL_VARIABLES = (
    "MLFLOW_TRACKING_TOKEN",
    "MLFLOW_TRACKING_USERNAME",
    "MLFLOW_TRACKING_PASSWORD",
    "MLFLOW_TRACKING_AUTH",
    "MLFLOW_TRACKING_AWS_SIGV4",
    "MLFLOW_TRACKING_CLIENT_CERT_PATH",
)
MLFLOW_CREDENTIALS_FILE = "~/.mlflow/credentials"
NETWORK_SCHEMES = {"http": 80, "https": 443}
# The user and password of a URL (``scheme://user:password@``), anywhere in a text.
_USERINFO = re.compile(r"(?<=://)[^/?#@\s]+@")
MASK = "***@"


def mask_credentials(text: str) -> str:
    """``text`` with the credentials of every URL in it replaced by ``***``."""
    return _USERINFO.sub(MASK, text)


def network_host(uri: str) -> Optional[str]:
    """The host an http(s) URI reaches, lowercased, without its credentials or port; None for
    a local store (``sqlite:``, ``file:``) or a Databricks profile of the user's own."""
    parts = urlsplit(uri)
    return (parts.hostname or "").lower() if parts.scheme.lower() in NETWORK_SCHEMES else None


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def allowed_hosts(environ: Mapping[str, str]) -> list[str]:
    """RINGTRAIN_TRACKING_HOSTS: hosts (``host`` or ``host:port``), comma or space separated."""
    return [h.strip().lower() for h in re.split(r"[,\s]+", environ.get(TRACKING_HOSTS_VARIABLE, "")) if h.strip()]


def host_allowed(uri: str, environ: Mapping[str, str]) -> bool:
    """Whether RINGTRAIN_TRACKING_HOSTS names the host of ``uri`` (with its port, when the entry
    gives one)."""
    parts = urlsplit(uri)
    host = (parts.hostname or "").lower()
    port = parts.port or NETWORK_SCHEMES.get(parts.scheme.lower())
    for entry in allowed_hosts(environ):
        name, _, entry_port = entry.rpartition(":") if entry.count(":") == 1 else (entry, "", "")
        if name.strip("[]") == host and (not entry_port or entry_port == str(port)):
            return True
    return False


def has_credentials(uri: str, environ: Mapping[str, str]) -> bool:
    """Whether MLflow would send credentials to ``uri``: written into it, or set for every server."""
    if urlsplit(uri).username or any(environ.get(name) for name in MLFLOW_CREDENTIAL_VARIABLES):
        return True
    return os.path.isfile(os.path.expanduser(MLFLOW_CREDENTIALS_FILE))


def check_tracking_uri(uri: str, *, given_by_user: bool, where: str, environ: Mapping[str, str]) -> None:
    """ConfigError naming TRACKING_KEY and the host unless ``uri`` may receive the user's MLflow
    credentials. ``given_by_user``: it came from the command line, not a file (``where``)."""
    host = network_host(uri)
    if host is None:
        return
    shown = mask_credentials(uri)
    if urlsplit(uri).scheme.lower() == "http" and not is_loopback(host) and has_credentials(uri, environ):
        raise ConfigError(
            TRACKING_KEY,
            f"{shown} is plain http to another machine, over which MLflow would send your credentials "
            "(MLFLOW_TRACKING_TOKEN, the username and password, ~/.mlflow/credentials) readable by anyone on the path: use https://",
        )
    if given_by_user or uri == environ.get(MLFLOW_URI_VARIABLE) or host_allowed(uri, environ):
        return
    raise ConfigError(
        TRACKING_KEY,
        f"{shown} in {where} names the host {host}, which would receive your MLflow credentials and the run's config, "
        f"metrics, incidents and files; a job file may send them only to a host you allow: add {host} to "
        f"{TRACKING_HOSTS_VARIABLE}, or give the URI on the command line ({TRACKING_KEY}=...)",
    )


def override_value(parsed: list[tuple[str, Any]], key: str) -> Any:
    """The value parsed ``key=value`` overrides give ``key`` (the last one that sets it, through
    a section's mapping too), or None."""
    found = None
    for given, value in parsed:
        if given == key:
            found = value
        elif key.startswith(given + "."):
            for part in key[len(given) + 1 :].split("."):
                value = value.get(part) if isinstance(value, dict) else None
            found = value if value is not None else found
    return found


def forwarded_hosts(uri: str) -> dict[str, str]:
    """The variable that lets a job's own driver (``ringtrain run`` on the cluster) send to the
    host this client accepted, for a submission's environment; empty for a local store."""
    host = network_host(uri)
    return {TRACKING_HOSTS_VARIABLE: host} if host else {}

