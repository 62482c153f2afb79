"""The README's and docs/' runnable blocks that start a cluster (`ringtrain run`, `eval`,
`prepare`), run as a reader would: a page's blocks in order, in one workspace, on tiny jobs,
each command with the embedded Ray cluster the pages describe.

The rules and the workspace are tests/docs_blocks.py's; the blocks that start no cluster run in
tests/unit/test_docs_commands.py. No process a page's clusters started may be left afterwards.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Iterator

import pytest

from ringtrain_dev.ray_head import end_processes, processes_using
from tests.docs_blocks import PAGES, RUNNABLE, Workspace, blocks

pytestmark = [pytest.mark.ray, pytest.mark.slow]

BLOCK_TIMEOUT_S = 600.0
CLUSTER_PAGES = [p for p in PAGES if any(b.marker == RUNNABLE and b.starts_a_cluster for b in blocks(p))]


@pytest.fixture
def ray_tmp() -> Iterator[Path]:
    # Short on purpose: Ray's unix socket paths live below it and must stay under 107 bytes.
    path = Path(tempfile.mkdtemp(prefix="rtd-", dir="/tmp"))
    try:
        yield path
    finally:
        end_processes(path)  # only when the test failed before its own check
        shutil.rmtree(path, ignore_errors=True)


@pytest.mark.parametrize("page", CLUSTER_PAGES, ids=lambda p: p.name)
def test_a_pages_examples_run_in_order(page: Path, tmp_path: Path, ray_tmp: Path) -> None:
    workspace = Workspace(tmp_path / "ws", ray_tmp)
    for block in blocks(page):
        if block.marker != RUNNABLE or not block.starts_a_cluster:
            continue
        done = workspace.run(block.text, timeout=BLOCK_TIMEOUT_S)
        assert done.returncode == 0, f"{block.where} failed ({done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    assert processes_using(ray_tmp) == []
