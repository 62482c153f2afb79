"""`ringtrain prepare --format chat` end to end: JSONL (plain, .gz, .zst) and Parquet conversations to a
chat dataset (tokens, documents, loss masks, the manifest's chat section); bad input exits 2 with one
line and writes nothing; on Ray at parallelism 2, cut into many pieces, the same bytes.

Most cases run the actors' code in this process (the ``serial`` fixture, as test_bad_input.py does);
one runs the real pipeline on a local Ray cluster.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ringtrain.prepared import Manifest
from ringtrain_dev.tiny_tokenizer import save_chat_tokenizer
from tests.prepare.prepare_cli import files_of, prepare
from tests.prepare.serial import run_serially
from tests.prepare.test_chat_render import conversations, reference_mask
from tests.prepare.test_prepare_ray import cluster  # noqa: F401  (the module's Ray cluster)


@pytest.fixture(scope="module")
def chat_tokenizers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("chat-tok")
    return {style: save_chat_tokenizer(root / style, style) for style in ("chatml", "llama3")}


def sharegpt(conv: list[dict[str, str]]) -> list[dict[str, str]]:
    speakers = {"system": "system", "user": "human", "assistant": "gpt"}
    return [{"from": speakers[m["role"]], "value": m["content"]} for m in conv]


def write_chat_corpus(folder: Path, num: int = 240) -> list[list[dict[str, str]]]:
    """Four files of ``num`` conversations in order: plain JSONL, .jsonl.gz (ShareGPT messages),
    .jsonl.zst and Parquet (a list<struct> column in row groups of 16). Returns them in order."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    convs = conversations(num, seed=7)
    quarter = num // 4
    parts = [convs[i * quarter : (i + 1) * quarter] for i in range(4)]
    folder.mkdir(parents=True, exist_ok=True)
    lines = lambda rows: "".join(json.dumps({"messages": r}) + "\n" for r in rows).encode()  # noqa: E731
    (folder / "a.jsonl").write_bytes(lines(parts[0]))
    with gzip.GzipFile(folder / "b.jsonl.gz", "wb", mtime=0) as gz:
        gz.write(lines([sharegpt(c) for c in parts[1]]))
    (folder / "c.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(lines(parts[2])))
    pq.write_table(pa.Table.from_pylist([{"messages": c} for c in parts[3]]), folder / "d.parquet", row_group_size=16)
    return convs


def read_back(root: Path) -> list[tuple[list[int], list[int]]]:
    """Every conversation's (tokens, mask) in dataset order, shard by shard."""
    manifest = Manifest.load(root)
    out = []
    for shard in manifest.shards:
        assert shard.mask is not None
        tokens, offsets, mask = np.load(root / shard.tokens), np.load(root / shard.docs), np.load(root / shard.mask)
        assert mask.dtype == np.uint8 and mask.shape == tokens.shape and set(np.unique(mask)) <= {0, 1}
        out += [(tokens[a:b].tolist(), mask[a:b].tolist()) for a, b in zip(offsets[:-1], offsets[1:])]
    return out


@pytest.mark.parametrize("style", ["chatml", "llama3"])
def test_every_conversation_is_stored_with_its_mask(
    serial: None, chat_tokenizers: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str], style: str
) -> None:
    convs = write_chat_corpus(tmp_path / "src")
    out = tmp_path / "out"
    code, stdout, err = prepare([str(tmp_path / "src"), "--format", "chat", "--tokenizer", str(chat_tokenizers[style]),
                                 "--out", str(out), "--shard-tokens", "3000", "--parallelism", "1"], capsys)  # fmt: skip
    assert code == 0, err
    manifest = Manifest.load(out)
    stored = read_back(out)
    want = [reference_mask(chat_tokenizers[style], style, c, "assistant") for c in convs]
    assert [t for t, _ in stored] == [ids for ids, _ in want]  # no EOS appended: the template ends each turn
    assert [m for _, m in stored] == [m.tolist() for _, m in want]
    chat = manifest.chat
    assert manifest.content == "chat" and chat is not None and len(manifest.shards) > 2
    template = chat_tokenizers[style] / ("tokenizer_config.json" if style == "chatml" else "chat_template.jinja")
    import hashlib

    text = json.loads(template.read_text())["chat_template"] if style == "chatml" else template.read_text()
    assert (chat.template_file, chat.template_sha256) == (template.name, hashlib.sha256(text.encode()).hexdigest())
    assert (chat.train_on, chat.mask_source, chat.messages_field) == ("assistant", "generation" if style == "chatml" else "prefix", "messages")
    assert chat.num_trained_tokens == sum(sum(m) for _, m in stored)
    assert (manifest.num_documents, manifest.num_skipped) == (len(convs), 0)
    assert f"prepared {len(convs)} conversations" in stdout and f"{chat.num_trained_tokens:,} trained" in stdout


