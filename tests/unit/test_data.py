"""Training data: what is read depends on seed and sample index only; who reads it on the mesh."""

from __future__ import annotations

import itertools
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from ringtrain.errors import ConfigError, DataError
from ringtrain.train.data import BatchPlan, SampleOrder, ShardedData, check_data_path, load_tokens


def _epoch(order: SampleOrder, epoch: int) -> list[int]:
    n = order.num_windows
    return [order.window(epoch * n + i) for i in range(n)]


# --- SampleOrder ---------------------------------------------------------------------------


def test_num_windows_leaves_room_for_the_shifted_label() -> None:
    assert SampleOrder(num_tokens=101, seq_len=10, seed=0).num_windows == 10
    assert SampleOrder(num_tokens=100, seq_len=10, seed=0).num_windows == 9
    assert SampleOrder(num_tokens=11, seq_len=10, seed=0).num_windows == 1


@pytest.mark.parametrize("epoch", [0, 1, 5])
def test_each_epoch_is_a_permutation_of_the_windows(epoch: int) -> None:
    order = SampleOrder(num_tokens=10 * 37 + 1, seq_len=10, seed=3)
    assert sorted(_epoch(order, epoch)) == list(range(37))


def test_epochs_are_shuffled_differently() -> None:
    order = SampleOrder(num_tokens=10 * 50 + 1, seq_len=10, seed=0)
    assert _epoch(order, 0) != _epoch(order, 1)
    assert _epoch(order, 0) != list(range(50))  # actually shuffled


def test_seeds_give_different_orders() -> None:
    a = SampleOrder(num_tokens=10 * 50 + 1, seq_len=10, seed=0)
    b = SampleOrder(num_tokens=10 * 50 + 1, seq_len=10, seed=1)
    assert _epoch(a, 0) != _epoch(b, 0)


def test_order_is_deterministic_and_independent_of_access_order() -> None:
    num_tokens, seq_len, seed = 10 * 20 + 1, 10, 7
    sequential = SampleOrder(num_tokens, seq_len, seed)
    expected = [sequential.window(s) for s in range(100)]

    jumping = SampleOrder(num_tokens, seq_len, seed)
    samples = [93, 2, 41, 2, 60, 19, 0, 99, 20, 21]  # hops back and forth across epochs
    assert [jumping.window(s) for s in samples] == [expected[s] for s in samples]
    assert [SampleOrder(num_tokens, seq_len, seed).window(s) for s in range(100)] == expected


def test_epoch_of() -> None:
    order = SampleOrder(num_tokens=10 * 20 + 1, seq_len=10, seed=0)
    assert [order.epoch_of(s) for s in (0, 19, 20, 39, 40)] == [0, 0, 1, 1, 2]


@pytest.mark.parametrize("num_tokens", [0, 1, 16], ids=["empty", "one-token", "exactly-seq-len"])
def test_a_corpus_shorter_than_seq_len_plus_one_is_a_data_error(num_tokens: int) -> None:
    with pytest.raises(DataError, match="data.seq_len"):
        SampleOrder(num_tokens=num_tokens, seq_len=16, seed=0)


def _one_rank(tokens: np.ndarray, seq_len: int) -> ShardedData:
    """The data of a world of one rank, one sequence a step, a vocabulary of 256."""
    plan = BatchPlan(global_batch=1, dp=1, micro_batch=1)
    return ShardedData(tokens, seq_len=seq_len, seed=0, plan=plan, ring=1, ulysses=1, ring_idx=0, ulysses_idx=0, vocab_size=256)


def test_sharded_data_refuses_a_short_corpus() -> None:
    with pytest.raises(DataError):
        _one_rank(np.arange(16), seq_len=16)


# --- BatchPlan -----------------------------------------------------------------------------


@pytest.mark.parametrize("dp", [1, 2, 4])
@pytest.mark.parametrize("micro_batch", [1, 2])
@pytest.mark.parametrize("step", [0, 1, 7])
def test_a_step_reads_the_same_samples_whatever_the_dp(dp: int, micro_batch: int, step: int) -> None:
    global_batch = 8
    plan = BatchPlan(global_batch=global_batch, dp=dp, micro_batch=micro_batch)
    read = []
    for replica in range(dp):
        micro_batches = plan.micro_batches(step, replica)
        assert len(micro_batches) == global_batch // (dp * micro_batch)  # the grad accumulation steps
        assert all(len(mb) == micro_batch for mb in micro_batches)
        assert [s for mb in micro_batches for s in mb] == plan.replica_samples(step, replica)
        read.extend(s for mb in micro_batches for s in mb)
    assert len(read) == len(set(read))  # no sample read by two replicas
    assert sorted(read) == list(range(step * global_batch, (step + 1) * global_batch))


