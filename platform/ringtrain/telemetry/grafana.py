"""Provisioning Grafana through grafana-client: ringtrain's folder, data source, dashboards and alert rules.

Every object is addressed by a fixed uid, read first and written only when it differs from what
ringtrain wants, so pushing twice leaves the same state and the second push reports every object
"unchanged". Objects read back are compared as supersets of what was sent, because Grafana adds
its own fields (ids, versions, timestamps, provenance). Failures become ``GrafanaPushError``
with a one-line message; nothing from the HTTP stack escapes.
"""

from __future__ import annotations

import re
import socket
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal, Optional, TypeVar, Union
from urllib.parse import urlsplit

from grafana_client import GrafanaApi
from grafana_client.client import GrafanaClientError, GrafanaException, GrafanaTimeoutError, GrafanaUnauthorizedError

from ringtrain.errors import RingtrainError
from ringtrain.telemetry import alerts, dashboards, panels

Json = dict[str, Any]
Action = Literal["created", "updated", "unchanged"]
Auth = Union[str, tuple[str, str]]
T = TypeVar("T")

DATASOURCE_UID = "ringtrain-prometheus"
DATASOURCE_NAME = "ringtrain Prometheus"
# The local stack's Prometheus (infra/local-stack.sh), used when a push creates the data source
# and was given no URL.
DEFAULT_PROMETHEUS_URL = "http://127.0.0.1:9090"
# Grafana folder uids: at most 40 characters of letters, digits, '-' and '_'.
FOLDER_UID_LENGTH = 40


class GrafanaPushError(RingtrainError):
    """Grafana could not be reached, refused the request, or answered with an error."""


class GrafanaAuthError(GrafanaPushError):
    """Grafana rejected the credentials (HTTP 401)."""


@dataclass(frozen=True)
class Change:
    kind: str
    uid: str
    action: Action


def folder_uid(title: str) -> str:
    """The folder's uid derived from its title: ``ringtrain`` stays ``ringtrain``."""
    return re.sub(r"[^a-z0-9_]+", "-", title.lower()).strip("-")[:FOLDER_UID_LENGTH].strip("-")


def connect(url: str, auth: Auth, timeout: float) -> GrafanaApi:
    """A client for the Grafana at ``url`` (``http(s)://host[:port][/sub/path]``)."""
    parts = urlsplit(url)
    # grafana-client joins the prefix and "api" without a separator.
    prefix = parts.path.strip("/")
    return GrafanaApi(
        auth=auth,
        protocol=parts.scheme,
        host=parts.hostname or "",
        port=parts.port,
        url_path_prefix=prefix + "/" if prefix else "",
        timeout=timeout,
    )


def contains(actual: Any, wanted: Any) -> bool:
    """Whether ``actual`` holds everything ``wanted`` does; dicts may carry extra keys."""
    if isinstance(wanted, dict):
        return isinstance(actual, dict) and all(k in actual and contains(actual[k], v) for k, v in wanted.items())
    if isinstance(wanted, list):
        return (
            isinstance(actual, list) and len(actual) == len(wanted) and all(map(contains, actual, wanted))
        )
    return bool(actual == wanted)


def _without_revision(board: Json) -> Json:
    # Grafana assigns id and version on save; the rest is stored as sent.
    return {k: v for k, v in board.items() if k not in ("id", "version")}


def _connection_reason(exc: BaseException) -> str:
    seen: Optional[BaseException] = exc
    while seen is not None:
        if isinstance(seen, socket.gaierror):
            return "cannot resolve the host name"
        if isinstance(seen, OSError) and seen.strerror:
            return seen.strerror.lower()
        seen = seen.__cause__ or seen.__context__
    return "connection failed"