def test_train_on_last_and_sharegpt_field(
    serial: None, chat_tokenizers: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    convs = conversations(12, seed=3)
    src = tmp_path / "src" / "s.jsonl"
    src.parent.mkdir()
    src.write_text("".join(json.dumps({"conversations": sharegpt(c)}) + "\n" for c in convs))
    out = tmp_path / "out"
    code, _, err = prepare([str(src), "--format", "chat", "--tokenizer", str(chat_tokenizers["llama3"]), "--out", str(out),
                            "--messages-field", "conversations", "--train-on", "last", "--parallelism", "1"], capsys)  # fmt: skip
    assert code == 0, err
    assert [m for _, m in read_back(out)] == [reference_mask(chat_tokenizers["llama3"], "llama3", c, "last")[1].tolist() for c in convs]
    chat = Manifest.load(out).chat
    assert chat is not None and (chat.train_on, chat.messages_field) == ("last", "conversations")


def test_parquet_tools_and_alpaca_with_the_shipped_template_and_the_policy_flags(
    serial: None, chat_tokenizers: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A Parquet file of messages with a tools column, and one of Alpaca records, rendered with the
    Qwen3 template that ships; the policy flags are what the manifest records, and the masks are
    the renderer's own for the same records (its references: test_chat_policy.py)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from ringtrain.prepare import chat_template
    from ringtrain.prepare.chat_records import Conversation, read_chat
    from ringtrain.prepare.chat_render import ChatRenderer, ChatSpec
    from tests.prepare.test_chat_policy import qwen3_conversations

    src = tmp_path / "src"
    src.mkdir()
    def arguments_as_text(message: dict[str, Any]) -> dict[str, Any]:  # one Arrow type for every call's arguments
        calls = [{**c, "function": {**c["function"], "arguments": json.dumps(c["function"]["arguments"])}}
                 if not isinstance(c["function"]["arguments"], str) else c for c in message.get("tool_calls", [])]  # fmt: skip
        return {**message, "tool_calls": calls} if calls else message

    convs = [[arguments_as_text(m) for m in c] for c, _ in qwen3_conversations()]
    tools = [json.dumps(t) if t else None for _, t in qwen3_conversations()]
    pq.write_table(pa.Table.from_pylist([{"messages": c, "tools": t} for c, t in zip(convs, tools)]), src / "a.parquet")
    alpaca = [{"instruction": "why", "input": "a ring", "output": "the rank"}, {"instruction": "how", "output": "a token"}]
    pq.write_table(pa.Table.from_pylist(alpaca), src / "b.parquet")
    out = tmp_path / "out"
    flags = ["--chat-template", "qwen3", "--roles-to-train", "assistant", "--train-on-eos", "none"]
    code, _, err = prepare([str(src), "--format", "chat", "--tokenizer", str(chat_tokenizers["chatml"]), "--out", str(out),
                            *flags, "--parallelism", "1"], capsys)  # fmt: skip
    assert code == 0, err
    chat = Manifest.load(out).chat
    assert chat is not None and (chat.template_file, chat.roles_to_train, chat.train_on_eos) == ("qwen3", ("assistant",), "none")
    template = chat_template.override(chat_template.find(str(chat_tokenizers["chatml"])), "qwen3")
    r = ChatRenderer(ChatSpec(template, "assistant", "messages", 320, ("assistant",), "none"))
    records = [{"messages": c, **({"tools": t} if t else {})} for c, t in zip(convs, tools)] + alpaca
    want = [r.render(read_chat(Conversation(rec), "messages", r.context_fields)) for rec in records]
    assert read_back(out) == [(ids.tolist(), mask.tolist()) for ids, mask in want]
    assert "# Tools" in r._tok.decode(want[2][0]) and all(mask.sum() for _, mask in want)


# Past reasoning dropped from earlier assistant turns, as Qwen3's template does: prefix-consistent on
# a conversation without reasoning (the probe), not on one with it.
REASONING_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'assistant' and not loop.last %}"
    "{{ '<|im_start|>assistant\\n' + m['content'].split('</think>')[-1] + '<|im_end|>\\n' }}"
    "{% else %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def _bad_inputs(tmp: Path, tok: Path) -> dict[str, tuple[list[str], str]]:
    """name -> (arguments, the start of the one line expected on stderr)."""
    good = {"messages": [{"role": "user", "content": "why"}, {"role": "assistant", "content": "the ring"}]}

    def jsonl(name: str, rows: list[Any]) -> Path:
        path = tmp / name / "c.jsonl"
        path.parent.mkdir()
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        return path

    field = jsonl("field", [good, {"text": "no messages"}])
    role = jsonl("role", [good, good, {"messages": [{"role": "user", "content": "u"}, {"role": "narrator", "content": "n"}]}])
    silent = jsonl("silent", [good, {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]}])
    reasoning = jsonl("reasoning", [good, {"messages": [{"role": "user", "content": "why"}, {"role": "assistant", "content": "<think>hm</think>ring"},
                                                        {"role": "user", "content": "how"}, {"role": "assistant", "content": "token"}]}])  # fmt: skip
    plain = tmp / "plain"
    plain.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (plain / name).write_bytes((tok / name).read_bytes())
    config = json.loads((plain / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (plain / "tokenizer_config.json").write_text(json.dumps(config))
    thinking = tmp / "thinking"
    thinking.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (thinking / name).write_bytes((plain / name).read_bytes())
    (thinking / "chat_template.jinja").write_text(REASONING_TEMPLATE)
    text = tmp / "t.txt"
    text.write_text("hello")
    return {
        "field": ([str(field)], f"ringtrain: data error: {field}:2: no field 'messages' (--messages-field)"),
        "role": ([str(role)], f"ringtrain: data error: {role}:3: field 'messages' message 2: unknown role 'narrator' (expected system, user, assistant, tool)"),
        "no-assistant": ([str(silent)], f"ringtrain: data error: {silent}:2: no assistant turn to train on (--train-on assistant)"),
        "no-template": ([str(field), "--tokenizer", str(plain)],
                        f"ringtrain: config error: --tokenizer: {plain} has no chat template (a chat_template.jinja, or chat_template in tokenizer_config.json)"),
        "bytes": ([str(field), "--tokenizer", "bytes"], "ringtrain: config error: --tokenizer: bytes has no chat template"),
        "template": ([str(reasoning), "--tokenizer", str(thinking), "--on-bad-record", "skip"],
                     f"ringtrain: data error: {reasoning}:2: {thinking / 'chat_template.jinja'}: the chat template renders message 2's prompt"),
        "text-file": ([str(text)], f"ringtrain: config error: SRC: {text}: a .txt or .md file holds one text, not conversations"),
        "text-format": ([str(field), "--format", "text", "--train-on", "last"], "ringtrain: config error: --train-on: applies to --format chat and preference only"),
        "roles": ([str(field), "--roles-to-train", "assistant,narrator"],
                  "ringtrain: config error: --roles-to-train: 'assistant,narrator': name some of system, user, assistant, tool (narrator is not a role)"),
        "chat-template": ([str(field), "--chat-template", str(tmp / "none.jinja")],
                          f"ringtrain: config error: --chat-template: {tmp / 'none.jinja'}: no such file, nor a template that ships"),
    }


@pytest.mark.parametrize("case", ["field", "role", "no-assistant", "no-template", "bytes", "template", "text-file", "text-format",
                                  "roles", "chat-template"])
def test_bad_input_exits_2_with_one_line_and_writes_nothing(
    serial: None, chat_tokenizers: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str
) -> None:
    args, expected = _bad_inputs(tmp_path, chat_tokenizers["chatml"])[case]
    if "--format" not in args:
        args += ["--format", "chat"]
    if "--tokenizer" not in args:
        args += ["--tokenizer", str(chat_tokenizers["chatml"])]
    before = sorted(p.name for p in tmp_path.iterdir())
    code, _, err = prepare([*args, "--out", str(tmp_path / "out"), "--parallelism", "1"], capsys)
    assert code == 2 and err.startswith(expected) and err.count("\n") == 1, err
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no output, no staging left behind


def test_a_bad_record_is_found_before_any_cluster_starts(
    chat_tokenizers: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A corpus prepare would tokenize on Ray: its malformed record at line 3 is named on the
    driver, no cluster started; the template's own refusals are still the actors' to find."""
    from ringtrain.prepare import pipeline

    def no_cluster(address: Any, num_cpus: Any) -> Any:
        raise AssertionError("a cluster was started")

    monkeypatch.setattr(pipeline, "connect", no_cluster)
    good = {"messages": [{"role": "user", "content": "why"}, {"role": "assistant", "content": "the ring"}]}
    src = tmp_path / "c.jsonl"
    bad = {"messages": [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a", "weight": 2}]}
    src.write_text("".join(json.dumps(r) + "\n" for r in [good, good, bad, good]))
    code, _, err = prepare([str(src), "--format", "chat", "--tokenizer", str(chat_tokenizers["chatml"]), "--out",
                            str(tmp_path / "out"), "--parallelism", "2"], capsys)  # fmt: skip
    assert (code, err) == (2, f"ringtrain: data error: {src}:3: field 'messages' message 2: 'weight' is 2; a message's weight is 0 or 1\n")
    assert not (tmp_path / "out").exists()


def test_bad_conversations_are_skipped_and_listed(
    serial: None, chat_tokenizers: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    good = {"messages": [{"role": "user", "content": "why"}, {"role": "assistant", "content": "the ring"}]}
    rows = [good, {"messages": [{"role": "user", "content": "u"}]}, {"messages": []}, good]
    src = tmp_path / "c.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    code, stdout, err = prepare([str(src), "--format", "chat", "--tokenizer", str(chat_tokenizers["chatml"]), "--out",
                                 str(tmp_path / "out"), "--on-bad-record", "skip", "--parallelism", "1"], capsys)  # fmt: skip
    assert code == 0, err
    manifest = Manifest.load(tmp_path / "out")
    assert (manifest.num_documents, manifest.num_skipped) == (2, 2) and "2 records skipped" in stdout
    assert [(s.line, s.reason) for s in manifest.skipped] == [
        (2, "no assistant turn to train on (--train-on assistant)"), (3, "field 'messages' holds no messages")]


def test_on_ray_the_bytes_are_the_same_at_any_parallelism_and_split(
    cluster: None, chat_tokenizers: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two actors, the plain JSONL in 3 KB ranges and the Parquet in runs of row groups, against the
    actors' code run in order in this process on whole files: the same bytes, manifest included."""
    from ringtrain.prepare import sources

    write_chat_corpus(tmp_path / "src")
    tok = str(chat_tokenizers["llama3"])
    flags = ["--format", "chat", "--tokenizer", tok, "--shard-tokens", "3000"]
    out = tmp_path / "out"
    run_serially(monkeypatch)
    code, _, err = prepare([str(tmp_path / "src"), *flags, "--out", str(out), "--parallelism", "1"], capsys)
    assert code == 0, err
    monkeypatch.undo()
    first = files_of(out)
    pieces = sources.plan(sources.expand([str(tmp_path / "src")]), 3000)
    assert len(pieces) > 8
    code, stdout, err = prepare([str(tmp_path / "src"), *flags, "--out", str(out), "--parallelism", "2", "--split-bytes", "3000",
                                 "--overwrite"], capsys)  # fmt: skip
    assert code == 0, err
    assert files_of(out) == first and "conversations" in stdout


def test_the_manifest_refuses_inconsistent_chat_counts(chat_tokenizers: dict[str, Path], tmp_path: Path) -> None:
    from ringtrain.errors import DataError
    from ringtrain_dev.prepared_data import write_chat_prepared

    conv = [(np.arange(5), np.array([0, 1, 1, 1, 1], np.uint8)), (np.arange(3), np.array([0, 0, 1], np.uint8))]
    manifest = write_chat_prepared(tmp_path / "d", conv, vocab_size=16)
    assert Manifest.load(tmp_path / "d") == manifest and manifest.chat is not None and manifest.chat.num_trained_tokens == 5
    obj = manifest.to_json()
    obj["chat"]["num_trained_tokens"] = 7  # 8 tokens, 2 conversations: at most 6 targets
    with pytest.raises(DataError, match="chat.num_trained_tokens 7 exceeds the 6 tokens that can be targets"):
        Manifest.from_json(obj)
    obj["chat"] |= {"num_trained_tokens": 5, "mask_source": "guess"}
    with pytest.raises(DataError, match="field chat.mask_source must be one of generation, prefix"):
        Manifest.from_json(obj)
    del obj["chat"]["num_trained_tokens"]
    obj["chat"]["mask_source"] = "prefix"
    assert Manifest.from_json(obj).chat.num_trained_tokens is None  # type: ignore[union-attr]  # older manifests

