"""`ringtrain report RUN_DIR [--open]`: the run report's door to the command line.

``add_arguments`` fills the ``report`` subcommand's parser and ``run`` executes it. Exit
codes: 0 the report was written (warnings about missing or damaged files go to stderr, and
into the page), 1 it could not be written, 2 RUN_DIR does not exist, or a file of it is a link
out of it (``telemetry.runfiles``): one line naming it.
"""

from __future__ import annotations

import argparse
import sys
import webbrowser
from pathlib import Path

from ringtrain.errors import EXIT_OK, EXIT_USAGE, RingtrainError, end
from ringtrain.telemetry.report import REPORT_NAME, write_report


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``report`` subcommand's arguments."""
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a run directory, e.g. runs/quickstart-20250101-120000")
    parser.add_argument("--open", action="store_true", help=f"open {REPORT_NAME} in the default web browser")


def run(args: argparse.Namespace) -> int:
    """Execute ``ringtrain report``; prints the report's path and returns the exit code."""
    run_dir = Path(args.run_dir)
    if not run_dir.exists():
        print(f"ringtrain: report: run directory {run_dir} does not exist", file=sys.stderr)
        return EXIT_USAGE
    if not run_dir.is_dir():
        print(f"ringtrain: report: {run_dir} is a file, not a run directory", file=sys.stderr)
        return EXIT_USAGE
    try:
        path, warnings = _written(run_dir)
    except RingtrainError as exc:
        return end(exc, "report")
    for warning in warnings:
        print(f"ringtrain: report: warning: {warning}", file=sys.stderr)
    print(path)
    if args.open and not webbrowser.open(path.resolve().as_uri()):
        print(f"ringtrain: report: no web browser found; open {path} by hand", file=sys.stderr)
    return EXIT_OK


def _written(run_dir: Path) -> tuple[Path, list[str]]:
    """``write_report``'s answer; a run's file that links out of it is bad input (ConfigError),
    and a file of the run that cannot be read, or a folder that cannot be written, is a failure
    the OS names."""
    try:
        return write_report(run_dir)
    except OSError as exc:
        raise RingtrainError(f"cannot write {run_dir / REPORT_NAME}: {exc}") from exc
