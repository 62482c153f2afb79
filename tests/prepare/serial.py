"""`ringtrain prepare` in this process with no Ray, for tests of what the driver does with what the
actors produce: the in-process path prepare takes for a small local corpus
(``pipeline.chunks_in_process``: the actors' own code, in plan order), forced whatever the
corpus's size or place. The Ray transport of the same rows is checked on a real cluster in
test_prepare_ray.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest


def run_serially(monkeypatch: pytest.MonkeyPatch) -> None:
    from ringtrain.prepare import pipeline

    def chunks(pieces: list[Any], job: Any, parallelism: int) -> Iterator[dict[str, Any]]:
        return pipeline.chunks_in_process(pieces, job)

    def connect(address: Any, num_cpus: Any) -> Any:
        return pipeline._Borrowed()

    monkeypatch.setattr(pipeline, "chunks", chunks)
    monkeypatch.setattr(pipeline, "connect", connect)
