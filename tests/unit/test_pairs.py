"""Preference pairs in rows, as the driver and ``ringtrain eval`` see them: the rows ``--max-rows``
keeps are the rows a pass over the pairs reads."""

from __future__ import annotations

import json
import random
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from ringtrain import cli
from ringtrain.train.data import MicroBatch
from ringtrain.train.pairs import STORED_DOCUMENTS
from ringtrain.train.pairset import PairSet, load_pair_set
from ringtrain_dev.tiny_tokenizer import CHAT_WORDS, save_chat_tokenizer

VOCAB, SEQ, NUM_PAIRS = 320, 64, 30


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A preference dataset of NUM_PAIRS pairs, a few longer than SEQ tokens."""
    root = tmp_path_factory.mktemp("pairs")
    rng = random.Random(2)

    def say(low: int, high: int) -> str:
        return " ".join(rng.choice(CHAT_WORDS) for _ in range(rng.randint(low, high)))

    records = [{"prompt": say(2, 30 if i % 5 == 0 else 6), "chosen": say(1, 5), "rejected": say(1, 5)}
               for i in range(NUM_PAIRS)]  # fmt: skip
    (root / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    tokenizer = save_chat_tokenizer(root / "tokenizer", "chatml", vocab_size=VOCAB)
    assert cli.main(["prepare", str(root / "pairs.jsonl"), "--format", "preference", "--tokenizer", str(tokenizer),
                     "--out", str(root / "data"), "--quiet"]) == 0  # fmt: skip
    return root / "data"


def _pair_set(path: Path, **kwargs: Any) -> PairSet:
    return load_pair_set(str(path), seq_len=SEQ, multiple=2, vocab_size=VOCAB, prefix_sharing=True, overlong="drop",
                         packing="next_fit", **kwargs)  # fmt: skip


def _trained_tokens(path: Path) -> np.ndarray:
    """Each stored pair's (chosen, rejected) trained-token counts: their masks' sums."""
    from ringtrain.train.corpus import PreparedCorpus

    corpus = PreparedCorpus(str(path))
    try:
        spans = [corpus.document_span(d) for d in range(corpus.manifest.num_documents)]
        masks = np.asarray([int(corpus.mask(lo, hi).sum()) for lo, hi in spans]).reshape(-1, STORED_DOCUMENTS)
    finally:
        corpus.close()
    return masks[:, 1:]


def test_eval_capped_by_max_rows_scores_the_rows_it_keeps(dataset: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``ringtrain eval --max-rows N`` on pairs: the pass over them (``pair_logps``, here on one
    rank whose every token has loss 1) reads the N rows kept, no more, and fills the table rows of
    their pairs alone, the dataset's counts and table size unchanged."""
    from ringtrain.train.reference import pair_logps, pairs_data

    whole, capped = _pair_set(dataset), _pair_set(dataset, max_rows=2)
    assert whole.num_rows > 2 and capped.num_rows == 2 and whole.layout.dropped > 0
    layout = capped.pair_rows()
    assert layout.num_rows == 2
    assert [tuple(layout.row(r)[0].tolist()) for r in range(2)] == [row.pairs for row in capped.rows]
    assert (layout.total, layout.dropped, layout.truncated) == (NUM_PAIRS, whole.layout.dropped, whole.layout.truncated)

    monkeypatch.setattr(torch.distributed, "all_reduce", lambda *args, **kwargs: None)  # a world of one
    topology = types.SimpleNamespace(dp=1, ring=1, ulysses=1)
    coord = types.SimpleNamespace(replica=0, ring_idx=0, ulysses_idx=0, ring_pos=0)

    def token_losses(mb: MicroBatch) -> torch.Tensor:
        return torch.ones(mb.input_ids.size, dtype=torch.float32)

    one_rank = types.SimpleNamespace(mesh=types.SimpleNamespace(topology=topology, coord=coord, cp_group=None),
                                     device=torch.device("cpu"), model=torch.nn.Linear(1, 1),
                                     data=types.SimpleNamespace(vocab_size=VOCAB), token_losses=token_losses)  # fmt: skip
    policy, counts = pair_logps(one_rank, pairs_data(one_rank, capped, capped.seq_len))  # type: ignore[arg-type]
    scored = sorted(p for row in capped.rows for p in row.pairs)
    assert policy.shape == counts.shape == (NUM_PAIRS, 2)
    np.testing.assert_array_equal(counts[scored], _trained_tokens(dataset)[scored])
    np.testing.assert_array_equal(policy[scored], -counts[scored])
    rest = np.setdiff1d(np.arange(NUM_PAIRS), scored)
    assert not counts[rest].any() and not policy[rest].any()


def _job(path: Path, *overrides: str) -> Any:
    from ringtrain import config

    return config.load(None, [f"model.vocab_size={VOCAB}", f"data.path={path}", "data.packing=doc", f"data.seq_len={SEQ}",
                              "train.objective=simpo", *overrides])  # fmt: skip


