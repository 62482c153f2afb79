"""The outside tools some checks run against, and the one rule for when one is missing.

promtool, Prometheus, Chromium and shellcheck come from Debian packages (`make tools`), KubeRay's
CRDs from the shared data folder next to the repository. On a developer's machine a missing one
skips its check and says how to get it. Where the environment variable ``CI`` is set (to
anything but empty, ``0`` or ``false``) it fails the check instead: CI installs every tool
before it tests, so a missing one there is a broken setup, and a skip would hide that the check
never ran.
"""

from __future__ import annotations

import os
import shutil
from typing import NoReturn

import pytest

# command -> how to get it (the Makefile's tools target installs each of them as root).
INSTALL = {
    "promtool": "make tools, or: apt-get install --no-install-recommends prometheus",
    "prometheus": "make tools, or: apt-get install --no-install-recommends prometheus",
    "chromium": "make tools, or: apt-get install --no-install-recommends chromium",
    "shellcheck": "make tools, or: apt-get install --no-install-recommends shellcheck",
}


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false")


def missing(what: str) -> NoReturn:
    """Skip the calling test for lack of ``what``; fail it under CI."""
    if in_ci():
        pytest.fail(f"{what}; CI is set, so this check fails instead of skipping", pytrace=False)
    pytest.skip(what)


def tool(command: str) -> str:
    """The path of ``command`` on PATH; the test skips (fails under CI) without it."""
    path = shutil.which(command)
    if path is None:
        missing(f"{command} is not installed ({INSTALL[command]})")
    return path
