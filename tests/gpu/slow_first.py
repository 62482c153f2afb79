"""Where tests/gpu's slow tests run under pytest-xdist's ``worksteal``: at the head of each
worker's first share, so that they run side by side from the start.

bench/gpu_check.py loads it for its tests part (``-p tests.gpu.slow_first --dist worksteal``);
it acts wherever pytest-xdist runs two workers or more.
Of the tests there, four take most of the part: the Trainer's bf16 snapshot round trip at each
ZeRO stage, 42-49 s each on an H100 and an H200 (two processes each), against about a minute for
the other 170 together (bench/results/gpu-check-h100/tests.jsonl). In collection order they come
last, and xdist's load scheduling hands a worker two tests at a time at the end: two of them ran
on one worker, one after the other, and the part took 119 s on four workers
(bench/results/gpu-check-h200/rerun.log). Led by them, each worker starts with one, and the part
takes about the longest of them plus a share of the rest.

``worksteal`` splits the collection into contiguous shares first (the i-th worker gets the tests
left divided by the workers left, xdist/scheduler/worksteal.py's ``check_schedule``), then moves
tests from the tail of a busy worker's queue to an idle one, so a test at the head of a share
runs first where it was sent. Tests marked ``slow`` go to the heads in turn (the k-th to share k
modulo the workers); the others keep their order. Every worker orders the same collection the
same way, as xdist requires.

Loaded by every run that names it, so it imports nothing beyond the stdlib and pytest.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Sequence
from typing import TypeVar

import pytest

Item = TypeVar("Item")

WORKERS_ENV = "PYTEST_XDIST_WORKER_COUNT"  # set by pytest-xdist in each worker


def first_shares(count: int, workers: int) -> list[int]:
    """How many of ``count`` tests each of ``workers`` gets in worksteal's first split."""
    sizes = []
    left = count
    for i in range(workers):
        sizes.append(left // (workers - i))
        left -= sizes[-1]
    return sizes


def slow_first(items: Sequence[Item], slow: Callable[[Item], bool], workers: int) -> list[Item]:
    """``items`` reordered so that each of the ``workers`` first shares starts with slow ones."""
    slow_items = [item for item in items if slow(item)]
    rest = iter([item for item in items if not slow(item)])
    ordered: list[Item] = []
    for share, size in enumerate(first_shares(len(items), workers)):
        leads = slow_items[share::workers]
        ordered += leads + list(itertools.islice(rest, max(0, size - len(leads))))
    return ordered + list(rest)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Only workers collect under xdist, and a worker's own --dist reads "no": the mode is the one
    # its controller was given with this plugin (bench/gpu_check.py's, worksteal).
    workers = int(os.environ.get(WORKERS_ENV, "0"))
    if workers > 1:
        items[:] = slow_first(items, lambda item: item.get_closest_marker("slow") is not None, workers)
