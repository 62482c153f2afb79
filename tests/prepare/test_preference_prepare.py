"""`ringtrain prepare --format preference`: TRL's three record layouts read and checked, each pair
rendered as its prompt and two completions that continue it, masked by the chat rules; the CLI
end to end on JSONL and Parquet, and what it refuses.

The masks' reference is transformers' own assistant mask of a template whose markers wrap the
assistant turns whose ``weight`` is not 0: the prompt's assistant turns carry weight 0 there.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ringtrain.prepare import chat_template
from ringtrain.prepare.chat_records import BadConversation, Conversation
from ringtrain.prepare.chat_render import ChatRenderer, ChatSpec
from ringtrain.prepare.preference_records import read_preference
from ringtrain.prepare.preference_render import render_pair
from ringtrain.prepared import Manifest
from tests.prepare.test_chat_policy import with_template
from tests.prepare.test_chat_prepare import prepare, read_back
from ringtrain_dev.tiny_tokenizer import TOOLS_TEMPLATE, TOOLS_WEIGHTED_REFERENCE, save_chat_tokenizer

VOCAB = 320
SYSTEM = {"role": "system", "content": "be terse"}
USER = {"role": "user", "content": "why a ring"}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("pref-tok")
    return with_template(save_chat_tokenizer(root / "chatml", "chatml"), root / "tools", TOOLS_TEMPLATE)


def records() -> list[dict[str, Any]]:
    """One pair in each layout: conversational (multi-turn prompt, tools), implicit, plain."""
    history = [SYSTEM, USER, {"role": "assistant", "content": "a cycle"}, {"role": "user", "content": "and a shard"}]
    return [
        {"prompt": history, "chosen": [{"role": "assistant", "content": "a piece of the sequence"}],
         "rejected": [{"role": "assistant", "content": "a ring"}], "tools": [{"name": "get"}]},
        {"chosen": [USER, {"role": "assistant", "content": "the ranks"}], "rejected": [USER, {"role": "assistant", "content": "no"}]},
        {"prompt": "why a ring", "chosen": "the ranks pass keys", "rejected": "because"},
    ]  # fmt: skip


def test_the_three_layouts_read_as_prompt_and_completions() -> None:
    got = [read_preference(Conversation(r), frozenset({"tools"})) for r in records()]
    assert [g.format for g in got] == ["conversational", "implicit", "plain"]
    assert got[0].prompt == records()[0]["prompt"] and got[0].context == {"tools": [{"name": "get"}]}
    assert got[1].prompt == [USER] and got[1].chosen == [{"role": "assistant", "content": "the ranks"}]
    assert got[2].prompt == [{"role": "user", "content": "why a ring"}]
    assert got[2].rejected == [{"role": "assistant", "content": "because"}]


@pytest.mark.parametrize(
    ("record", "reason"),
    [
        ({"prompt": "p", "chosen": "c"}, "no field 'rejected': a preference record holds chosen and rejected"),
        ({"prompt": [USER]}, "no field 'chosen' or 'rejected'"),
        ({"prompt": "p", "chosen": "c", "rejected": "  "}, "field 'rejected' is empty"),
        ({"prompt": [USER], "chosen": [{"role": "assistant", "content": ""}], "rejected": [{"role": "assistant", "content": "x"}]},
         "the chosen completion is empty"),
        ({"prompt": [USER, {"role": "assistant", "content": "a"}], "chosen": [{"role": "assistant", "content": "b"}],
          "rejected": [{"role": "assistant", "content": "c"}]}, "the prompt ends with the assistant's turn"),
        ({"chosen": [USER, {"role": "assistant", "content": "a"}], "rejected": [{"role": "user", "content": "other"},
                                                                                 {"role": "assistant", "content": "b"}]},
         "chosen and rejected have different prompts"),
        ({"prompt": [USER], "chosen": [{"role": "tool", "content": "x"}], "rejected": [{"role": "assistant", "content": "c"}]},
         "the chosen completion holds no assistant turn"),
        ({"prompt": "p", "chosen": [{"role": "assistant", "content": "c"}], "rejected": "r"}, "field 'chosen' is list"),
    ],
)  # fmt: skip
def test_a_bad_pair_says_what_is_wrong(record: dict[str, Any], reason: str) -> None:
    with pytest.raises(BadConversation) as caught:
        read_preference(Conversation(record))
    assert str(caught.value).startswith(reason), str(caught.value)


def test_each_completion_continues_the_prompt_and_trains_its_own_assistant_turns(tokenizer: Path) -> None:
    r = ChatRenderer(ChatSpec(chat_template.find(str(tokenizer)), "assistant", "messages", VOCAB))
    for record in records():
        pair = read_preference(Conversation(record), r.context_fields)
        prompt, chosen, rejected = render_pair(r, pair)
        assert not prompt.mask.any()
        for completion, rendered in ((pair.chosen, chosen), (pair.rejected, rejected)):
            # The prompt's assistant turns are context: the reference marks none of them.
            conv = [{**m, "weight": 0} if m["role"] == "assistant" else m for m in pair.prompt] + completion
            want = r._tok.apply_chat_template(conv, tools=pair.context.get("tools"), chat_template=TOOLS_WEIGHTED_REFERENCE,
                                              return_dict=True, return_assistant_tokens_mask=True)  # fmt: skip
            ids = np.concatenate([prompt.ids, rendered.ids])
            assert ids.tolist() == list(want["input_ids"])
            assert rendered.mask.tolist() == list(want["assistant_masks"])[len(prompt) :] and rendered.mask.any()


def test_prepare_writes_each_pair_as_three_documents(
    serial: None, tokenizer: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    src = tmp_path / "src"
    src.mkdir()
    pairs = records()
    (src / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in pairs))
    plain = [{"prompt": f"why {w}", "chosen": f"the {w}", "rejected": "no"} for w in ("ring", "rank", "shard")]
    pq.write_table(pa.Table.from_pylist(plain), src / "b.parquet")
    out = tmp_path / "out"
    code, stdout, err = prepare([str(src), "--format", "preference", "--tokenizer", str(tokenizer), "--out", str(out),
                                 "--parallelism", "1"], capsys)  # fmt: skip
    assert code == 0, err
    manifest = Manifest.load(out)
    assert manifest.content == "preference" and manifest.preference is not None and manifest.preference.num_pairs == 6
    assert manifest.chat is not None and manifest.chat.template_file == "chat_template.jinja"
    r = ChatRenderer(ChatSpec(chat_template.find(str(tokenizer)), "assistant", "messages", VOCAB))
    want = [render_pair(r, read_preference(Conversation(rec), r.context_fields)) for rec in pairs + plain]
    assert read_back(out) == [(d.ids.tolist(), d.mask.tolist()) for pair in want for d in pair]
    assert "prepared 6 preference pairs" in stdout
    # What trains is the completions' assistant turns; --train-on is refused for pairs, so never named.
    assert f"{manifest.chat.num_trained_tokens:,} trained (the completions' assistant turns)" in stdout
    assert "--train-on" not in stdout


def test_bad_preference_input_exits_2_naming_the_line_or_flag(
    serial: None, tokenizer: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = tmp_path / "p.jsonl"
    src.write_text(json.dumps(records()[2]) + "\n" + json.dumps({"prompt": "p", "chosen": "c"}) + "\n")
    code, _, err = prepare([str(src), "--format", "preference", "--tokenizer", str(tokenizer), "--out", str(tmp_path / "o"),
                            "--parallelism", "1"], capsys)  # fmt: skip
    assert code == 2 and err == f"ringtrain: data error: {src}:2: no field 'rejected': a preference record holds chosen and rejected\n"
    code, _, err = prepare([str(src), "--format", "preference", "--tokenizer", str(tokenizer), "--out", str(tmp_path / "o"),
                            "--train-on", "last"], capsys)  # fmt: skip
    assert code == 2 and err.startswith("ringtrain: config error: --train-on: applies to --format chat only")
    # The refusals --format chat shares name the format the user gave.
    text, renamed = tmp_path / "t.txt", tmp_path / "renamed" / "renamed.json"
    text.write_text("hello")
    renamed.parent.mkdir()
    renamed.write_bytes((tokenizer / "tokenizer.json").read_bytes())
    (renamed.parent / "tokenizer_config.json").write_bytes((tokenizer / "tokenizer_config.json").read_bytes())
    for args, said in [
        ([str(src), "--tokenizer", "bytes"], "--tokenizer: bytes has no chat template: --format preference needs a tokenizer folder"),
        ([str(src), "--tokenizer", str(renamed)], f"--tokenizer: {renamed}: --format preference reads the tokenizer from its folder"),
        ([str(text), "--tokenizer", str(tokenizer)],
         f"SRC: {text}: a .txt or .md file holds one text, not preference pairs (--format preference reads JSONL or Parquet)"),
    ]:  # fmt: skip
        code, _, err = prepare([*args, "--format", "preference", "--out", str(tmp_path / "o")], capsys)
        assert code == 2 and err.startswith(f"ringtrain: config error: {said}"), err
    assert not (tmp_path / "o").exists()


def test_a_bad_pair_is_found_before_any_cluster_starts(
    tokenizer: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A corpus prepare would tokenize on Ray (--parallelism): its malformed pair at line 3 is
    named on the driver by the actors' own check, no cluster started."""
    from ringtrain.prepare import pipeline

    def no_cluster(address: Any, num_cpus: Any) -> Any:
        raise AssertionError("a cluster was started")

    monkeypatch.setattr(pipeline, "connect", no_cluster)
    good = records()[2]
    src = tmp_path / "p.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in [good, good, {"prompt": "p", "chosen": "c", "rejected": " "}, good]))
    code, _, err = prepare([str(src), "--format", "preference", "--tokenizer", str(tokenizer), "--out", str(tmp_path / "out"),
                            "--parallelism", "2"], capsys)  # fmt: skip
    assert (code, err) == (2, f"ringtrain: data error: {src}:3: field 'rejected' is empty\n")
    assert not (tmp_path / "out").exists()
