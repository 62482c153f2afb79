"""Whole conversations in training rows: the packing, the labels under every CP split, the
per-conversation weights, and the weighted loss paths against a plain reference."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from ringtrain.train.conversations import conversation_weights, pack_conversations
from ringtrain.train.data import IGNORE_INDEX, BatchPlan, ShardedData
from ringtrain.train.loss import chunked_cross_entropy_sum, full_cross_entropy_sum
from ringtrain_dev.chat_data import chat_samples, random_conversations, write_chat

VOCAB, SEQ = 64, 32


@pytest.mark.parametrize("packing", ["next_fit", "first_fit"])
def test_rows_hold_whole_conversations_once_and_are_a_function_of_the_seed(packing: str) -> None:
    lengths = np.random.default_rng(0).integers(2, 40, size=3000)  # first-fit: several windows
    rows = pack_conversations(lengths, SEQ, seed=3, overlong="drop", packing=packing)
    seen = np.concatenate([rows.row(r)[0] for r in range(rows.num_rows)])
    assert sorted(seen.tolist()) == sorted(np.flatnonzero(lengths <= SEQ).tolist())
    for r in range(rows.num_rows):
        convs, taken = rows.row(r)
        assert taken.sum() <= SEQ and (taken == lengths[convs]).all()
    assert rows.dropped == int((lengths > SEQ).sum()) > 0 and rows.truncated == 0
    again = pack_conversations(lengths, SEQ, seed=3, overlong="drop", packing=packing)
    assert (again.conversations == rows.conversations).all() and (again.starts == rows.starts).all()
    other = pack_conversations(lengths, SEQ, seed=4, overlong="drop", packing=packing)
    assert not np.array_equal(other.conversations, rows.conversations)


def test_first_fit_decreasing_fills_rows_fuller_than_next_fit() -> None:
    """Conversations of 47 to 1,018 tokens into rows of 2,048: first-fit decreasing leaves less of
    each row to padding (the same draw docs/performance.md's table reports, by bench/chat_packing.py)."""
    from ringtrain_dev.chat_data import conversation_lengths

    lengths = conversation_lengths(4000, seed=0)
    fill = {}
    for packing in ("next_fit", "first_fit"):
        counts = pack_conversations(lengths, 2048, seed=0, overlong="drop", packing=packing).counts()
        fill[packing] = counts["packed_tokens"] / counts["row_tokens"]
    assert fill["first_fit"] > 0.97 and fill["next_fit"] < 0.9, fill


def test_truncate_keeps_overlong_conversations_cut_to_the_row() -> None:
    lengths = np.array([10, 50, 7, 33])
    rows = pack_conversations(lengths, SEQ, seed=0, overlong="truncate")
    assert rows.truncated == 2 and rows.dropped == 0
    taken = dict(zip(rows.conversations.tolist(), rows.lengths.tolist()))
    assert taken == {0: 10, 1: SEQ, 2: 7, 3: SEQ} and not rows.skips.any()
    assert rows.counts() == {"conversations": 4, "packed": 4, "dropped": 0, "truncated": 2, "rows": rows.num_rows,
                             "tokens": 100, "dropped_tokens": 0, "truncated_tokens": 18 + 1,
                             "row_tokens": rows.num_rows * SEQ, "packed_tokens": 10 + SEQ + 7 + SEQ}  # fmt: skip
    start = pack_conversations(lengths, SEQ, seed=0, overlong="truncate_start")
    skips = dict(zip(start.conversations.tolist(), start.skips.tolist()))
    assert skips == {0: 0, 1: 50 - SEQ, 2: 0, 3: 33 - SEQ} and start.counts() == rows.counts()
    dropped = pack_conversations(lengths, SEQ, seed=0, overlong="drop").counts()
    assert (dropped["dropped"], dropped["dropped_tokens"], dropped["packed_tokens"]) == (2, 50 + 33, 17)


def test_truncate_start_keeps_each_long_conversations_last_tokens(chat_root: tuple[Path, list]) -> None:
    """Long-document QA, whose answer comes last: the row holds the conversation's last seq_len
    tokens and their mask, its first kept token being nothing's target."""
    root, convs = chat_root
    samples = chat_samples(root, seq_len=SEQ, seed=1, overlong="truncate_start")
    rows = samples.rows[0]  # type: ignore[attr-defined]
    cut = 0
    for r in range(rows.num_rows):
        sample = samples._row(0, rows, r)  # type: ignore[attr-defined]
        conversations, taken = rows.row(r)
        at = 0
        for c, n in zip(conversations.tolist(), taken.tolist()):
            tokens, mask = convs[c]
            np.testing.assert_array_equal(sample.tokens[at : at + n], tokens[len(tokens) - n :])
            np.testing.assert_array_equal(sample.targets[at : at + n], mask[len(tokens) - n :])
            cut += n < len(tokens)
            at += n
    assert cut == sum(len(t) > SEQ for t, _ in convs) > 0
    samples.close()  # type: ignore[attr-defined]


def _data(samples: object, ring: int, ulysses: int, ring_idx: int, ulysses_idx: int, norm: str = "token") -> ShardedData:
    return ShardedData(samples, seq_len=SEQ, seed=1, plan=BatchPlan(4, 1, 4), ring=ring, ulysses=ulysses,  # type: ignore[arg-type]
                       ring_idx=ring_idx, ulysses_idx=ulysses_idx, vocab_size=VOCAB, loss_norm=norm)


@pytest.fixture(scope="module")
def chat_root(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[tuple[np.ndarray, np.ndarray]]]:
    root = tmp_path_factory.mktemp("chat") / "data"
    convs = random_conversations(24, vocab_size=VOCAB, min_len=4, max_len=40, seed=1)
    write_chat(root, convs, vocab_size=VOCAB)
    return root, convs


def test_labels_are_the_masked_next_tokens_of_each_conversation(chat_root: tuple[Path, list]) -> None:
    root, convs = chat_root
    samples = chat_samples(root, seq_len=SEQ, seed=1)
    mb = _data(samples, 1, 1, 0, 0).step_batches(0, 0)[0]
    for b, sample in enumerate(mb.samples):
        row = samples.rows[0].row(samples.orders[0].window(sample))[0]  # type: ignore[attr-defined]
        expect = []
        for c in row:
            tokens, mask = convs[int(c)]
            # Position i predicts token i + 1 only where i + 1 is a trained target of the same conversation.
            expect.append(np.where(mask[1:] == 1, tokens[1:], IGNORE_INDEX))
            expect.append([IGNORE_INDEX])  # its last token predicts nothing
        expect_b = np.concatenate(expect)
        np.testing.assert_array_equal(mb.labels[b, : len(expect_b)], expect_b)
        assert (mb.labels[b, len(expect_b) :] == IGNORE_INDEX).all(), "padding carries no loss"
        starts = np.flatnonzero(np.diff(mb.doc_ids[b], prepend=-1))
        assert (mb.position_ids[b, starts] == 0).all()


@pytest.mark.parametrize(("ring", "ulysses"), [(2, 1), (4, 1), (1, 2), (2, 2)])
def test_every_label_lands_once_under_a_cp_split(chat_root: tuple[Path, list], ring: int, ulysses: int) -> None:
    """The shift is made on the whole row before the split: the shards' labels, put back at
    their positions, are the whole row's (zigzag included), none lost at a shard boundary."""
    root, _ = chat_root
    samples = chat_samples(root, seq_len=SEQ, seed=1)
    whole = _data(samples, 1, 1, 0, 0, "sequence").step_batches(2, 0)[0]
    labels = np.full_like(whole.labels, 7777)
    weights = np.full(whole.labels.shape, -1.0, dtype=np.float32)
    for r in range(ring):
        for u in range(ulysses):
            part = _data(samples, ring, ulysses, r, u, "sequence")
            mb = part.step_batches(2, 0)[0]
            labels[:, part.positions] = mb.labels
            weights[:, part.positions] = mb.weights
    np.testing.assert_array_equal(labels, whole.labels)
    np.testing.assert_array_equal(weights, whole.weights)


def test_conversation_weights_make_each_conversation_count_once() -> None:
    labels = np.array([5, IGNORE_INDEX, 6, 7, IGNORE_INDEX, 9, IGNORE_INDEX, IGNORE_INDEX])
    docs = np.array([0, 0, 0, 1, 1, 1, 2, 3])
    w = conversation_weights(labels, docs, IGNORE_INDEX)
    np.testing.assert_allclose(w, [0.5, 0, 0.5, 0.5, 0, 0.5, 0, 0])
    assert w.sum() == pytest.approx(2.0)  # conversations 2 and 3 train nothing and count nothing


def test_weighted_losses_equal_the_weighted_reference() -> None:
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(37, 16, generator=g, requires_grad=True)
    weight = torch.randn(VOCAB, 16, generator=g, requires_grad=True)
    labels = torch.randint(0, VOCAB, (37,), generator=g)
    labels[::5] = IGNORE_INDEX
    weights = torch.rand(37, generator=g)
    ref = (F.cross_entropy(hidden @ weight.T, labels, ignore_index=IGNORE_INDEX, reduction="none") * weights).sum()
    ref_grads = torch.autograd.grad(ref, (hidden, weight))
    for loss in (chunked_cross_entropy_sum(hidden, weight, labels, 8, weights),
                 full_cross_entropy_sum(hidden, weight, labels, weights)):
        grads = torch.autograd.grad(loss, (hidden, weight))
        assert float(loss.detach()) == pytest.approx(float(ref.detach()), rel=1e-6)
        for a, b in zip(grads, ref_grads):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    unweighted = chunked_cross_entropy_sum(hidden, weight, labels, 8)
    assert float(unweighted.detach()) == pytest.approx(float(full_cross_entropy_sum(hidden, weight, labels).detach()), rel=1e-6)


def _job(root: Path, *overrides: str) -> object:
    from ringtrain import config

    return config.load(None, [f"data.path={root}", f"data.seq_len={SEQ}", f"model.vocab_size={VOCAB}", *overrides])


def test_a_chat_dataset_under_concat_packing_is_refused_naming_the_key(chat_root: tuple[Path, list]) -> None:
    from ringtrain.errors import ConfigError
    from ringtrain.train.mixture import check_sources

    root, _ = chat_root
    with pytest.raises(ConfigError) as err:
        check_sources(_job(root, "data.packing=concat"))  # type: ignore[arg-type]
    assert err.value.key == "data.packing" and "chat dataset" in err.value.reason
    check_sources(_job(root, "data.packing=doc", "train.loss_norm=sequence"))  # type: ignore[arg-type]


def test_a_seq_len_no_conversation_fits_is_refused_naming_the_key(chat_root: tuple[Path, list]) -> None:
    from ringtrain.errors import ConfigError
    from ringtrain.train.mixture import check_sources

    root, convs = chat_root
    short = min(len(t) for t, _ in convs) // 2 * 2 - 2  # shorter than every conversation, a multiple of 2 x mesh.cp
    with pytest.raises(ConfigError) as err:
        check_sources(_job(root, "data.packing=doc", f"data.seq_len={short}"))  # type: ignore[arg-type]
    assert err.value.key == "data.seq_len" and f"{root}: no conversation fits" in err.value.reason
    check_sources(_job(root, "data.packing=doc", f"data.seq_len={short}", "data.chat_overlong=truncate"))  # type: ignore[arg-type]


def test_sequence_loss_norm_needs_a_chat_dataset(tmp_path: Path) -> None:
    from ringtrain.errors import ConfigError
    from ringtrain.train.mixture import check_sources
    from ringtrain_dev.prepared_data import random_documents, write_prepared

    write_prepared(tmp_path / "text", random_documents(8, vocab_size=VOCAB, eos_id=2, min_len=20, max_len=30),
                   vocab_size=VOCAB, eos_id=2)
    with pytest.raises(ConfigError) as err:
        check_sources(_job(tmp_path / "text", "data.packing=doc", "train.loss_norm=sequence"))  # type: ignore[arg-type]
    assert err.value.key == "train.loss_norm"


def test_the_summary_counts_what_the_packing_dropped_or_cut(chat_root: tuple[Path, list]) -> None:
    from ringtrain.train.mixture import chat_packing_counts

    root, convs = chat_root
    longer = sum(len(t) > SEQ for t, _ in convs)
    assert longer > 0
    dropped = chat_packing_counts(_job(root, "data.packing=doc"))  # type: ignore[arg-type]
    assert dropped is not None and dropped["dropped"] == longer and dropped["packed"] == len(convs) - longer
    cut = chat_packing_counts(_job(root, "data.packing=doc", "data.chat_overlong=truncate"))  # type: ignore[arg-type]
    assert cut is not None and cut["truncated"] == longer and cut["packed"] == len(convs)
    assert chat_packing_counts(_job(Path("stdlib"))) is None  # type: ignore[arg-type]


def test_a_step_reads_the_same_rows_at_any_dp_and_after_a_reopen(chat_root: tuple[Path, list]) -> None:
    """What resume and elastic resizing rely on: a step's rows depend on the seed and the data
    alone. Reopened (a resume) or split over two replicas (a resize), step 3 trains on the same
    tokens, labels and weights, bit for bit."""
    root, _ = chat_root

    def step(dp: int, replica: int, packing: str) -> list:
        data = ShardedData(chat_samples(root, seq_len=SEQ, seed=1, packing=packing), seq_len=SEQ, seed=1,  # type: ignore[arg-type]
                           plan=BatchPlan(4, dp, 1),
                           ring=1, ulysses=1, ring_idx=0, ulysses_idx=0, vocab_size=VOCAB, loss_norm="sequence")
        try:
            return data.step_batches(3, replica)
        finally:
            data.close()

    for packing in ("next_fit", "first_fit"):
        whole = step(1, 0, packing)
        split = step(2, 0, packing) + step(2, 1, packing)
        for a, b in zip(whole, split, strict=True):
            assert a.samples == b.samples
            for field in ("input_ids", "labels", "position_ids", "doc_ids", "weights"):
                np.testing.assert_array_equal(getattr(a, field), getattr(b, field))


def test_the_eval_set_of_a_chat_dataset_is_its_whole_conversations_that_fit(chat_root: tuple[Path, list]) -> None:
    from ringtrain.train.evalset import load_eval_set

    root, convs = chat_root
    fits = [(t, m) for t, m in convs if len(t) <= SEQ]
    found = load_eval_set(str(root), seq_len=SEQ, vocab_size=VOCAB)
    assert found.num_rows == len(fits) < len(convs)  # every one that fits; the longer ones left out, never cut
    assert found.coverage is not None and found.coverage.to_dict() == {
        "total": len(convs), "scored": len(fits), "too_long": len(convs) - len(fits), "not_scored": 0}
    assert found.seq_len == max(len(t) for t, _ in fits)  # padded to the longest scored, not to seq_len
    capped = load_eval_set(str(root), seq_len=SEQ, vocab_size=VOCAB, max_rows=5)
    assert capped.num_rows == 5 and capped.coverage is not None and capped.coverage.not_scored == len(fits) - 5
    assert capped.coverage.line(SEQ) == (f"5 of {len(convs)} conversations ({len(convs) - len(fits)} longer than {SEQ} tokens "
                                         f"left out, {len(fits) - 5} past the row limit not scored)")
    for row, (tokens, mask) in enumerate(fits):
        np.testing.assert_array_equal(found.inputs[row, : len(tokens)], tokens)
        np.testing.assert_array_equal(found.labels[row, : len(tokens) - 1], np.where(mask[1:] == 1, tokens[1:], IGNORE_INDEX))
        assert (found.labels[row, len(tokens) - 1 :] == IGNORE_INDEX).all()
    assert found.num_labels == sum(int(m[1:].sum()) for _, m in fits)


def test_the_console_and_the_report_say_what_seq_len_dropped_or_cut(
    chat_root: tuple[Path, list], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before the first step the console says how many conversations data.seq_len dropped (or
    cut) and their share of the tokens, a warning past 5%; report.html says it from summary.json."""
    import io

    from ringtrain.commands.run import _chat_data_note
    from ringtrain.telemetry.progress import Progress
    from ringtrain.telemetry.report import render
    from ringtrain.telemetry.runfiles import read_run
    from ringtrain.train.mixture import chat_packing_counts
    from ringtrain_dev.fake_run import write_run_dir

    root, convs = chat_root
    longer = [len(t) for t, _ in convs if len(t) > SEQ]
    total = sum(len(t) for t, _ in convs)
    share = {"drop": sum(longer) / total, "truncate": sum(n - SEQ for n in longer) / total}
    assert share["drop"] > 0.05 > share["truncate"] > 0
    for overlong in ("drop", "truncate"):
        job = _job(root, "data.packing=doc", f"data.chat_overlong={overlong}")
        out = io.StringIO()
        _chat_data_note(job, Progress(1, out=out))  # type: ignore[arg-type]
        console = out.getvalue() + capsys.readouterr().err
        counts = chat_packing_counts(job)  # type: ignore[arg-type]
        assert counts is not None
        done = "dropped" if overlong == "drop" else f"cut to their first {SEQ} tokens"
        said = f"{len(longer)} {'longer than data.seq_len=' + str(SEQ) + ' dropped' if overlong == 'drop' else done}, {share[overlong]:.1%} of the tokens"
        assert said in console, console
        assert console.startswith("ringtrain: warning: chat data:") == (overlong == "drop"), console
        folder = write_run_dir(tmp_path / overlong, summary={"status": "finished", "chat": counts},
                               config_yaml=f"name: chat\ndata:\n  seq_len: {SEQ}\n  chat_overlong: {overlong}\n")
        page = render(read_run(folder))
        assert said in page and ("warning: chat data:" in page) == (overlong == "drop")
