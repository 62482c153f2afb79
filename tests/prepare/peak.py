"""`ringtrain prepare` run as the serial fixture runs it (the actors' code in this process), for a
test to read its peak memory: ``python -m tests.prepare.peak <prepare arguments>`` exits with
prepare's exit code and writes the process's peak resident memory in bytes to $PEAK_FILE."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

from ringtrain import cli
from tests.prepare.serial import run_serially


def main() -> int:
    run_serially(pytest.MonkeyPatch())
    code = cli.main(["prepare", *sys.argv[1:]])
    Path(os.environ["PEAK_FILE"]).write_text(str(peak_resident_bytes()))
    return code


def peak_resident_bytes() -> int:
    """This program's peak resident memory: the VmHWM of its own address space. Not getrusage's
    ru_maxrss, which keeps the high-water mark of the process image exec replaced (the parent's,
    a pytest process that may hold a GiB by then)."""
    status = Path("/proc/self/status").read_text()
    return int(re.search(r"^VmHWM:\s+(\d+) kB", status, re.M).group(1)) * 1024


if __name__ == "__main__":
    sys.exit(main())
