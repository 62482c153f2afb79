"""Which turns of a chat record train, and what the template is given: the record's own fields
(``tools`` and the rest the template reads), the messages' own weights, ``--roles-to-train``,
``--train-on-eos``, Alpaca records, ``--chat-template`` (a file, or the Qwen3 template that ships).

The masks are checked against references built apart from the code under test: transformers'
own assistant mask of a template whose markers wrap exactly the trained turns (weight-0 turns
left out by the reference template itself), and hand-written renderings of the formats.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any, Optional

import numpy as np
import pytest

from ringtrain.errors import ConfigError
from ringtrain.prepare import chat_render, chat_template
from ringtrain.prepare.chat_records import BadConversation, ChatRecord, Conversation, read_chat
from ringtrain.prepare.chat_render import ChatRenderer, ChatSpec, TemplateRefused
from ringtrain_dev.tiny_tokenizer import (
    CHAT_WORDS,
    TOOLS_MARKED_TEMPLATE,
    TOOLS_TEMPLATE,
    TOOLS_WEIGHTED_REFERENCE,
    save_chat_tokenizer,
)
from tests.prepare.test_chat_render import conversations, reference_mask

VOCAB = 320


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("chat-tok")
    out = {style: save_chat_tokenizer(root / style, style) for style in ("chatml", "llama3")}
    for name, text in (("tools", TOOLS_TEMPLATE), ("tools-marked", TOOLS_MARKED_TEMPLATE)):
        out[name] = with_template(out["chatml"], root / name, text)
    return out


def with_template(folder: Path, out: Path, text: str) -> Path:
    out.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (out / name).write_bytes((folder / name).read_bytes())
    (out / "chat_template.jinja").write_text(text)
    return out


def renderer(folder: Path, train_on: str = "assistant", *, roles: tuple[str, ...] = ("assistant",), eos: str = "turn",
             template: Optional[chat_template.ChatTemplate] = None) -> ChatRenderer:  # fmt: skip
    return ChatRenderer(ChatSpec(template or chat_template.find(str(folder)), train_on, "messages", VOCAB, roles, eos))


def tool_records(num: int, seed: int = 0) -> list[dict[str, Any]]:
    """Records with ``tools`` (or none) and weights on some assistant messages (0 or 1)."""
    rng = random.Random(seed)
    out = []
    for i, conv in enumerate(conversations(num, seed=seed)):
        record: dict[str, Any] = {"messages": [dict(m) for m in conv]}
        for m in record["messages"]:
            if m["role"] == "assistant" and rng.random() < 0.4:
                m["weight"] = rng.choice([0, 1])
        if i % 3:
            record["tools"] = [{"name": rng.choice(CHAT_WORDS)} for _ in range(rng.randint(1, 3))]
        out.append(record)
    return out


def read(renderer_: ChatRenderer, record: dict[str, Any]) -> ChatRecord:
    return read_chat(Conversation(record), "messages", renderer_.context_fields)


@pytest.mark.parametrize("style", ["tools", "tools-marked"])
def test_tools_reach_the_template_and_weight_0_turns_do_not_train(folders: dict[str, Path], style: str) -> None:
    """With and without markers: transformers' own mask of the reference template, whose markers
    wrap the assistant turns whose weight is not 0, given the record's tools."""
    r = renderer(folders[style])
    assert r.context_fields == {"tools"} and r.template.has_markers == (style == "tools-marked")
    tok, seen_tools, seen_zero = r._tok, 0, 0
    for record in tool_records(30):
        chat = read(r, record)
        if all(f is False for f, m in zip(chat.flags, chat.messages) if m["role"] == "assistant"):
            continue  # nothing trains: a bad record (below)
        ids, mask = r.render(chat)
        out = tok.apply_chat_template(record["messages"], tools=record.get("tools"), chat_template=TOOLS_WEIGHTED_REFERENCE,
                                      return_dict=True, return_assistant_tokens_mask=True)  # fmt: skip
        want = np.asarray(out["assistant_masks"], dtype=np.uint8)
        want[0] = 0
        assert ids.tolist() == list(out["input_ids"]) and mask.tolist() == want.tolist(), record
        seen_tools += "tools" in record
        seen_zero += any(m.get("weight") == 0 for m in record["messages"])
    assert seen_tools > 5 and seen_zero > 3


def test_a_record_whose_weights_leave_nothing_is_bad(folders: dict[str, Path]) -> None:
    r = renderer(folders["chatml"])
    record = {"messages": [{"role": "user", "content": "why"}, {"role": "assistant", "content": "ring", "weight": 0}]}
    with pytest.raises(BadConversation, match="no assistant turn to train on \\(--train-on assistant and its messages' own weights\\)"):
        r.render(read(r, record))


