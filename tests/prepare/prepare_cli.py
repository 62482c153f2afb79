"""``ringtrain prepare`` through the command line in the test's process, and what it wrote."""

from __future__ import annotations

from pathlib import Path

import pytest

from ringtrain import cli


def prepare(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """``ringtrain prepare --quiet ARGS``: its exit code, stdout and stderr."""
    code = cli.main(["prepare", "--quiet", *args])
    out, err = capsys.readouterr()
    return code, out, err


def files_of(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` by its relative path, with its bytes."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}
