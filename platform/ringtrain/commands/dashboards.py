"""`ringtrain dashboards export|push`: the dashboards' and alert rules' door to the command line.

``add_arguments`` fills the ``dashboards`` subcommand's parser and ``run`` executes it. Exit
codes: 0 done, 1 the push failed (or ``export --check`` found stale files), 2 bad input: one
line naming the flag, no traceback.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path
from typing import Optional
from urllib.parse import urlsplit

from ringtrain.errors import EXIT_FAILED, EXIT_OK, ConfigError, end
from ringtrain.telemetry import dashboards, panels

# The checkout this module sits in: platform/ringtrain/commands/ -> the repository root.
REPO = Path(__file__).resolve().parents[3]
DEFAULT_OUT = ("dashboards", "helm/ringtrain/dashboards")
DEFAULT_FOLDER = "ringtrain"
DEFAULT_TIMEOUT_S = "10"
TOKEN_ENV, PASSWORD_ENV = "GRAFANA_TOKEN", "GRAFANA_PASSWORD"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``dashboards`` subcommand's actions. Values are checked in ``run`` so errors stay one line."""
    actions = parser.add_subparsers(dest="dashboards_action", metavar="{export,push}")
    export = actions.add_parser("export", help="write the dashboards' JSON files")
    export.add_argument(
        "--out",
        action="append",
        metavar="DIR",
        help=f"folder to write to; repeat for several (default: {' and '.join(DEFAULT_OUT)} of this checkout)",
    )
    export.add_argument(
        "--check", action="store_true", help="write nothing; exit 1 if a file differs from what would be written"
    )

    push = actions.add_parser("push", help="provision a Grafana: folder, Prometheus data source, dashboards, alerts")
    push.add_argument("--grafana-url", help="Grafana's base URL, e.g. http://grafana.monitoring:3000")
    push.add_argument("--token", help=f"a service account token (default: ${TOKEN_ENV})")
    push.add_argument("--user", help="basic-auth user, with --password")
    push.add_argument("--password", help=f"basic-auth password (default: ${PASSWORD_ENV})")
    push.add_argument("--folder", default=DEFAULT_FOLDER, help=f"Grafana folder title (default {DEFAULT_FOLDER})")
    push.add_argument(
        "--prometheus-url",
        help="URL Grafana reaches Prometheus at (default: keep the data source's URL; "
        "http://127.0.0.1:9090 when creating it)",
    )
    push.add_argument(
        "--timeout", default=DEFAULT_TIMEOUT_S, help=f"seconds to wait for each answer (default {DEFAULT_TIMEOUT_S})"
    )


def run(args: argparse.Namespace) -> int:
    """Execute ``ringtrain dashboards ...``; prints what it did and returns the exit code."""
    try:
        if args.dashboards_action == "export":
            return _export(args)
        if args.dashboards_action == "push":
            return _push(args)
        raise ConfigError("dashboards", "name an action: export or push")
    except ConfigError as exc:
        return end(exc)


def _export(args: argparse.Namespace) -> int:
    folders = [Path(out) for out in args.out] if args.out else _default_folders()
    for folder in folders:
        if folder.exists() and not folder.is_dir():
            raise ConfigError("--out", f"{folder} is a file, not a folder")
    texts = {name: panels.render(build()) for name, build in dashboards.DASHBOARDS.items()}
    stale = []
    for folder in folders:
        for name, text in texts.items():
            path = folder / name
            current = path.read_text(encoding="utf-8") if path.is_file() else None
            if current == text:
                print(f"{_shown(path)}: unchanged")
                continue
            if args.check:
                stale.append(_shown(path))
                continue
            try:
                folder.mkdir(parents=True, exist_ok=True)
                path.write_text(text, encoding="utf-8")
            except OSError as exc:
                print(f"ringtrain: dashboards export: cannot write {_shown(path)}: {exc.strerror}", file=sys.stderr)
                return EXIT_FAILED
            print(f"{_shown(path)}: {'created' if current is None else 'updated'}")
    if stale:
        print(
            f"ringtrain: dashboards export --check: stale {', '.join(stale)}; run `ringtrain dashboards export`",
            file=sys.stderr,
        )
        return EXIT_FAILED
    return EXIT_OK


