"""`ringtrain prepare` in this process with no Ray, for tests of what the driver does with what the
actors produce: the actors' own code (PieceTokenizer, fed the pipeline's input rows) is called in
plan order, and everything else runs as it does on Ray. The Ray transport of the same rows is
checked on a real cluster in test_prepare_ray.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest


def run_serially(monkeypatch: pytest.MonkeyPatch) -> None:
    from ringtrain.prepare import pipeline

    def chunks(pieces: list[Any], job: Any, parallelism: int) -> Iterator[dict[str, Any]]:
        actor = pipeline.PieceTokenizer(job)
        for item in pipeline.piece_items(pieces):
            for row in actor({k: np.array([v]) for k, v in item.items()}):
                yield {k: v[0] for k, v in row.items()}

    def connect(address: Any, num_cpus: Any) -> Any:
        return pipeline._Borrowed()

    monkeypatch.setattr(pipeline, "chunks", chunks)
    monkeypatch.setattr(pipeline, "connect", connect)