def _laid_out(path: Path) -> np.ndarray:
    """Each stored pair's tokens laid out whole in a row, its prompt shared, from its parts' lengths."""
    from ringtrain.train.corpus import PreparedCorpus
    from ringtrain.train.pairs import row_length

    corpus = PreparedCorpus(str(path))
    try:
        parts = corpus.document_lengths().reshape(-1, STORED_DOCUMENTS)
    finally:
        corpus.close()
    return row_length(parts[:, 0], parts[:, 1], parts[:, 2], True)


@pytest.mark.parametrize("overlong", ["drop", "truncate_start"])
def test_the_driver_counts_the_pairs_seq_len_dropped_or_cut(
    dataset: Path, overlong: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """The console's note before the first step, summary.json's "chat" (``chat_packing_counts``)
    and report.html say how the preference dataset packs, as the workers pack it, and what
    data.seq_len cost it."""
    import io

    from ringtrain.commands.run import _chat_data_note
    from ringtrain.telemetry.progress import Progress
    from ringtrain.telemetry.report import render
    from ringtrain.telemetry.runfiles import read_run
    from ringtrain.train.mixture import chat_packing_counts, open_mixture
    from ringtrain_dev.fake_run import write_run_dir

    job = _job(dataset, f"data.chat_overlong={overlong}")
    need = _laid_out(dataset)
    long = need > SEQ
    assert 0 < long.sum() < NUM_PAIRS
    counts = chat_packing_counts(job)
    samples = open_mixture(job)
    rows = samples.pair_rows().num_rows  # the workers' rows
    samples.close()
    lost = int(need[long].sum()) if overlong == "drop" else int((need[long] - SEQ).sum())
    assert counts == {"pairs": NUM_PAIRS, "packed": NUM_PAIRS - int(long.sum()) * (overlong == "drop"),
                      "dropped": int(long.sum()) * (overlong == "drop"), "truncated": int(long.sum()) * (overlong != "drop"),
                      "rows": rows, "tokens": int(need.sum()), "dropped_tokens": lost * (overlong == "drop"),
                      "truncated_tokens": lost * (overlong != "drop"), "row_tokens": rows * SEQ,
                      "packed_tokens": int(need.sum()) - lost}  # fmt: skip

    out = io.StringIO()
    _chat_data_note(job, Progress(1, out=out))
    console = out.getvalue() + capsys.readouterr().err
    share = lost / need.sum()
    done = (f"longer than data.seq_len={SEQ} dropped" if overlong == "drop"
            else f"their prompts cut from the start to fit {SEQ} tokens")  # fmt: skip
    assert f"preference data: {counts['packed']} of {NUM_PAIRS} pairs in {rows} rows" in console, console
    assert f"{int(long.sum())} {done}, {share:.1%} of the tokens" in console, console
    assert console.startswith("ringtrain: warning: preference data:") == (share > 0.05), console

    folder = write_run_dir(tmp_path / "run", summary={"status": "finished", "chat": counts},
                           config_yaml=f"name: dpo\ndata:\n  seq_len: {SEQ}\n  chat_overlong: {overlong}\n")  # fmt: skip
    page = render(read_run(folder))
    assert f"{counts['packed']} of {NUM_PAIRS} pairs in {rows} rows" in page and f"{share:.1%} of the tokens" in page
    assert ("warning: preference data:" in page) == (share > 0.05)


def test_pairs_that_fit_no_row_are_refused_before_any_cluster(dataset: Path, tmp_path: Path) -> None:
    """`ringtrain run` with a data.seq_len no pair fits: exit 2, one line naming the key and the
    dataset, torch and Ray never imported (no worker ever meets it)."""
    from tests.unit.test_eval_cli_errors import run_cli

    quickstart = Path(__file__).resolve().parents[2] / "jobs" / "quickstart.yaml"
    proc = run_cli(tmp_path, "run", str(quickstart), f"model.vocab_size={VOCAB}", f"data.path={dataset}",
                   "data.packing=doc", "data.seq_len=8", "train.objective=simpo")  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines == [f"ringtrain: config error: data.seq_len: {dataset}: no preference pair fits data.seq_len=8 (all {NUM_PAIRS} are "
                     "longer; raise data.seq_len or set data.chat_overlong: truncate_start)"], proc.stderr  # fmt: skip


def test_the_driver_packs_a_dataset_once_for_its_checks_note_and_reference_pass(
    dataset: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """check_sources, the console's counts and the reference pass's row count read the shards'
    offsets and pack once between them; another seq_len packs again."""
    from ringtrain.actors.reference_keeper import pair_rows
    from ringtrain.train import mixture
    from ringtrain.train.corpus import PreparedCorpus

    reads: list[str] = []  # one entry a read of every shard's offsets
    lengths = PreparedCorpus.document_lengths
    monkeypatch.setattr(PreparedCorpus, "document_lengths", lambda self: reads.append("read") or lengths(self))
    monkeypatch.setattr(mixture, "_PACKED", {})
    job = _job(dataset, "train.objective=simpo", "data.chat_overlong=truncate_start")
    assert mixture.check_sources(job) == []
    counts = mixture.chat_packing_counts(job)
    assert counts is not None and pair_rows(job) == counts["rows"] and len(reads) == 1
    mixture.chat_packing_counts(_job(dataset, "train.objective=simpo", f"data.seq_len={2 * SEQ}"))
    assert len(reads) == 2