def _default_folders() -> list[Path]:
    if not (REPO / "helm" / "ringtrain" / "Chart.yaml").is_file():
        raise ConfigError("--out", "not running from a ringtrain checkout: name the folder(s) to write to")
    return [REPO / out for out in DEFAULT_OUT]


def _shown(path: Path) -> str:
    """``path`` relative to the working directory when it lies below it, for shorter lines."""
    try:
        return str(path.resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def _push(args: argparse.Namespace) -> int:
    url = _http_url("--grafana-url", args.grafana_url)
    if args.prometheus_url is not None:
        _http_url("--prometheus-url", args.prometheus_url)
    auth = _auth(args)
    timeout = _timeout(args.timeout)
    folder = args.folder.strip()
    # grafana-client (and the HTTP stack under it) loads only for a push with valid input.
    from ringtrain.telemetry import grafana

    if not grafana.folder_uid(folder):
        raise ConfigError("--folder", f"{args.folder!r} needs at least one letter or digit")
    try:
        changes = grafana.push(
            url, auth, folder_title=folder, prometheus_url=args.prometheus_url, timeout=timeout
        )
    except grafana.GrafanaAuthError as exc:
        print(f"ringtrain: dashboards push failed: {exc}; check --token, or --user and --password", file=sys.stderr)
        return EXIT_FAILED
    except grafana.GrafanaPushError as exc:
        print(f"ringtrain: dashboards push failed: {exc}", file=sys.stderr)
        return EXIT_FAILED
    for change in changes:
        print(f"{change.kind} {change.uid}: {change.action}")
    counts = {action: sum(c.action == action for c in changes) for action in ("created", "updated", "unchanged")}
    print(f"pushed to {url}: " + ", ".join(f"{n} {action}" for action, n in counts.items()))
    return EXIT_OK


def _http_url(flag: str, value: Optional[str]) -> str:
    if not value:
        raise ConfigError(flag, "is required, e.g. http://127.0.0.1:3000")
    try:
        parts = urlsplit(value)
        # Reading the port parses it: a malformed one raises here rather than at connect time.
        has_host = bool(parts.hostname) and parts.port != 0
    except ValueError as exc:
        raise ConfigError(flag, f"{value!r} is not a URL ({exc})") from None
    if parts.scheme not in ("http", "https") or not has_host:
        raise ConfigError(flag, f"{value!r} is not an http(s) URL with a host, e.g. http://127.0.0.1:3000")
    if parts.username or parts.password:
        raise ConfigError(flag, "keep credentials out of the URL: use --token, or --user and --password")
    if parts.query or parts.fragment:
        raise ConfigError(flag, f"{value!r} has a query or fragment; give the base URL only")
    return value.rstrip("/")


def _auth(args: argparse.Namespace) -> str | tuple[str, str]:
    if args.token and args.user:
        raise ConfigError("--token", "give either --token or --user and --password, not both")
    if args.user:
        password = args.password or os.environ.get(PASSWORD_ENV)
        if not password:
            raise ConfigError("--password", f"is required with --user (or set {PASSWORD_ENV})")
        return (args.user, password)
    if args.password:
        raise ConfigError("--user", "is required with --password")
    token = args.token or os.environ.get(TOKEN_ENV)
    if not token:
        raise ConfigError("--token", f"Grafana needs credentials: --token (or {TOKEN_ENV}), or --user and --password")
    return token


def _timeout(value: str) -> float:
    try:
        seconds = float(value)
    except ValueError:
        raise ConfigError("--timeout", f"{value!r} is not a number of seconds") from None
    if not (math.isfinite(seconds) and seconds > 0):
        raise ConfigError("--timeout", f"must be a positive number of seconds (got {value})")
    return seconds
