"""`ringtrain prepare` on bad input: exit 2, one line naming the file and line or the flag, nothing
written. Run in this process with the actors' code called in order (the ``serial`` fixture): what
is asserted here is the driver's handling, the same on Ray (test_prepare_ray.py sends a bad line
through a real cluster). One case goes through the real command line, as users run it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from ringtrain.prepared import Manifest
from ringtrain_dev.cli_runs import ringtrain_cli
from ringtrain_dev.corpus import write_jsonl
from tests.prepare.prepare_cli import files_of
from tests.prepare.prepare_cli import prepare as prepare_quietly


def prepare(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    return prepare_quietly(["--parallelism", "1", *args], capsys)


@pytest.mark.parametrize("mode", ["fail", "skip"])
def test_a_malformed_line_fails_or_is_counted(serial: None, tmp_path: Path, capsys: pytest.CaptureFixture[str], mode: str) -> None:
    src = tmp_path / "src"
    write_jsonl(src / "a.jsonl", [{"text": "first"}, {"text": "second"}])
    (src / "b.jsonl").write_text('{"text": "ok"}\n{"text": "cut\n{"body": "no text"}\n{"text": "last"}\n')
    out = tmp_path / "out"
    code, stdout, err = prepare([str(src), "--tokenizer", "bytes", "--out", str(out), "--on-bad-record", mode], capsys)
    if mode == "fail":
        assert (code, err) == (2, f"ringtrain: data error: {src / 'b.jsonl'}:2: malformed JSON (Unterminated string starting at: line 1 column 10 (char 9))\n")
        assert not out.exists() and list(tmp_path.iterdir()) == [src]
        return
    assert code == 0, err
    manifest = Manifest.load(out)
    assert (manifest.num_documents, manifest.num_skipped) == (4, 2)
    assert [(Path(s.uri).name, s.line) for s in manifest.skipped] == [("b.jsonl", 2), ("b.jsonl", 3)]
    assert "no field 'text'" in manifest.skipped[1].reason and "2 records skipped" in stdout


def _bad_inputs(tmp: Path, corpus: Path, tokenizer: Path) -> dict[str, tuple[list[str], str]]:
    """name -> (arguments, the one line expected on stderr)."""
    (tmp / "empty").mkdir()
    (tmp / "empty" / "e.jsonl").write_text("\n")
    write_jsonl(tmp / "field" / "f.jsonl", [{"text": "a"}, {"content": "b"}])
    good = write_jsonl(tmp / "gz" / "c.jsonl.gz", [{"text": f"doc {i}"} for i in range(3000)]).read_bytes()
    (tmp / "gz" / "c.jsonl.gz").write_bytes(good[: len(good) // 2])
    good = write_jsonl(tmp / "zst" / "c.jsonl.zst", [{"text": f"doc {i}"} for i in range(3000)]).read_bytes()
    (tmp / "zst" / "c.jsonl.zst").write_bytes(good[:100] + b"\0" * 16 + good[116:])
    (tmp / "taken").mkdir()
    (tmp / "taken" / "x").write_text("x")
    # A corpus folder (and a tokenizer folder) from elsewhere whose file links out of it: the
    # environment, or credentials, would be tokenized into the dataset.
    secret = write_jsonl(tmp / "secret.jsonl", [{"text": "AWS_SECRET_ACCESS_KEY=not-for-the-dataset"}])
    write_jsonl(tmp / "linked" / "a.jsonl", [{"text": "a"}])
    (tmp / "linked" / "b.jsonl").symlink_to(secret)
    (tmp / "linked-dir").mkdir()
    (tmp / "linked-dir" / "more").symlink_to(tmp / "linked")
    shutil.copytree(tokenizer, tmp / "tok")
    (tmp / "tok" / "merges.txt").symlink_to("/proc/self/environ")
    shutil.copytree(tokenizer, tmp / "tok-file")
    (tmp / "tok-file" / "chat_template.jinja").symlink_to(secret)
    link_refused = "leads through a link to {}, outside {}: a file of the folder is read only where it lies inside it"
    return {
        "empty": ([str(tmp / "empty")], f"ringtrain: data error: {tmp / 'empty'}: no documents (every record was empty or skipped)"),
        "field": ([str(tmp / "field")], f"ringtrain: data error: {tmp / 'field' / 'f.jsonl'}:2: no field 'text' (--text-field)"),
        "gz": ([str(tmp / "gz")], f"ringtrain: data error: {tmp / 'gz' / 'c.jsonl.gz'}: corrupt compressed data after line "),
        "zst": ([str(tmp / "zst")], f"ringtrain: data error: {tmp / 'zst' / 'c.jsonl.zst'}: corrupt compressed data after line "),
        "tokenizer": ([str(corpus), "--tokenizer", str(tmp / "no-such-tokenizer")],
                      f"ringtrain: config error: --tokenizer: {tmp / 'no-such-tokenizer'} does not exist"),
        "exists": ([str(corpus), "--out", str(tmp / "taken")],
                   f"ringtrain: config error: --out: {tmp / 'taken'} already exists; pass --overwrite to replace it"),
        "link-in-folder": ([str(tmp / "linked")], f"ringtrain: config error: SRC: {tmp / 'linked' / 'b.jsonl'} "
                           + link_refused.format(secret, tmp / "linked")),
        "link-in-glob": ([str(tmp / "linked" / "*.jsonl")], f"ringtrain: config error: SRC: {tmp / 'linked' / 'b.jsonl'} "
                         + link_refused.format(secret, tmp / "linked")),
        "folder-link-in-glob": ([str(tmp / "linked-dir" / "**" / "*.jsonl")], f"ringtrain: config error: SRC: "
                                f"{tmp / 'linked-dir' / 'more' / 'a.jsonl'} "
                                + link_refused.format(tmp / "linked" / "a.jsonl", tmp / "linked-dir")),
        "link-in-tokenizer": ([str(corpus), "--tokenizer", str(tmp / "tok")], f"ringtrain: config error: --tokenizer: "
                              f"{tmp / 'tok' / 'merges.txt'} leads through a link to /proc/"),
        "link-beside-tokenizer-file": ([str(corpus), "--tokenizer", str(tmp / "tok-file" / "tokenizer.json")],
                                       f"ringtrain: config error: --tokenizer: {tmp / 'tok-file' / 'chat_template.jinja'} "
                                       + link_refused.format(secret, tmp / "tok-file")),
    }


def _with_defaults(args: list[str], tmp_path: Path) -> list[str]:
    if "--tokenizer" not in args:
        args += ["--tokenizer", "bytes"]
    if "--out" not in args:
        args += ["--out", str(tmp_path / "out")]
    return args


@pytest.mark.parametrize(
    "case",
    [
        "empty", "field", "gz", "zst", "tokenizer", "exists",
        "link-in-folder", "link-in-glob", "folder-link-in-glob", "link-in-tokenizer", "link-beside-tokenizer-file",
    ],  # fmt: skip
)
def test_bad_input_exits_2_with_one_line_and_writes_nothing(
    serial: None, corpus: Path, tokenizer: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str
) -> None:
    args, expected = _bad_inputs(tmp_path, corpus, tokenizer)[case]
    before = sorted(p.name for p in tmp_path.iterdir())
    code, _, err = prepare(_with_defaults(args, tmp_path), capsys)
    assert code == 2 and err.startswith(expected) and err.count("\n") == 1, err
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no output, no staging left behind
    assert not list(tmp_path.rglob("manifest.json"))


def test_the_command_line_exits_2_with_one_line_and_no_traceback(corpus: Path, tokenizer: Path, tmp_path: Path) -> None:
    """End to end as users run it: a fresh process, exit status, stderr (found before Ray starts)."""
    args, expected = _bad_inputs(tmp_path, corpus, tokenizer)["tokenizer"]
    before = sorted(p.name for p in tmp_path.iterdir())
    result = ringtrain_cli(["prepare", *_with_defaults(args, tmp_path)], home=tmp_path, ray_tmp=tmp_path, timeout=120)
    assert result.returncode == 2 and result.stderr.startswith(expected) and result.stderr.count("\n") == 1, result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def big_jsonl(path: Path, num_lines: int, bad: dict[int, str]) -> Path:
    """``num_lines`` lines of JSONL; line n (1-based) replaced by ``bad[n]`` where given."""
    lines = [bad.get(n, json.dumps({"text": f"document {n} " + "x" * (n % 37)})) for n in range(1, num_lines + 1)]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path


BAD_LINE = 871  # in a late range: split at 2000 bytes, about 40 lines to a range


@pytest.mark.parametrize("mode", ["fail", "skip"])
def test_a_split_file_matches_the_whole_file_and_names_true_lines(
    serial: None, tmp_path: Path, capsys: pytest.CaptureFixture[str], mode: str
) -> None:
    src = big_jsonl(tmp_path / "src" / "big.jsonl", 1000, {BAD_LINE: '{"text": oops', 950: "", 951: '{"body": 1}'})
    assert src.stat().st_size > 20 * 2000
    out = tmp_path / "out"
    flags = ["--tokenizer", "bytes", "--on-bad-record", mode, "--shard-tokens", "5000", "--out", str(out)]
    code, _, err = prepare([str(src), *flags, "--split-bytes", "2000"], capsys)
    if mode == "fail":
        assert code == 2 and err.startswith(f"ringtrain: data error: {src}:{BAD_LINE}: malformed JSON") and err.count("\n") == 1, err
        assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]
        return
    assert code == 0, err
    split = files_of(out)
    code, _, err = prepare([str(src), *flags, "--overwrite"], capsys)  # one piece: the default split is 64 MiB
    assert code == 0, err
    assert files_of(out) == split and len(split) > 3  # several shards, byte for byte
    manifest = Manifest.load(out)
    assert [(s.line, s.reason.split(" (")[0]) for s in manifest.skipped] == [(BAD_LINE, "malformed JSON"), (951, "no field 'text'")]
    assert (manifest.num_documents, manifest.num_skipped) == (997, 2)
