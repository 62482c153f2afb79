"""Chat records built to exhaust `ringtrain prepare --format chat`'s renderer, each a bad record at
its line within seconds and bounded memory, so ``--on-bad-record skip`` goes on: a JSONL record
of 8,000 messages (a template without markers is masked from every prefix: hours), a Parquet row
of a million messages in a few KB, a template whose loops run past the time budget, and one that
doubles a string past the memory budget. The big cases run prepare in a child process and read
its peak memory (tests/prepare/peak.py); the rest run the actors' code in this process.
"""

from __future__ import annotations

import json
import shutil
import threading
import time
from pathlib import Path

import pytest

from ringtrain import cli
from ringtrain.prepare.render_budget import OverBudget, RenderBudget, Watchdog
from ringtrain.prepared import Manifest
from tests.prepare.test_hostile import PEAK_BOUND, prepare_in_child
from ringtrain_dev.tiny_tokenizer import CHATML_TEMPLATE, save_chat_tokenizer

GOOD = [{"role": "user", "content": "the ring"}, {"role": "assistant", "content": "a rank"}]
# Loops a template may hide behind an ordinary rendering: cubic in the messages, and a string
# doubled once a message. The probe conversation (4 messages) and GOOD render at once.
CUBIC = "{% for a in messages %}{% for b in messages %}{% for c in messages %}{% endfor %}{% endfor %}{% endfor %}"
DOUBLING = "{% set ns = namespace(s='x') %}{% for m in messages %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}"


def turns(num: int, text: str = "the ring rank") -> list[dict[str, str]]:
    return [{"role": "user" if i % 2 == 0 else "assistant", "content": text} for i in range(num)]


def jsonl(path: Path, *conversations: list[dict[str, str]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"messages": c}) + "\n" for c in conversations))
    return path


