"""What a preference objective refuses before any worker starts (exit 2 naming the key): its
settings out of range, a rule for overlong pairs that would cut a completion, and data of the
wrong kind for it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ringtrain import cli, config
from ringtrain.errors import ConfigError
from ringtrain.train.mixture import check_sources
from ringtrain_dev.chat_data import random_conversations, write_chat
from ringtrain_dev.tiny_tokenizer import save_chat_tokenizer


@pytest.mark.parametrize(
    ("overrides", "key", "reason"),
    [
        (["train.objective=ppo"], "train.objective", "'ppo' is not one of lm, dpo, ipo, simpo, orpo"),
        (["train.objective=dpo", "train.preference.beta=0"], "train.preference.beta", "must be a finite number > 0"),
        (["train.objective=dpo", "train.preference.beta=inf"], "train.preference.beta", "must be a finite number"),
        (["train.preference.label_smoothing=0.5"], "train.preference.label_smoothing", "must be in [0, 0.5)"),
        (["train.preference.sft_weight=-1"], "train.preference.sft_weight", "must be a finite number >= 0"),
        (["train.objective=simpo", "data.chat_overlong=truncate"], "data.chat_overlong", "truncate would cut a pair's completions"),
        (["train.objective=dpo", "train.preference.reference=''"], "train.preference.reference", "is empty: give initial"),
        (["train.objective=orpo", "train.preference.reference=/m"], "train.preference.reference", "orpo scores against no reference model"),
    ],
)  # fmt: skip
def test_settings_out_of_range_name_their_key(overrides: list[str], key: str, reason: str) -> None:
    with pytest.raises(ConfigError) as refused:
        config.load(None, overrides)
    assert refused.value.key == key and reason in refused.value.reason


@pytest.mark.parametrize("shared", ["true", "false"])
def test_a_pair_takes_either_layout_under_sliding_window_layers(shared: str) -> None:
    """A shared prompt under windowed layers: a completion's window reaches into its prompt by
    position id (tests/dist/test_preference_loss.py's windowed layouts)."""
    job = config.load(None, ["train.objective=orpo", "model.sliding_window=8", f"data.prefix_sharing={shared}"])
    assert job.data.prefix_sharing is (shared == "true")


@pytest.fixture(scope="module")
def datasets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("kinds")
    tokenizer = save_chat_tokenizer(root / "tok", "chatml")
    pairs = [{"prompt": "why a ring", "chosen": f"the rank {i}", "rejected": "no"} for i in range(12)]
    (root / "pairs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs))
    assert cli.main(["prepare", str(root / "pairs.jsonl"), "--format", "preference", "--tokenizer", str(tokenizer),
                     "--out", str(root / "preference"), "--quiet"]) == 0  # fmt: skip
    write_chat(root / "chat", random_conversations(12, vocab_size=320, min_len=20, max_len=40), vocab_size=320)
    return {"preference": root / "preference", "chat": root / "chat"}


def _job(*overrides: str) -> config.JobConfig:
    return config.load(None, ["model.vocab_size=320", "data.seq_len=64", "data.packing=doc", *overrides])


def test_an_objective_and_its_data_must_agree(datasets: dict[str, Path]) -> None:
    with pytest.raises(ConfigError, match="lm, but .* is a preference dataset: set train.objective to one of dpo"):
        check_sources(_job(f"data.path={datasets['preference']}"))
    with pytest.raises(ConfigError, match="dpo trains on preference pairs, and .* holds chat"):
        check_sources(_job(f"data.path={datasets['chat']}", "train.objective=dpo"))
    with pytest.raises(ConfigError, match="simpo trains on preference pairs, and stdlib holds text"):
        check_sources(_job("data.packing=concat", "train.objective=simpo"))
    with pytest.raises(ConfigError, match="a preference objective trains on one preference dataset"):
        check_sources(_job("data.path=stdlib", "train.objective=dpo",
                           f"data.sources=[{{path: {datasets['preference']}}}, {{path: {datasets['preference']}}}]"))
    assert check_sources(_job(f"data.path={datasets['preference']}", "train.objective=dpo")) is not None
