"""A worker reads its model's tokenizer once: every generation that stops on text decodes with
it (an lm-eval task asks for one generation per request), so reading tokenizer.json again at
each would parse the file once per request. A world of another model folder reads that folder's.
The worker runs as a plain object; the Evaluator is a stand-in that decodes with what it is given.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Optional

import pytest

from ringtrain import config
from ringtrain.actors.worker import TrainWorker
from ringtrain.evaluation import tokenizer as tokenizer_module
from ringtrain.evaluation.generation import GenerationRequest
from ringtrain.evaluation.stops import StopRule
from ringtrain.evaluation.text import ByteTokenizer
from ringtrain.train import evaluator as evaluator_module
from ringtrain_dev.tiny_tokenizer import save_tokenizer

IDS = [40, 41, 42, 43]


def tokenizer_reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The model folders ``find_tokenizer`` reads from now on, in order (it still reads them)."""
    reads: list[str] = []
    find = tokenizer_module.find_tokenizer

    def counted(path: str) -> Any:
        reads.append(path)
        return find(path)

    monkeypatch.setattr(tokenizer_module, "find_tokenizer", counted)
    return reads


class _Decoding:
    """An Evaluator that returns the text of IDS as ``decode`` makes it."""

    def generate(self, request: GenerationRequest, decode: Optional[Any] = None) -> list[str]:
        return [decode(IDS)]


def test_generations_read_the_tokenizer_once_per_model_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = save_tokenizer(tmp_path / "model")
    find = tokenizer_module.find_tokenizer
    reads = tokenizer_reads(monkeypatch)
    monkeypatch.setattr(evaluator_module.Evaluator, "of", classmethod(lambda cls, trainer: _Decoding()))
    job = config.load(None, [])
    job.model = dataclasses.replace(job.model, hf=str(folder))
    worker = TrainWorker(job, 0, "cpu")
    worker._trainer = object()  # joined: generate runs on its world
    request = GenerationRequest.of([[1, 2]], 4, stop=StopRule(strings=("\n",)))

    texts = [worker.generate(request) for _ in range(3)]
    assert texts == [[find(str(folder)).decode(IDS)]] * 3
    assert reads == [str(folder)]

    # A later world's job names a folder without a tokenizer: its text is bytes.
    bare = tmp_path / "bare"
    bare.mkdir()
    worker.job = dataclasses.replace(job, model=dataclasses.replace(job.model, hf=str(bare)))
    assert worker.generate(request) == [ByteTokenizer().decode(IDS)]
    assert reads == [str(folder), str(bare)]