@pytest.mark.parametrize(
    ("message", "reason"),
    [
        ({"weight": 0.5}, "'weight' is 0.5; a message's weight is 0 or 1"),
        ({"weight": True}, "'weight' is True; a message's weight is 0 or 1"),
        ({"train": "no"}, "'train' is 'no', not true or false"),
        ({"weight": 1, "train": False}, "'weight' 1 and 'train' False disagree"),
    ],
)
def test_a_flag_that_is_neither_0_nor_1_is_a_bad_record(message: dict[str, Any], reason: str) -> None:
    record = {"messages": [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a", **message}]}
    with pytest.raises(BadConversation, match=f"^field 'messages' message 2: {reason}"):
        read_chat(Conversation(record), "messages")


def _turn_spans(conv: list[dict[str, str]], roles: set[str]) -> tuple[str, list[tuple[str, int, int, int]]]:
    """ChatML by hand: the text, and for each message of ``roles`` (role, its text's start, where
    its <|im_end|> starts, where it ends)."""
    text, spans = "", []
    for m in conv:
        text += f"<|im_start|>{m['role']}\n"
        start = len(text)
        text += m["content"]
        end_of_turn = len(text)
        text += "<|im_end|>"
        if m["role"] in roles:
            spans.append((m["role"], start, end_of_turn, len(text)))
        text += "\n"
    return text, spans


@pytest.mark.parametrize("eos", ["turn", "last", "none"])
def test_roles_to_train_and_train_on_eos(folders: dict[str, Path], eos: str) -> None:
    """The user's and the assistant's turns train (the user's from its text on: its header is not
    trained); the end-of-turn token of every turn, of the last, or of none."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(folders["chatml"] / "tokenizer.json"))
    r = renderer(folders["chatml"], roles=("user", "assistant"), eos=eos)
    for conv in conversations(20, seed=3):
        conv = [{**m, "content": m["content"].strip() or "ring"} for m in conv]
        text, spans = _turn_spans(conv, {"user", "assistant"})
        enc = tok.encode(text, add_special_tokens=False)
        want = np.zeros(len(enc.ids), dtype=np.uint8)
        for i, (_, start, eot, end) in enumerate(spans):
            keeps = eos == "turn" or (eos == "last" and i == len(spans) - 1)
            stop = end if keeps else eot
            for t, (a, b) in enumerate(enc.offsets):
                if a < stop and b > start:
                    want[t] = 1
        want[0] = 0
        ids, mask = r.render(ChatRecord(conv))
        assert ids.tolist() == enc.ids and mask.tolist() == want.tolist(), conv


def test_a_messages_own_flag_overrides_its_role(folders: dict[str, Path]) -> None:
    r = renderer(folders["llama3"])
    conv = [{"role": "user", "content": "why", "train": True}, {"role": "assistant", "content": "ring", "train": False},
            {"role": "user", "content": "how"}, {"role": "assistant", "content": "token"}]  # fmt: skip
    ids, mask = r.render(read(r, {"messages": conv}))
    tokens = r._tok.convert_ids_to_tokens(ids.tolist())
    trained = "".join(r._tok.convert_tokens_to_string([t]) for t, m in zip(tokens, mask) if m)
    assert trained == "why<|eot_id|>token<|eot_id|>"


def test_alpaca_records_are_a_user_and_an_assistant_turn(folders: dict[str, Path]) -> None:
    r = renderer(folders["chatml"])
    for record, user in (({"instruction": "why", "input": "a ring", "output": "the rank"}, "why\n\na ring"),
                         ({"instruction": "why", "output": "the rank"}, "why"),
                         ({"instruction": "why", "input": "", "output": "the rank"}, "why")):  # fmt: skip
        chat = read_chat(Conversation(record), "messages")
        assert chat.messages == [{"role": "user", "content": user}, {"role": "assistant", "content": "the rank"}]
        assert r.render(chat)[1].tolist() == reference_mask(folders["chatml"], "chatml", chat.messages, "assistant")[1].tolist()
    with pytest.raises(BadConversation, match="^field 'output' is int, not a string"):
        read_chat(Conversation({"instruction": "why", "output": 3}), "messages")


def test_record_fields_the_template_reads_reach_it_and_no_others(folders: dict[str, Path], tmp_path: Path) -> None:
    text = ("{{ bos_token }}{% if system %}{{ '<|im_start|>system\\n' + system + '<|im_end|>\\n' }}{% endif %}"
            + chat_template.find(str(folders["chatml"])).text)  # fmt: skip
    folder = with_template(folders["chatml"], tmp_path / "system", text)
    r = renderer(folder)
    assert r.context_fields == {"system"}  # bos_token is the tokenizer's, never a record's
    conv = [{"role": "user", "content": "why"}, {"role": "assistant", "content": "ring"}]
    record = {"messages": conv, "system": "be terse", "bos_token": "<|im_end|>", "unused": "x"}
    chat = read(r, record)
    assert chat.context == {"system": "be terse"}
    want = r._tok.apply_chat_template(conv, chat_template=text, tokenize=False, system="be terse")
    assert r._tok.decode(r.render(chat)[0]) == want and want.startswith("<|im_start|>system\nbe terse")
    with pytest.raises(BadConversation, match="field 'tools' is a string that is not JSON"):
        read_chat(Conversation({"messages": conv, "tools": "{bad"}), "messages", frozenset({"tools"}))
    tools = [{"name": "get"}]
    assert read_chat(Conversation({"messages": conv, "tools": json.dumps(tools)}), "messages", frozenset({"tools"})).context == {"tools": tools}


def qwen3_reference(conv: list[dict[str, Any]], tools: Optional[list[dict[str, Any]]] = None) -> tuple[str, list[tuple[int, int]]]:
    """Qwen3's chat format written out by hand: the text, and each assistant turn's output span
    (reasoning, text, tool calls and <|im_end|>). The reasoning of turns after the last user query
    is kept (the final turn's always, empty or not), earlier turns' dropped."""
    text, spans = "", []
    system = conv[0]["content"] if conv and conv[0]["role"] == "system" else None
    if tools:
        text += "<|im_start|>system\n" + (system + "\n\n" if system is not None else "")
        text += "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        text += "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
        text += "".join("\n" + json.dumps(t, ensure_ascii=False) for t in tools)
        text += ("\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
                 "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
                 "<args-json-object>}\n</tool_call><|im_end|>\n")  # fmt: skip
    elif system is not None:
        text += f"<|im_start|>system\n{system}<|im_end|>\n"
    queries = [i for i, m in enumerate(conv) if m["role"] == "user"
               and not (m["content"].startswith("<tool_response>") and m["content"].endswith("</tool_response>"))]  # fmt: skip
    last_query = queries[-1] if queries else len(conv) - 1
    for i, m in enumerate(conv):
        content = m.get("content") or ""
        if m["role"] == "user" or (m["role"] == "system" and i > 0):
            text += f"<|im_start|>{m['role']}\n{content}<|im_end|>\n"
        elif m["role"] == "assistant":
            reasoning = m.get("reasoning_content")
            if reasoning is None:
                reasoning = ""
                if "</think>" in content:
                    reasoning = content.split("</think>")[0].rstrip("\n").split("<think>")[-1].lstrip("\n")
                    content = content.split("</think>")[-1].lstrip("\n")
            text += "<|im_start|>assistant\n"
            start = len(text)
            if i > last_query and (i == len(conv) - 1 or reasoning):
                text += "<think>\n" + reasoning.strip("\n") + "\n</think>\n\n" + content.lstrip("\n")
            else:
                text += content
            for j, call in enumerate(m.get("tool_calls") or []):
                text += "\n" if (j > 0 or content) else ""
                call = call.get("function", call)
                arguments = call["arguments"] if isinstance(call["arguments"], str) else json.dumps(call["arguments"], ensure_ascii=False)
                text += '<tool_call>\n{"name": "' + call["name"] + '", "arguments": ' + arguments + "}\n</tool_call>"
            text += "<|im_end|>"
            spans.append((start, len(text)))
            text += "\n"
        elif m["role"] == "tool":
            if i == 0 or conv[i - 1]["role"] != "tool":
                text += "<|im_start|>user"
            text += f"\n<tool_response>\n{content}\n</tool_response>"
            if i == len(conv) - 1 or conv[i + 1]["role"] != "tool":
                text += "<|im_end|>\n"
    return text, spans


def qwen3_conversations() -> list[tuple[list[dict[str, Any]], Optional[list[dict[str, Any]]]]]:
    call = {"type": "function", "function": {"name": "get", "arguments": {"city": "ring"}}}
    return [
        ([{"role": "user", "content": "why"}, {"role": "assistant", "content": "the ring"}], None),
        ([{"role": "system", "content": "be terse"}, {"role": "user", "content": "why"},
          {"role": "assistant", "content": "<think>\nhm\n</think>\n\nthe ring"}, {"role": "user", "content": "how"},
          {"role": "assistant", "content": "a token", "reasoning_content": "think"}], None),
        ([{"role": "system", "content": "be terse"}, {"role": "user", "content": "weather?"},
          {"role": "assistant", "content": "", "tool_calls": [call, {"function": {"name": "more", "arguments": "{}"}}]},
          {"role": "tool", "content": "sunny"}, {"role": "tool", "content": "warm"},
          {"role": "assistant", "content": "<think>ok</think>Sunny and warm."}], [{"type": "function", "function": {"name": "get"}}]),
        ([{"role": "user", "content": "why"}, {"role": "assistant", "content": "<think>a</think>ring", "tool_calls": [call]},
          {"role": "tool", "content": "x"}, {"role": "assistant", "content": "done"}, {"role": "user", "content": "how"},
          {"role": "assistant", "content": "<think>b</think>token"}], None),
    ]  # fmt: skip


def test_the_qwen3_template_that_ships_renders_qwen3s_format_with_every_turn_masked(folders: dict[str, Path]) -> None:
    """Qwen3 drops earlier turns' reasoning, so its own template cannot be masked from prefixes;
    the one that ships renders the same text and marks every assistant turn."""
    from tokenizers import Tokenizer

    assert "qwen3" in chat_template.shipped()
    template = chat_template.override(chat_template.find(str(folders["chatml"])), "qwen3")
    assert template.has_markers and template.file == "qwen3" and template.variables >= {"tools", "enable_thinking"}
    r = renderer(folders["chatml"], template=template)
    tok = Tokenizer.from_file(str(folders["chatml"] / "tokenizer.json"))
    for conv, tools in qwen3_conversations():
        text, spans = qwen3_reference(conv, tools)
        enc = tok.encode(text, add_special_tokens=False)
        want = np.asarray([any(a <= s and e <= b for a, b in spans) for s, e in enc.offsets], dtype=np.uint8)
        want[0] = 0
        ids, mask = r.render(read(r, {"messages": conv, **({"tools": tools} if tools else {})}))
        assert ids.tolist() == enc.ids and mask.tolist() == want.tolist(), conv
    prompt = r._tok.apply_chat_template(qwen3_conversations()[0][0][:1], chat_template=template.text, tokenize=False,
                                        add_generation_prompt=True, enable_thinking=False)  # fmt: skip
    assert prompt == "<|im_start|>user\nwhy<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"


def test_a_template_that_rewrites_history_is_refused_naming_the_ways_out(folders: dict[str, Path], tmp_path: Path) -> None:
    rewriting = ("{% for m in messages %}{% if m['role'] == 'assistant' and not loop.last %}"
                 "{{ '<|im_start|>assistant\\n' + m['content'].split('</think>')[-1] + '<|im_end|>\\n' }}"
                 "{% else %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endif %}{% endfor %}"
                 "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")  # fmt: skip
    folder = with_template(folders["chatml"], tmp_path / "rewriting", rewriting)
    conv = [{"role": "user", "content": "why"}, {"role": "assistant", "content": "<think>hm</think>ring"},
            {"role": "user", "content": "how"}, {"role": "assistant", "content": "token"}]  # fmt: skip
    with pytest.raises(TemplateRefused) as refused:
        renderer(folder).render(ChatRecord(conv))
    assert "--chat-template" in str(refused.value) and "qwen3" in str(refused.value) and "--train-on last" in str(refused.value)
    assert renderer(folder, "last").render(ChatRecord(conv))[1].sum() > 0


def test_a_record_whose_prefix_the_template_refuses_is_a_bad_record(folders: dict[str, Path], tmp_path: Path) -> None:
    """A template that refuses a prefix of one record (here: five messages) makes that record bad,
    not the whole prepare: the probe rendered every prefix the template is asked for."""
    strict = "{% if messages | length == 5 %}{{ raise_exception('five is too many') }}{% endif %}" + chat_template.find(
        str(folders["llama3"])).text
    folder = with_template(folders["llama3"], tmp_path / "strict", strict)
    chat_render.check(ChatSpec(chat_template.find(str(folder)), "assistant", "messages", VOCAB))
    conv = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}] * 3
    with pytest.raises(BadConversation, match="cannot render its first 5 messages \\(TemplateError: five is too many\\)"):
        renderer(folder).render(ChatRecord(conv))


def test_a_chosen_template_that_is_missing_or_refused_names_the_flag(folders: dict[str, Path], tmp_path: Path) -> None:
    found = chat_template.find(str(folders["chatml"]))
    with pytest.raises(ConfigError, match="^--chat-template: nowhere.jinja: no such file, nor a template that ships \\(qwen3"):
        chat_template.override(found, "nowhere.jinja")
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}{{ raise_exception('no') }}{% endfor %}")
    with pytest.raises(ConfigError, match=f"^--chat-template: {bad}: a probe conversation"):
        chat_render.check(ChatSpec(chat_template.override(found, str(bad)), "assistant", "messages", VOCAB))
