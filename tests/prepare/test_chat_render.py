"""Chat templates and loss masks: each conversation rendered by the tokenizer folder's own template, its
mask against a reference built apart from the code under test.

The reference writes each template's text by hand in Python (no Jinja), keeps the character span of
every assistant turn (its text and end-of-turn token), tokenizes the text with the ``tokenizers``
library (no transformers) and marks the tokens that lie inside a span. For the Llama 3 template (no
markers: masks from rendered prefixes) the mask must also equal transformers' assistant mask of the
same template with markers added.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ringtrain.errors import ConfigError
from ringtrain.prepare import chat_render, chat_template
from ringtrain.prepare.chat_records import BadConversation, ChatRecord
from ringtrain.prepare.chat_render import ChatRenderer, ChatSpec, TemplateRefused
from ringtrain_dev.tiny_tokenizer import CHAT_WORDS, CHATML_TEMPLATE, LLAMA3_MARKED_TEMPLATE, save_chat_tokenizer

Conversation = list[dict[str, str]]


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("chat-tok")
    return {style: save_chat_tokenizer(root / style, style) for style in ("chatml", "llama3")}


def conversations(num: int, seed: int = 0) -> list[Conversation]:
    """Multi-turn conversations, most with a system prompt; texts with leading and trailing spaces."""
    rng = random.Random(seed)

    def say() -> str:
        text = " ".join(rng.choice(CHAT_WORDS) for _ in range(rng.randint(1, 9)))
        return rng.choice(["", " "]) + text + rng.choice(["", " ", "?"])

    out = []
    for _ in range(num):
        conv = [{"role": "system", "content": say()}] if rng.random() < 0.7 else []
        for _ in range(rng.randint(1, 4)):
            conv += [{"role": "user", "content": say()}, {"role": "assistant", "content": say()}]
        if rng.random() < 0.3:
            conv.append({"role": "user", "content": say()})  # ends on the user's turn
        out.append(conv)
    return out


def reference(style: str, conv: Conversation) -> tuple[str, list[tuple[int, int]]]:
    """The text the template renders, by hand, and each assistant turn's character span."""
    text, spans = ("", []) if style == "chatml" else ("<|begin_of_text|>", [])
    for m in conv:
        if style == "chatml":
            text += f"<|im_start|>{m['role']}\n"
            body, end, after = m["content"], "<|im_end|>", "\n"
        else:
            text += f"<|start_header_id|>{m['role']}<|end_header_id|>\n\n"
            body, end, after = m["content"].strip(), "<|eot_id|>", ""
        start = len(text)
        text += body + end
        if m["role"] == "assistant":
            spans.append((start, len(text)))
        text += after
    return text, spans


def reference_mask(folder: Path, style: str, conv: Conversation, train_on: str) -> tuple[list[int], np.ndarray]:
    from tokenizers import Tokenizer

    text, spans = reference(style, conv)
    enc = Tokenizer.from_file(str(folder / "tokenizer.json")).encode(text, add_special_tokens=False)
    if train_on == "last":
        spans = spans[-1:]
    inside = [any(a <= start and end <= b for a, b in spans) for start, end in enc.offsets]
    mask = np.ones(len(enc.ids), np.uint8) if train_on == "all" else np.array(inside, dtype=np.uint8)
    mask[0] = 0
    return enc.ids, mask


def renderer(folder: Path, train_on: str, template: chat_template.ChatTemplate | None = None) -> ChatRenderer:
    return ChatRenderer(ChatSpec(template or chat_template.find(str(folder)), train_on, "messages", 320))


@pytest.mark.parametrize("train_on", ["assistant", "last", "all"])
@pytest.mark.parametrize("style", ["chatml", "llama3"])
def test_masks_equal_the_hand_built_reference(folders: dict[str, Path], style: str, train_on: str) -> None:
    r = renderer(folders[style], train_on)
    assert r.template.mask_source == ("generation" if style == "chatml" else "prefix")
    for conv in conversations(24):
        ids, mask = r.render(ChatRecord(conv))
        want_ids, want_mask = reference_mask(folders[style], style, conv, train_on)
        assert ids.tolist() == want_ids
        assert mask.dtype == np.uint8 and mask.tolist() == want_mask.tolist(), conv


