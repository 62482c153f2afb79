"""Fixtures of the prepare tier: a small stdlib corpus and its BPE tokenizer, built once per session."""

from __future__ import annotations

from pathlib import Path

import pytest

from ringtrain_dev.corpus import build_corpus, save_tokenizer
from tests.prepare.serial import run_serially


@pytest.fixture(scope="session")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder of three files (plain JSONL, .jsonl.gz, Parquet in row groups of 32) of stdlib documents."""
    folder = tmp_path_factory.mktemp("corpus")
    build_corpus(folder, num_modules=24, num_files=3, row_group_size=32)
    return folder


@pytest.fixture(scope="session")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model-style folder holding a BPE tokenizer.json trained on the same text (EOS </s> = 2)."""
    return save_tokenizer(tmp_path_factory.mktemp("tok"), num_modules=24, vocab_size=1024)


@pytest.fixture
def serial(monkeypatch: pytest.MonkeyPatch) -> None:
    """`ringtrain prepare` runs in this process without Ray (see tests/prepare/serial.py)."""
    run_serially(monkeypatch)
