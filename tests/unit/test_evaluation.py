"""The pure half of evaluation: position buckets, loss tallies, passkey prompts and scores, the
result's JSON and table. No torch, no Ray."""

from __future__ import annotations

import json
import math
import random

import pytest

from ringtrain import config
from ringtrain.errors import ConfigError
from ringtrain.evaluation.buckets import bucket, bucket_index, num_buckets, short_count
from ringtrain.evaluation.passkey import (
    FILLER,
    INSTRUCTION,
    KEY_DIGITS,
    NEEDLE,
    QUESTION,
    PasskeyPrompt,
    answer_tokens,
    answered,
    build_prompt,
    build_prompts,
    draw_key,
    min_length,
    score,
)
from ringtrain.evaluation.result import EvalResult
from ringtrain.evaluation.tally import LossTally, merge_all, perplexity
from ringtrain.evaluation.text import ByteTokenizer


def test_buckets_double_after_the_first() -> None:
    assert [bucket(i, 1024) for i in range(4)] == [bucket(0, 1024), bucket(1, 1024), bucket(2, 1024), bucket(3, 1024)]
    assert [(bucket(i, 1024).start, bucket(i, 1024).end) for i in range(4)] == [(0, 1024), (1024, 2048), (2048, 4096), (4096, 8192)]
    assert [bucket(i, 1024).label for i in range(4)] == ["0-1K", "1K-2K", "2K-4K", "4K-8K"]
    for first in (1, 3, 4, 1024):
        for p in range(0, 40 * first, max(1, first // 3)):
            b = bucket(bucket_index(p, first), first)
            assert b.start <= p < b.end, (p, first, b)
    assert num_buckets(2048, 1024) == 2 and num_buckets(2049, 1024) == 3 and num_buckets(1, 1024) == 1
    assert num_buckets(131072, 1024) == 8  # 0-1K ... 64K-128K
    with pytest.raises(ValueError):
        bucket_index(-1, 4)


def test_short_counts() -> None:
    assert [short_count(n) for n in (0, 64, 1024, 1536, 131072, 1 << 20, 3000)] == ["0", "64", "1K", "1.5K", "128K", "1M", "3000"]


def test_tally_is_the_mean_over_every_prediction_and_merges() -> None:
    rng = random.Random(0)
    losses = [(rng.randrange(0, 100), rng.random() * 5) for _ in range(500)]
    whole = LossTally(8)
    parts = [LossTally(8) for _ in range(3)]
    for i, (p, loss) in enumerate(losses):
        whole.add(p, loss)
        parts[i % 3].add(p, loss)
    merged = merge_all(parts)
    assert merged.tokens == whole.tokens == 500
    assert math.isclose(merged.loss, sum(l for _, l in losses) / 500, rel_tol=1e-12)
    assert math.isclose(merged.loss, whole.loss, rel_tol=1e-12)
    by = merged.by_position()
    assert [(b["start"], b["end"]) for b in by] == [(0, 8), (8, 16), (16, 32), (32, 64), (64, 128)]
    assert sum(b["tokens"] for b in by) == 500
    assert math.isclose(sum(b["loss"] * b["tokens"] for b in by), sum(l for _, l in losses), rel_tol=1e-12)
    assert math.isclose(merged.perplexity, math.exp(merged.loss))


def test_tally_edges() -> None:
    empty = LossTally(4)
    assert empty.tokens == 0 and math.isnan(empty.loss) and math.isnan(empty.perplexity) and empty.by_position() == []
    gap = LossTally(4)
    gap.add(20, 1.0)  # bucket 3 only: the buckets before it are listed, empty
    assert [b["tokens"] for b in gap.by_position()] == [0, 0, 0, 1] and gap.by_position()[0]["loss"] is None
    assert perplexity(1000.0) == math.inf
    with pytest.raises(ValueError, match="bucket sizes differ"):
        LossTally(4).merge(LossTally(8))


def test_result_json_and_table() -> None:
    tally = LossTally(4)
    for p in range(30):
        tally.add(p, 1.0 + p / 100)
    grid = score(ByteTokenizer(), _prompts(), [list(f" {p.key}.".encode()) for p in _prompts()])
    result = EvalResult(tally, rows=1, seq_len=31, passkey=grid)
    out = json.loads(json.dumps(result.to_dict()))
    assert {"loss", "perplexity", "tokens", "by_position", "rows", "seq_len", "bucket_tokens", "passkey"} <= out.keys()
    assert out["tokens"] == 30 and out["rows"] == 1 and out["bucket_tokens"] == 4
    assert [set(b) for b in out["by_position"]] == [{"start", "end", "loss", "tokens"}] * 4
    assert out["passkey"]["overall"] == 1.0 and out["passkey"]["accuracy"] == [[1.0, 1.0], [1.0, 1.0]]
    table = result.table()
    assert "0-4" in table and "16-32" in table and "passkey accuracy" in table
    assert EvalResult(LossTally(4), rows=0, seq_len=8).to_dict()["loss"] is None  # JSON has no NaN


# --- passkey -------------------------------------------------------------------------------


def _prompts() -> list[PasskeyPrompt]:
    return build_prompts(ByteTokenizer(), [300, 400], [0.0, 1.0], trials=1, seed=3)


@pytest.mark.parametrize("depth", [0.0, 0.25, 0.5, 1.0])
def test_a_prompt_has_its_length_and_hides_the_key_at_its_depth(depth: float) -> None:
    text = ByteTokenizer()
    prompt = build_prompt(text, length=500, depth=depth, key="12345")
    assert len(prompt.ids) == 500
    decoded = text.decode(prompt.ids)
    needle = NEEDLE.format(key="12345")
    assert decoded.endswith(QUESTION) and decoded.count(needle) == 1
    filler_start = len(text.encode(INSTRUCTION))
    assert decoded.startswith(INSTRUCTION) and FILLER[:20] in decoded
    budget = 500 - len(text.encode(needle)) - len(text.encode(QUESTION)) - filler_start
    at = len(text.encode(decoded[: decoded.index(needle)]))
    assert at - filler_start == round(depth * budget)


def test_keys_are_reproducible_and_differ() -> None:
    keys = [draw_key(0, n, d, t) for n in (256, 512) for d in range(3) for t in range(2)]
    assert keys == [draw_key(0, n, d, t) for n in (256, 512) for d in range(3) for t in range(2)]
    assert all(len(k) == KEY_DIGITS and k.isdigit() for k in keys) and len(set(keys)) > 1
    assert [p.length for p in _prompts()] == [300, 300, 400, 400] and [p.depth for p in _prompts()] == [0.0, 1.0, 0.0, 1.0]


def test_too_short_a_prompt_names_the_key() -> None:
    shortest = min_length(ByteTokenizer())
    build_prompt(ByteTokenizer(), length=shortest, depth=0.5, key="12345")
    with pytest.raises(ConfigError, match=f"eval.passkey: {shortest - 1} tokens cannot hold .* at least {shortest}"):
        build_prompt(ByteTokenizer(), length=shortest - 1, depth=0.5, key="12345")


def test_answers_are_judged_by_their_first_number() -> None:
    assert answered("12345", " 12345. Remember")
    assert answered("12345", "12345")
    assert not answered("12345", " 1234")
    assert not answered("12345", " 123456")
    assert not answered("12345", " 9 then 12345")
    assert not answered("12345", "no number")


def copying_generate(prompts: list[list[int]], num_new: int) -> list[list[int]]:
    """A model that only copies: after the longest suffix seen before, it writes what followed."""
    out = []
    for prompt in prompts:
        ids = list(prompt)
        for _ in range(num_new):
            nxt = 0
            for size in range(min(len(ids) - 1, 16), 0, -1):
                tail = ids[-size:]
                found = [j for j in range(len(ids) - size) if ids[j : j + size] == tail]
                if found:
                    nxt = ids[found[-1] + size]
                    break
            ids.append(nxt)
        out.append(ids[len(prompt) :])
    return out


def test_a_copying_model_passes_every_cell_and_a_random_one_fails() -> None:
    text = ByteTokenizer()
    prompts = build_prompts(text, [300, 450], [0.0, 0.5, 1.0], trials=2, seed=1)
    num_new = answer_tokens(text, prompts)
    assert num_new == KEY_DIGITS + 2  # a space, the digits, and one more
    grid = score(text, prompts, copying_generate([list(p.ids) for p in prompts], num_new))
    assert grid.lengths == (300, 450) and grid.depths == (0.0, 0.5, 1.0) and grid.trials == 2
    assert grid.overall == 1.0 and grid.to_dict()["by_length"] == {"300": 1.0, "450": 1.0}
    rng = random.Random(0)
    noise = score(text, prompts, [[rng.randrange(256) for _ in range(num_new)] for _ in prompts])
    assert noise.overall < 0.5
    with pytest.raises(ValueError):
        score(text, prompts, [])


def test_the_byte_tokenizer_round_trips() -> None:
    text = ByteTokenizer()
    assert text.decode(text.encode("pass key ü", first=True)) == "pass key ü"
    assert text.decode([0xFF, 65]) == "\ufffdA"


# --- config --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("eval.every=-1", "eval.every"),
        ("eval.every=5", "eval.data"),
        ("eval.seq_len=0", "eval.seq_len"),
        ("eval.max_rows=0", "eval.max_rows"),
        ("eval.bucket_tokens=0", "eval.bucket_tokens"),
        ("eval.passkey=[256,0]", "eval.passkey[1]"),
        ("eval.passkey_depths=[0.5,1.5]", "eval.passkey_depths[1]"),
        ("eval.passkey_trials=0", "eval.passkey_trials"),
        ("eval.bogus=1", "eval.bogus"),
    ],
)
def test_bad_eval_config_names_the_key(override: str, key: str) -> None:
    with pytest.raises(ConfigError) as info:
        config.load(None, [override])
    assert info.value.key == key


