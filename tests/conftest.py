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


# With ``--dist loadfile`` the workers take whole files in collection order, and a long file
# taken last keeps one worker busy for minutes while the other has nothing left (the docs' Ray
# examples alone run for several). So the Ray tier goes out first, its longest file first, and
# the many short files after it keep both workers busy to the end.
FIRST_FILES = ("tests/ray/test_docs_examples.py", "tests/ray/")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        return next((i for i, prefix in enumerate(FIRST_FILES) if item.nodeid.startswith(prefix)), len(FIRST_FILES))

    items.sort(key=rank)  # stable: each file's tests, and the files of each rank, keep their order
