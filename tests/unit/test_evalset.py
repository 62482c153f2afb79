"""EvalSet: sequences read from each kind of source, their labels, and padding for a mesh."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ringtrain.errors import ConfigError
from ringtrain.evaluation.tokenizer import find_tokenizer
from ringtrain.topology import sequence_positions
from ringtrain.train.data import IGNORE_INDEX
from ringtrain.train.evalset import DEFAULT_WINDOWS, load_eval_set
from ringtrain_dev.prepared_data import random_documents, write_prepared
from ringtrain_dev.tiny_tokenizer import save_tokenizer


def test_rows_are_labelled_as_transformers_does(tmp_path: Path) -> None:
    rows = np.arange(3 * 6).reshape(3, 6)
    np.save(tmp_path / "rows.npy", rows.astype(np.int32))
    s = load_eval_set(str(tmp_path / "rows.npy"), seq_len=999, vocab_size=32)
    assert s.num_rows == 3 and s.seq_len == 6 and s.num_labels == 3 * 5
    np.testing.assert_array_equal(s.inputs, rows)
    np.testing.assert_array_equal(s.labels[:, :-1], rows[:, 1:])
    assert (s.labels[:, -1] == IGNORE_INDEX).all()
    assert load_eval_set(str(tmp_path / "rows.npy"), seq_len=6, vocab_size=32, max_rows=2).num_rows == 2


def test_a_stream_gives_windows_spread_over_it(tmp_path: Path) -> None:
    stream = np.arange(1000, dtype=np.uint16)
    path = tmp_path / "tokens.bin"
    stream.tofile(path)
    s = load_eval_set(str(path), seq_len=10, vocab_size=1000, max_rows=4)
    assert s.num_rows == 4 and s.seq_len == 10 and s.num_labels == 40
    np.testing.assert_array_equal(s.labels, s.inputs + 1)  # the next token of a counting stream
    assert s.inputs[0, 0] == 0 and s.inputs[-1, -1] == 998  # the first and the last window of the stream
    few = load_eval_set(str(path), seq_len=400, vocab_size=1000)
    assert few.num_rows == 2  # only two windows fit, fewer than the default
    assert load_eval_set("stdlib", seq_len=64, vocab_size=256).num_rows == DEFAULT_WINDOWS


def test_padding_predicts_nothing_and_rows_split_evenly(tmp_path: Path) -> None:
    np.save(tmp_path / "rows.npy", np.arange(3 * 30).reshape(3, 30) % 50)
    s = load_eval_set(str(tmp_path / "rows.npy"), seq_len=30, vocab_size=50)
    padded = s.padded(multiple=4, rows_multiple=2)
    assert padded.inputs.shape == (4, 32) and padded.num_labels == s.num_labels == 3 * 29
    assert (padded.labels[3] == IGNORE_INDEX).all() and (padded.labels[:, 30:] == IGNORE_INDEX).all()
    assert [list(padded.replica_rows(d, 2)) for d in range(2)] == [[0, 1], [2, 3]]
    # Under cp=2 every position is scored by exactly one rank.
    held = sorted(p for r in range(2) for p in sequence_positions(32, 2, 1, r, 0))
    assert held == list(range(32))


def test_text_is_tokenized_when_the_model_has_a_tokenizer(tmp_path: Path) -> None:
    text = tmp_path / "text.txt"
    text.write_text("The pass key is 12345. Remember it. " * 200)
    tokenizer = find_tokenizer(str(save_tokenizer(tmp_path / "model")))
    assert tokenizer is not None
    s = load_eval_set(str(text), seq_len=16, vocab_size=96, max_rows=3, tokenizer=tokenizer)
    assert s.num_rows == 3 and s.seq_len == 16
    assert "pass key" in tokenizer.decode(s.inputs[0].tolist())
    as_bytes = load_eval_set(str(text), seq_len=16, vocab_size=256, max_rows=3)
    assert as_bytes.inputs.max() < 256 and bytes(as_bytes.inputs[0].tolist()).decode() in text.read_text()
    assert find_tokenizer("") is None and find_tokenizer(str(tmp_path)) is None


def test_a_prepared_text_dataset_gives_windows_of_its_token_stream(tmp_path: Path) -> None:
    """Its documents end to end, as training reads them, whatever the model's tokenizer; never
    the bytes of its manifest and shard files."""
    docs = random_documents(9, vocab_size=90, eos_id=2, min_len=5, max_len=30, seed=3)
    write_prepared(tmp_path / "ptext", docs, vocab_size=90, eos_id=2, docs_per_shard=4)
    stream = np.concatenate(docs)
    tokenizer = find_tokenizer(str(save_tokenizer(tmp_path / "model")))
    s = load_eval_set(str(tmp_path / "ptext"), seq_len=16, vocab_size=96, max_rows=5, tokenizer=tokenizer)
    assert s.num_rows == 5 and s.seq_len == 16
    starts = [round(i * (stream.size - 17) / 4) for i in range(5)]  # spread from the first token to the last
    np.testing.assert_array_equal(s.inputs, np.stack([stream[a : a + 16] for a in starts]))
    np.testing.assert_array_equal(s.labels, np.stack([stream[a + 1 : a + 17] for a in starts]))
    with pytest.raises(ConfigError, match=f"holds {stream.size} tokens, fewer than seq_len"):
        load_eval_set(str(tmp_path / "ptext"), seq_len=stream.size, vocab_size=96, key="--data")
    with pytest.raises(ConfigError, match=r"token id \d+, outside the model's vocabulary"):
        load_eval_set(str(tmp_path / "ptext"), seq_len=16, vocab_size=80)


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda p: str(p / "missing.npy"), "no such file"),
        (lambda p: _save(p / "big.npy", np.full((2, 8), 70)), "token id 70, outside the model's vocabulary"),
        (lambda p: _save(p / "short.npy", np.zeros((2, 1), dtype=np.int64)), "nothing to predict"),
        (lambda p: _save(p / "tiny.npy", np.zeros(5, dtype=np.int64)), "fewer than seq_len"),
        (lambda p: _save(p / "floats.npy", np.zeros((2, 4))), "integer token ids"),
    ],
)
def test_bad_data_names_the_key(tmp_path: Path, make, match: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ConfigError, match=match) as info:
        load_eval_set(make(tmp_path), seq_len=8, vocab_size=64, key="--data")
    assert info.value.key == "--data"


def _save(path: Path, array: np.ndarray) -> str:
    np.save(path, array)
    return str(path)