def test_prefix_masks_equal_transformers_masks_of_the_marked_template(folders: dict[str, Path]) -> None:
    """The Llama 3 template without markers, masked from its prefixes, gives transformers' own mask of
    the same template with {% generation %} around each assistant turn."""
    r = renderer(folders["llama3"], "assistant")
    tok = r._tok
    for conv in conversations(24, seed=1):
        out = tok.apply_chat_template(conv, chat_template=LLAMA3_MARKED_TEMPLATE, return_dict=True, return_assistant_tokens_mask=True)
        ids, mask = r.render(ChatRecord(conv))
        assert ids.tolist() == list(out["input_ids"]) and mask.tolist() == list(out["assistant_masks"])
        assert mask.sum() > 0


def test_a_masked_turn_ends_with_its_end_of_turn_token(folders: dict[str, Path]) -> None:
    conv = [{"role": "system", "content": "you are terse"}, {"role": "user", "content": "why"},
            {"role": "assistant", "content": "the ring"}, {"role": "user", "content": "how"},
            {"role": "assistant", "content": "a token"}]  # fmt: skip
    for style, eot in (("chatml", "<|im_end|>"), ("llama3", "<|eot_id|>")):
        r = renderer(folders[style], "assistant")
        ids, mask = r.render(ChatRecord(conv))
        tokens = r._tok.convert_ids_to_tokens(ids.tolist())
        runs = "".join(map(str, mask.tolist())).strip("0").split("0")
        runs = [run for run in runs if run]
        assert len(runs) == 2  # the two assistant turns, nothing else
        ends = [i for i in range(1, len(mask)) if mask[i - 1] == 1 and mask[i] == 0] + ([len(mask)] if mask[-1] else [])
        assert [tokens[i - 1] for i in ends] == [eot, eot]


def test_no_assistant_turn_is_a_bad_conversation_unless_all_tokens_train(folders: dict[str, Path]) -> None:
    conv = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    for train_on in ("assistant", "last"):
        with pytest.raises(BadConversation, match=f"no assistant turn to train on \\(--train-on {train_on}\\)"):
            renderer(folders["chatml"], train_on).render(ChatRecord(conv))
    ids, mask = renderer(folders["chatml"], "all").render(ChatRecord(conv))
    assert mask.tolist() == [0] + [1] * (len(ids) - 1)


def test_an_opening_assistant_turn_is_marked_by_markers_but_not_by_prefixes(folders: dict[str, Path]) -> None:
    conv = [{"role": "assistant", "content": "hello"}, {"role": "user", "content": "why"}, {"role": "assistant", "content": "the ring"}]
    ids, mask = renderer(folders["chatml"], "assistant").render(ChatRecord(conv))
    assert ids.tolist() == reference_mask(folders["chatml"], "chatml", conv, "assistant")[0]
    with pytest.raises(BadConversation, match="opens with the assistant's turn"):
        renderer(folders["llama3"], "assistant").render(ChatRecord(conv))
    # The last turn alone is found after its prompt.
    assert renderer(folders["llama3"], "last").render(ChatRecord(conv))[1].tolist() == reference_mask(folders["llama3"], "llama3", conv, "last")[1].tolist()


# The last assistant turn rendered in full, earlier ones cut (as templates that drop past reasoning do):
# a prefix's rendering then does not begin the whole's.
REWRITING_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'assistant' and not loop.last %}{{ '<|im_start|>assistant\\n...<|im_end|>\\n' }}"
    "{% else %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def _with_template(folder: Path, tmp_path: Path, text: str) -> Path:
    out = tmp_path / "tok"
    out.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (out / name).write_bytes((folder / name).read_bytes())
    (out / "chat_template.jinja").write_text(text)
    return out


