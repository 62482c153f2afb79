"""Shared by every test tier. Being the conftest of the ``tests`` package, it also puts the
repository root on sys.path, so folders without an ``__init__.py`` (tests/helm, tests/unit)
can import ``tests.tools`` however pytest is started."""

from __future__ import annotations

import shutil

import pytest

from tests.tools import INSTALL, in_ci


def pytest_report_header(config: pytest.Config) -> list[str]:
    found = {command: shutil.which(command) for command in INSTALL}
    absent = sorted(command for command, path in found.items() if path is None)
    parts = [f"{command} {path}" for command, path in sorted(found.items()) if path]
    if absent:
        parts.append(f"missing {', '.join(absent)} ({'their checks fail: CI is set' if in_ci() else 'their checks skip'})")
    return ["tools: " + "; ".join(parts)]