def test_replicas_take_contiguous_slices() -> None:
    plan = BatchPlan(global_batch=8, dp=2, micro_batch=2)
    assert plan.per_replica == 4
    assert plan.replica_samples(3, 0) == [24, 25, 26, 27]
    assert plan.micro_batches(3, 1) == [[28, 29], [30, 31]]


def _windows_read(order: SampleOrder, plans: list[BatchPlan]) -> Counter[int]:
    """Window -> times read, over consecutive steps, step i planned by plans[i]."""
    used: Counter[int] = Counter()
    for step, plan in enumerate(plans):
        for replica in range(plan.dp):
            for mb in plan.micro_batches(step, replica):
                used.update(order.window(s) for s in mb)
    return used


@pytest.mark.parametrize(
    "dps",
    [[1, 1, 1], [2, 2, 2], [4, 4, 4], [2, 1, 4], [4, 2, 1]],
    ids=["dp1", "dp2", "dp4", "resize-2-1-4", "resize-4-2-1"],
)
def test_ledger_every_window_used_exactly_once_per_epoch(dps: list[int]) -> None:
    seq_len, global_batch = 8, 8
    order = SampleOrder(num_tokens=24 * seq_len + 1, seq_len=seq_len, seed=11)
    assert order.num_windows == len(dps) * global_batch  # the steps span exactly one epoch
    plans = [BatchPlan(global_batch=global_batch, dp=dp, micro_batch=2) for dp in dps]

    used = _windows_read(order, plans)

    assert sorted(used) == list(range(order.num_windows))
    assert set(used.values()) == {1}


def test_ledger_second_epoch_reuses_every_window_once_more() -> None:
    order = SampleOrder(num_tokens=16 * 4 + 1, seq_len=4, seed=0)
    plans = [BatchPlan(global_batch=4, dp=dp, micro_batch=1) for dp in [1, 2, 4, 2] * 2]  # 8 steps, 2 epochs
    used = _windows_read(order, plans)
    assert used == Counter({w: 2 for w in range(16)})


# --- ShardedData ---------------------------------------------------------------------------

BASE_TOKEN = 1000  # corpus token i is BASE_TOKEN + i, so tokens and positions cannot be confused


def _corpus(num_windows: int, seq_len: int) -> np.ndarray:
    return np.arange(BASE_TOKEN, BASE_TOKEN + num_windows * seq_len + 1, dtype=np.int64)


def _cp_ranks(tokens: np.ndarray, seq_len: int, ring: int, ulysses: int, plan: BatchPlan) -> list[ShardedData]:
    return [
        ShardedData(
            tokens, seq_len=seq_len, seed=5, plan=plan, ring=ring, ulysses=ulysses, ring_idx=r, ulysses_idx=u,
            vocab_size=2**31,
        )
        for r, u in itertools.product(range(ring), range(ulysses))
    ]