def test_a_template_whose_prefixes_are_not_prefixes_is_refused_by_name(folders: dict[str, Path], tmp_path: Path) -> None:
    folder = _with_template(folders["chatml"], tmp_path, REWRITING_TEMPLATE)
    template = chat_template.find(str(folder))
    assert (template.file, template.mask_source) == ("chat_template.jinja", "prefix")
    conv = [{"role": "user", "content": "why"}, {"role": "assistant", "content": "ring"},
            {"role": "user", "content": "how"}, {"role": "assistant", "content": "token"}]  # fmt: skip
    with pytest.raises(TemplateRefused, match=f"^{folder / 'chat_template.jinja'}: the chat template renders message 2's"):
        renderer(folder, "assistant").render(ChatRecord(conv))
    assert renderer(folder, "last").render(ChatRecord(conv))[1].sum() > 0  # the last turn's prefixes do agree
    assert renderer(folder, "all").render(ChatRecord(conv))[1].sum() == len(renderer(folder, "all").render(ChatRecord(conv))[0]) - 1
    with pytest.raises(ConfigError, match="chat_template.jinja: the chat template renders message 2's .* \\(seen on a probe conversation\\)"):
        chat_render.check(ChatSpec(template, "assistant", "messages", 320))


def test_a_template_that_refuses_a_record_makes_it_bad(folders: dict[str, Path], tmp_path: Path) -> None:
    strict = "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}" + CHATML_TEMPLATE
    folder = _with_template(folders["chatml"], tmp_path, strict)
    with pytest.raises(BadConversation, match="the chat template cannot render it \\(TemplateError: System role not supported\\)"):
        renderer(folder, "assistant").render(ChatRecord([{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
                                                         {"role": "assistant", "content": "a"}]))  # fmt: skip
    chat_render.check(ChatSpec(chat_template.find(str(folder)), "assistant", "messages", 320))  # the probe has no system turn


def test_the_template_is_found_where_transformers_finds_it(folders: dict[str, Path], tmp_path: Path) -> None:
    folder = _with_template(folders["chatml"], tmp_path, LLAMA3_MARKED_TEMPLATE)
    found = chat_template.find(str(folder / "tokenizer.json"))
    assert (found.file, found.text) == ("chat_template.jinja", LLAMA3_MARKED_TEMPLATE)  # the .jinja wins
    (folder / "chat_template.jinja").unlink()
    found = chat_template.find(str(folder))
    assert (found.file, found.text, found.has_markers) == ("tokenizer_config.json", CHATML_TEMPLATE, True)
    import hashlib

    assert found.sha256 == hashlib.sha256(CHATML_TEMPLATE.encode()).hexdigest()
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = [{"name": "tool_use", "template": "x"}, {"name": "default", "template": "y"}]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    assert chat_template.find(str(folder)).text == "y"
    config["chat_template"] = [{"name": "tool_use", "template": "x"}]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="lists templates \\['tool_use'\\] but none named 'default'"):
        chat_template.find(str(folder))
    del config["chat_template"]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=f"--tokenizer: {folder} has no chat template \\(a chat_template.jinja, or chat_template in tokenizer_config.json\\)"):
        chat_template.find(str(folder))
    with pytest.raises(ConfigError, match="--tokenizer: bytes has no chat template"):
        chat_template.find("bytes")


def test_tool_turns_render_and_only_the_assistant_trains(folders: dict[str, Path]) -> None:
    conv: list[dict[str, Any]] = [{"role": "user", "content": "why"}, {"role": "assistant", "content": "call"},
                                  {"role": "tool", "content": "ring"}, {"role": "assistant", "content": "token"}]  # fmt: skip
    for style in ("chatml", "llama3"):
        ids, mask = renderer(folders[style], "assistant").render(ChatRecord(conv))
        want_ids, want_mask = reference_mask(folders[style], style, conv, "assistant")
        assert ids.tolist() == want_ids and mask.tolist() == want_mask.tolist()
