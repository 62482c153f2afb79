"""`ringtrain prepare` run as the serial fixture runs it (the actors' code in this process), for a
test to read its peak memory: ``python -m tests.prepare.peak <prepare arguments>`` exits with
prepare's exit code and writes the process's peak resident memory in bytes to $PEAK_FILE."""

from __future__ import annotations

import os
import resource
import sys
from pathlib import Path

import pytest

from ringtrain import cli
from tests.prepare.serial import run_serially


def main() -> int:
    run_serially(pytest.MonkeyPatch())
    code = cli.main(["prepare", *sys.argv[1:]])
    Path(os.environ["PEAK_FILE"]).write_text(str(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024))
    return code


if __name__ == "__main__":
    sys.exit(main())