@pytest.fixture(scope="module")
def chatml(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_chat_tokenizer(tmp_path_factory.mktemp("tok") / "chatml", "chatml")


@pytest.fixture(scope="module")
def llama3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Meta's Llama 3 template, which has no generation markers: masked from rendered prefixes."""
    return save_chat_tokenizer(tmp_path_factory.mktemp("tok") / "llama3", "llama3")


def with_template(chatml: Path, folder: Path, prefix: str) -> Path:
    """The ChatML tokenizer with a template that runs ``prefix`` first, then renders as ChatML."""
    shutil.copytree(chatml, folder)
    (folder / "chat_template.jinja").write_text(prefix + CHATML_TEMPLATE)
    return folder


def prepare(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str, float]:
    started = time.monotonic()
    code = cli.main(["prepare", "--quiet", "--format", "chat", *args])
    out, err = capsys.readouterr()
    return code, out, err, time.monotonic() - started


def skipped(out: Path) -> list[tuple[int, str]]:
    return [(s.line, s.reason) for s in Manifest.load(out).skipped]


def test_a_conversation_of_8000_messages_is_a_bad_record_before_it_is_rendered(
    serial: None, llama3: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A few hundred KB of JSONL, 8,000 messages: masked from its prefixes, 4,000 renderings of up to
    8,000 messages each (hours). Refused by the count, before any."""
    src = jsonl(tmp_path / "src" / "a.jsonl", GOOD, turns(8000), GOOD)
    code, _, err, seconds = prepare([str(src), "--tokenizer", str(llama3), "--out", str(tmp_path / "fail")], capsys)
    assert (code, err) == (2, f"ringtrain: data error: {src}:2: 8,000 messages, over the 1,024-message limit (--max-messages)\n")
    assert not (tmp_path / "fail").exists()

    out = tmp_path / "out"
    code, _, err, seconds = prepare([str(src), "--tokenizer", str(llama3), "--out", str(out), "--on-bad-record", "skip"], capsys)
    assert code == 0, err
    assert skipped(out) == [(2, "8,000 messages, over the 1,024-message limit (--max-messages)")]
    assert Manifest.load(out).num_documents == 2 and seconds < 30


def test_max_messages_moves_the_limit(serial: None, chatml: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = jsonl(tmp_path / "src" / "a.jsonl", turns(4), turns(5), turns(6))
    out = tmp_path / "out"
    code, _, err, _ = prepare([str(src), "--tokenizer", str(chatml), "--out", str(out), "--on-bad-record", "skip", "--max-messages", "5"], capsys)
    assert code == 0, err
    assert skipped(out) == [(3, "6 messages, over the 5-message limit (--max-messages)")]


def test_a_parquet_row_of_a_million_messages_is_refused_before_it_is_decoded(chatml: Path, tmp_path: Path) -> None:
    """A few KB of Parquet (one dictionary-encoded message repeated) stand for a million
    messages; decoding them is 1.35 GB of Python objects, rendering them hours."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    def column(messages: list[tuple[str, str]], repeat: int = 1) -> pa.Array:
        roles = pa.array([r for r, _ in messages] * repeat).dictionary_encode()
        texts = pa.array([t for _, t in messages] * repeat).dictionary_encode()
        structs = pa.StructArray.from_arrays([roles, texts], names=["role", "content"])
        return pa.ListArray.from_arrays(pa.array([0, len(structs)], pa.int32()), structs)

    good = column([("user", "the ring"), ("assistant", "a rank")])
    million = column([("user", "a"), ("assistant", "b")], repeat=500_000)
    src = tmp_path / "src" / "a.parquet"
    src.parent.mkdir()
    pq.write_table(pa.concat_tables([pa.table({"messages": c}) for c in (good, million, good)]), src, compression="zstd")
    assert src.stat().st_size < 16_000

    out = tmp_path / "out"
    started = time.monotonic()
    code, err, peak = prepare_in_child(
        [str(src.parent), "--tokenizer", str(chatml), "--out", str(out), "--format", "chat", "--on-bad-record", "skip"], tmp_path
    )
    assert code == 0, err
    assert skipped(out) == [(2, "1,000,000 messages, over the 1,024-message limit (--max-messages)")]
    assert time.monotonic() - started < 60 and peak < PEAK_BOUND, (time.monotonic() - started, peak)


def test_a_template_looping_past_the_render_timeout_is_a_bad_record(
    serial: None, chatml: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A template cubic in the messages: 10^9 loop steps for a 1,000-message record."""
    tok = with_template(chatml, tmp_path / "tok", CUBIC)
    src = jsonl(tmp_path / "src" / "a.jsonl", GOOD, turns(1000), GOOD)
    out = tmp_path / "out"
    args = [str(src), "--tokenizer", str(tok), "--out", str(out), "--on-bad-record", "skip", "--render-timeout", "1"]
    code, _, err, seconds = prepare(args, capsys)
    assert code == 0, err
    assert skipped(out) == [(2, "rendering it took over 1 s (--render-timeout)")]
    assert Manifest.load(out).num_documents == 2 and seconds < 15


def test_a_template_doubling_a_string_is_stopped_at_its_memory_budget(chatml: Path, tmp_path: Path) -> None:
    """A string doubled once a message: 2^40 characters for a 40-message record."""
    tok = with_template(chatml, tmp_path / "tok", DOUBLING)
    src = jsonl(tmp_path / "src" / "a.jsonl", GOOD, turns(40), GOOD)
    out = tmp_path / "out"
    args = [str(src.parent), "--tokenizer", str(tok), "--out", str(out), "--format", "chat", "--on-bad-record", "skip", "--render-memory", "64"]
    code, err, peak = prepare_in_child(args, tmp_path)
    assert code == 0, err
    assert skipped(out) == [(2, "rendering it took over 64 MiB of memory (--render-memory)")]
    assert Manifest.load(out).num_documents == 2 and peak < PEAK_BOUND, peak


def test_a_rendering_over_the_token_limit_is_a_bad_record(serial: None, chatml: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = jsonl(tmp_path / "src" / "a.jsonl", GOOD, turns(2, "the ring " * 8), GOOD)
    out = tmp_path / "out"
    code, _, err, _ = prepare([str(src), "--tokenizer", str(chatml), "--out", str(out), "--on-bad-record", "skip",
                               "--max-record-tokens", "30"], capsys)  # fmt: skip
    assert code == 0, err
    (line, reason), = skipped(out)
    assert line == 2 and reason.startswith("it renders as ") and reason.endswith(" tokens, over the 30-token limit (--max-record-tokens)")
    # Longer still: over 8 characters a token of the limit, refused before it is tokenized.
    jsonl(src, GOOD, turns(2, "x" * 300), GOOD)
    code, _, err, _ = prepare([str(src), "--tokenizer", str(chatml), "--out", str(out), "--overwrite", "--on-bad-record", "skip",
                               "--max-record-tokens", "30"], capsys)  # fmt: skip
    assert code == 0, err
    assert skipped(out) == [(2, "the chat template renders it as 661 characters, over 8 a token of the 30-token limit (--max-record-tokens)")]


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--max-messages", "0"], "--max-messages: must be a positive number, got 0"),
        (["--render-timeout", "nan"], "--render-timeout: must be a positive number, got nan"),
        (["--render-memory", "-1"], "--render-memory: must be a positive number, got -1"),
        (["--format", "text", "--max-record-tokens", "9"], "--max-record-tokens: applies to --format chat and preference only"),
    ],
)
def test_bad_budget_flags_exit_2_naming_them(
    serial: None, chatml: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], expected: str
) -> None:
    src = jsonl(tmp_path / "src" / "a.jsonl", GOOD)
    code, _, err, _ = prepare([str(src), "--tokenizer", str(chatml), "--out", str(tmp_path / "out"), *args], capsys)
    assert (code, err) == (2, f"ringtrain: config error: {expected}\n")


# --- the watchdog ---------------------------------------------------------------------------------


def test_the_watchdog_stops_a_python_loop_and_names_the_budget() -> None:
    watchdog = Watchdog(RenderBudget(timeout_s=0.2), poll_s=0.01)
    started = time.monotonic()
    with pytest.raises(OverBudget):
        with watchdog.watch():
            while True:
                pass
    assert time.monotonic() - started < 2 and watchdog.reason == "rendering it took over 0.2 s (--render-timeout)"
    with watchdog.watch():  # the next record starts afresh
        pass


def test_a_watchdog_watches_only_its_own_renders() -> None:
    """A render that ends in time leaves nothing behind: no exception arrives later, in whatever
    the thread does next, and the watchdog of another thread's renders never fires in this one."""
    watchdog = Watchdog(RenderBudget(timeout_s=0.05), poll_s=0.01)
    for _ in range(20):
        with watchdog.watch():
            sum(range(1000))
    deadline = time.monotonic() + 0.3
    while time.monotonic() < deadline:  # Python code running past the budget, outside any render
        pass
    other = Watchdog(RenderBudget(timeout_s=0.05), poll_s=0.01)
    caught: list[BaseException] = []

    def render_elsewhere() -> None:
        try:
            with other.watch():
                while True:
                    pass
        except OverBudget as exc:
            caught.append(exc)

    thread = threading.Thread(target=render_elsewhere)
    thread.start()
    thread.join(5)
    assert not thread.is_alive() and len(caught) == 1