def test_eval_config_defaults_are_off() -> None:
    job = config.load(None, ["eval.every=10", "eval.data=stdlib", "eval.passkey=[256]"])
    assert job.eval.every == 10 and job.eval.bucket_tokens == 1024 and job.eval.passkey_depths == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert config.load(None, []).eval.every == 0


def test_a_chat_evaluation_reports_the_mean_train_loss_norm_takes_and_what_it_left_out() -> None:
    """Rows are conversations, each split over two ranks: the rows' sums merge before their
    means are taken; under train.loss_norm: sequence the loss is the mean of those means."""
    from ringtrain.evaluation.result import ChatCoverage, EvalResult

    ranks = [LossTally(4), LossTally(4)]
    # Conversation 0: 3 predictions of loss 1 (two on rank 0, one on rank 1); conversation 1:
    # one prediction of loss 4 (rank 1); row 2 is padding, with none.
    ranks[0].add_bucket(0, 2.0, 2), ranks[0].add_row(0, 2.0, 2), ranks[0].add_row(2, 0.0, 0)
    ranks[1].add_bucket(0, 5.0, 2), ranks[1].add_row(0, 1.0, 1), ranks[1].add_row(1, 4.0, 1)
    tally = merge_all(ranks)
    assert tally.rows == {0: (3.0, 3), 1: (4.0, 1)}
    assert tally.loss == 7.0 / 4 and tally.sequence_loss == (1.0 + 4.0) / 2
    coverage = ChatCoverage(total=5, too_long=2, not_scored=1)
    out = EvalResult(tally, rows=2, seq_len=8, coverage=coverage, loss_norm="sequence").to_dict()
    assert (out["loss"], out["token_loss"], out["sequence_loss"], out["loss_norm"]) == (2.5, 1.75, 2.5, "sequence")
    assert out["conversations"] == {"total": 5, "scored": 2, "too_long": 2, "not_scored": 1}
    assert EvalResult(tally, rows=2, seq_len=8, coverage=coverage).to_dict()["loss"] == 1.75
    assert "2 of 5 conversations (2 longer than 8 tokens left out, 1 past the row limit not scored)" in EvalResult(
        tally, rows=2, seq_len=8, coverage=coverage, loss_norm="sequence").table()