@pytest.mark.parametrize(("ring", "ulysses"), [(1, 1), (2, 1), (1, 2), (2, 2), (4, 1), (3, 2)])
def test_cp_shards_reassemble_into_the_window_with_shifted_labels(ring: int, ulysses: int) -> None:
    seq_len = 2 * ring * ulysses * 2
    tokens = _corpus(num_windows=12, seq_len=seq_len)
    plan = BatchPlan(global_batch=4, dp=2, micro_batch=2)
    ranks = _cp_ranks(tokens, seq_len, ring, ulysses, plan)
    samples = plan.micro_batches(step=1, replica=1)[0]

    inputs = np.full((len(samples), seq_len), -1, dtype=np.int64)
    labels = np.full((len(samples), seq_len), -1, dtype=np.int64)
    for data in ranks:
        mb = data.micro_batch(samples)
        assert mb.samples == tuple(samples)
        shape = (len(samples), seq_len // (ring * ulysses))
        assert mb.input_ids.shape == mb.labels.shape == mb.position_ids.shape == shape
        for row in range(len(samples)):
            inputs[row, mb.position_ids[row]] = mb.input_ids[row]
            labels[row, mb.position_ids[row]] = mb.labels[row]

    order = ranks[0].order
    for row, sample in enumerate(samples):
        start = BASE_TOKEN + order.window(sample) * seq_len
        window = np.arange(start, start + seq_len + 1)
        assert inputs[row].tolist() == window[:-1].tolist()
        assert labels[row].tolist() == window[1:].tolist()  # label at p is token p + 1


def test_sample_tokens_is_the_window_plus_one() -> None:
    tokens = _corpus(num_windows=6, seq_len=8)
    data = _cp_ranks(tokens, 8, 1, 1, BatchPlan(global_batch=2, dp=1, micro_batch=1))[0]
    for sample in range(12):
        window = data.order.window(sample)
        assert data.sample_tokens(sample).tolist() == list(
            range(BASE_TOKEN + window * 8, BASE_TOKEN + window * 8 + 9)
        )


def test_step_batches_follow_the_plan() -> None:
    tokens = _corpus(num_windows=16, seq_len=8)
    plan = BatchPlan(global_batch=8, dp=2, micro_batch=2)
    data = _cp_ranks(tokens, 8, 2, 1, plan)[1]
    batches = data.step_batches(step=1, replica=1)
    assert [list(mb.samples) for mb in batches] == plan.micro_batches(1, 1) == [[12, 13], [14, 15]]
    assert all(mb.input_ids.dtype == np.int64 for mb in batches)


def test_sharded_data_reads_uint16_tokens_as_int64() -> None:
    tokens = np.arange(65535 - 40, 65535, dtype=np.uint16)  # values that would overflow int16
    data = _cp_ranks(tokens, 4, 1, 1, BatchPlan(global_batch=1, dp=1, micro_batch=1))[0]
    mb = data.micro_batch([0])
    assert mb.input_ids.dtype == np.int64
    assert mb.input_ids.min() >= 65535 - 40


# --- token sources -------------------------------------------------------------------------


def test_load_tokens_reads_a_directory_of_text_in_sorted_order(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    (corpus / "sub").mkdir(parents=True)
    (corpus / "b.txt").write_bytes(b"world")
    (corpus / "a.txt").write_bytes(b"hello")
    (corpus / "sub" / "c.txt").write_bytes(b"!")
    tokens = load_tokens(str(corpus))
    assert tokens.dtype == np.uint8
    assert tokens.tobytes() == b"hello\nworld\n!"  # files joined by a newline


def test_load_tokens_reads_one_text_file(tmp_path: Path) -> None:
    path = tmp_path / "one.txt"
    path.write_bytes(b"abc\x00\xff")
    tokens = load_tokens(str(path))
    assert tokens.dtype == np.uint8
    assert tokens.tolist() == [97, 98, 99, 0, 255]


@pytest.mark.parametrize("dtype", ["uint8", "uint16", "uint32"])
def test_load_tokens_memory_maps_a_bin_file(tmp_path: Path, dtype: str) -> None:
    path = tmp_path / "tokens.bin"
    expected = (np.arange(300) * 7 % np.iinfo(dtype).max).astype(dtype)
    expected.tofile(path)
    tokens = load_tokens(str(path), dtype)
    assert tokens.dtype == np.dtype(dtype)
    assert np.array_equal(tokens, expected)


def test_a_bin_file_of_the_wrong_size_is_a_data_error(tmp_path: Path) -> None:
    path = tmp_path / "odd.bin"
    path.write_bytes(b"\x01\x02\x03")
    with pytest.raises(DataError, match="not a multiple"):
        load_tokens(str(path), "uint16")


def test_the_default_stdlib_corpus_is_bytes_of_source() -> None:
    tokens = load_tokens("stdlib")
    assert tokens.dtype == np.uint8
    assert len(tokens) > 1_000_000
    assert b"def " in tokens[:200_000].tobytes()


def test_check_data_path_accepts_stdlib_and_real_paths(tmp_path: Path) -> None:
    (tmp_path / "x.txt").write_text("x")
    check_data_path("stdlib")
    check_data_path(str(tmp_path))
    check_data_path(str(tmp_path / "x.txt"))


def _missing(tmp_path: Path) -> Path:
    return tmp_path / "does-not-exist"


def _empty_dir(tmp_path: Path) -> Path:
    (tmp_path / "empty").mkdir()
    return tmp_path / "empty"


def _dir_of_empty_dirs(tmp_path: Path) -> Path:
    (tmp_path / "nested" / "deeper").mkdir(parents=True)
    return tmp_path / "nested"


@pytest.mark.parametrize("make_path", [_missing, _empty_dir, _dir_of_empty_dirs], ids=["missing", "empty", "no-files"])
def test_unusable_data_path_is_a_config_error_naming_data_path(tmp_path: Path, make_path) -> None:
    path = str(make_path(tmp_path))
    for check in (check_data_path, load_tokens):
        with pytest.raises(ConfigError) as err:
            check(path)
        assert err.value.key == "data.path"
        assert path in err.value.reason


def test_tokens_beyond_the_vocab_are_refused_with_the_key_named() -> None:
    seq_len = 8
    data = _one_rank(np.arange(300, dtype=np.int64), seq_len=seq_len)
    high = next(s for s in range(data.order.num_windows) if data.sample_tokens(s).max() >= 256)
    with pytest.raises(DataError, match="model.vocab_size=256"):
        data.micro_batch([high])


def test_byte_corpus_needs_a_byte_vocab() -> None:
    from ringtrain.train.data import check_data

    with pytest.raises(ConfigError) as info:
        check_data("stdlib", vocab_size=128)
    assert info.value.key == "model.vocab_size"
    check_data("stdlib", vocab_size=256)