class Provisioner:
    """Creates or updates ringtrain's objects in one Grafana, one object per call."""

    def __init__(self, api: GrafanaApi, url: str, timeout: float) -> None:
        self.api = api
        self.url = url
        self.timeout = timeout

    @contextmanager
    def _doing(self, what: str) -> Iterator[None]:
        """Turn any failure of the requests inside into a one-line ``GrafanaPushError``."""
        try:
            yield
        except GrafanaUnauthorizedError as exc:
            raise GrafanaAuthError(f"Grafana at {self.url} rejected the credentials (HTTP 401) to {what}") from exc
        except (GrafanaException, OSError, ValueError) as exc:
            raise GrafanaPushError(self._failure(exc, what)) from exc

    def _failure(self, exc: Exception, what: str) -> str:
        """One line of what went wrong in a request to ``what``."""
        if isinstance(exc, GrafanaTimeoutError):
            return f"Grafana at {self.url} did not answer within {self.timeout:g} s to {what}"
        if isinstance(exc, GrafanaException):
            detail = exc.message if exc.status_code else f"cannot reach it ({_connection_reason(exc)})"
            return f"Grafana at {self.url} failed to {what}: {_one_line(detail)}"
        if isinstance(exc, OSError):
            # niquests' connection errors derive from OSError; grafana-client lets them through.
            return f"cannot reach Grafana at {self.url}: {_connection_reason(exc)}"
        # A body that is not JSON (ValueError): something other than Grafana's API answered.
        return f"{self.url} did not answer like Grafana's HTTP API to {what} (is the URL right?)"

    def _find(self, what: str, read: Callable[[], T]) -> Optional[T]:
        """The object ``read`` returns, or None when Grafana answers 404."""
        with self._doing(f"read {what}"):
            try:
                return read()
            except GrafanaClientError as exc:
                if exc.status_code == 404:
                    return None
                raise

    def _settle(
        self, kind: str, uid: str, existing: Optional[Json], unchanged: bool, create: Callable[[], object],
        update: Callable[[], object], *, named: str = "", updating: str = "update",
    ) -> Change:
        """Create the object where Grafana has none, update it where it is not what is wanted
        (``unchanged`` says it is), and say which was done. ``named``: what messages call its
        kind (default ``kind``); ``updating``: the verb of its update."""
        name = f"{named or kind} {uid}"
        if existing is None:
            with self._doing(f"create {name}"):
                create()
            return Change(kind, uid, "created")
        if unchanged:
            return Change(kind, uid, "unchanged")
        with self._doing(f"{updating} {name}"):
            update()
        return Change(kind, uid, "updated")

    def folder(self, title: str) -> Change:
        uid = folder_uid(title)
        existing = self._find(f"folder {uid}", lambda: self.api.folder.get_folder(uid))
        return self._settle(
            "folder", uid, existing, existing is not None and existing.get("title") == title,
            lambda: self.api.folder.create_folder(title, uid=uid),
            lambda: self.api.folder.update_folder(uid, title=title, overwrite=True),
            updating="rename",
        )  # fmt: skip

    def datasource(self, prometheus_url: Optional[str]) -> Change:
        """The Prometheus data source; without a URL an existing one is kept as it is."""
        uid = DATASOURCE_UID
        existing = self._find(f"data source {uid}", lambda: self.api.datasource.get_datasource_by_uid(uid))
        wanted: Json = {
            "uid": uid,
            "name": DATASOURCE_NAME,
            "type": "prometheus",
            "access": "proxy",
            "url": prometheus_url or (existing or {}).get("url") or DEFAULT_PROMETHEUS_URL,
            # POST carries long PromQL expressions that a GET query string may truncate.
            "jsonData": {"httpMethod": "POST"},
        }
        return self._settle(
            "datasource", uid, existing, existing is not None and contains(existing, wanted),
            lambda: self.api.datasource.create_datasource(wanted),
            lambda: self.api.datasource.update_datasource_by_uid(uid, wanted),
            named="data source",
        )  # fmt: skip

    def dashboard(self, board: Json, folder: str) -> Change:
        uid = board["uid"]
        existing = self._find(f"dashboard {uid}", lambda: self.api.dashboard.get_dashboard(uid))
        if existing is not None:
            stored = existing.get("dashboard", {})
            in_folder = existing.get("meta", {}).get("folderUid") == folder
            if in_folder and _without_revision(stored) == _without_revision(board):
                return Change("dashboard", uid, "unchanged")
        with self._doing(f"save dashboard {uid}"):
            self.api.dashboard.update_dashboard(
                {
                    "dashboard": {**board, "id": None},
                    "folderUid": folder,
                    "overwrite": True,
                    "message": "ringtrain dashboards push",
                }
            )
        return Change("dashboard", uid, "created" if existing is None else "updated")

    def alert_rule(self, rule: Json) -> Change:
        uid = rule["uid"]
        existing = self._find(f"alert rule {uid}", lambda: self.api.alertingprovisioning.get_alertrule(uid))
        return self._settle(
            "alert rule", uid, existing, existing is not None and contains(existing, rule),
            lambda: self.api.alertingprovisioning.create_alertrule(rule),
            lambda: self.api.alertingprovisioning.update_alertrule(uid, rule),
        )  # fmt: skip


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def push(
    url: str,
    auth: Auth,
    *,
    folder_title: str,
    prometheus_url: Optional[str],
    timeout: float,
) -> list[Change]:
    """Provision the folder, the data source, the dashboards and the alert rules, in that order.

    The order matters: dashboards go into the folder, and alert rules need both the folder and
    the data source they query.
    """
    provisioner = Provisioner(connect(url, auth, timeout), url, timeout)
    changes = [provisioner.folder(folder_title), provisioner.datasource(prometheus_url)]
    folder = folder_uid(folder_title)
    for build in dashboards.DASHBOARDS.values():
        pinned = panels.with_datasource(build(), DATASOURCE_UID, DATASOURCE_NAME)
        changes.append(provisioner.dashboard(pinned, folder))
    for rule in alerts.ALERT_RULES:
        changes.append(provisioner.alert_rule(alerts.alert_rule(rule, DATASOURCE_UID, folder)))
    return changes
