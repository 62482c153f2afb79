"""`ringtrain prepare` end to end on Ray: output format, determinism across parallelism, bad input.

One in-process Ray cluster serves the module (prepare borrows a connection it finds), and one
run goes through the real command line with its own embedded cluster: the path users take, and
the other parallelism the determinism check compares against.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from ringtrain import cli
from ringtrain.prepared import Manifest
from tests.corpus import write_jsonl
from tests.ray.test_run_e2e import ringtrain_cli

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def cluster() -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in ("RAY_AUTH_MODE", "RAY_ADDRESS")}
    os.environ["RAY_AUTH_MODE"] = "disabled"
    os.environ.pop("RAY_ADDRESS", None)
    temp_dir = tempfile.mkdtemp(prefix="rtp-", dir="/tmp")  # short: Ray's socket paths live below it
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, _temp_dir=temp_dir)
    try:
        yield
    finally:
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def prepare(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = cli.main(["prepare", "--quiet", *args])
    out, err = capsys.readouterr()
    return code, out, err


def files_of(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


SHARD_TOKENS = "60000"  # the 210K-token corpus makes four shards: boundaries are exercised


@pytest.fixture(scope="module")
def prepared(cluster: None, corpus: Path, tokenizer: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("prepared") / "ds"
    code = cli.main(["prepare", str(corpus), "--tokenizer", str(tokenizer), "--out", str(out),
                     "--shard-tokens", SHARD_TOKENS, "--parallelism", "1", "--quiet"])
    assert code == 0
    return out


def test_the_dataset_holds_every_document_in_order(prepared: Path, corpus: Path, tokenizer: Path) -> None:
    from tokenizers import Tokenizer

    manifest = Manifest.load(prepared)
    assert manifest.dtype == "uint16" and manifest.tokenizer.eos_id == 2 and len(manifest.shards) >= 3
    assert [Path(s.uri).name for s in manifest.sources] == ["part-000.jsonl", "part-001.jsonl.gz", "part-002.parquet"]
    tok = Tokenizer.from_file(str(tokenizer / "tokenizer.json"))
    docs = []
    for shard in manifest.shards:
        tokens, offsets = np.load(prepared / shard.tokens), np.load(prepared / shard.docs)
        assert offsets[0] == 0 and offsets[-1] == tokens.size == shard.num_tokens
        assert (tokens[offsets[1:] - 1] == 2).all()  # each document ends with EOS
        docs += [tokens[a : b - 1].tolist() for a, b in zip(offsets[:-1], offsets[1:])]
    texts = [json.loads(line)["text"] for line in (corpus / "part-000.jsonl").read_text().splitlines()]
    assert len(docs) == manifest.num_documents and docs[: len(texts)] == [tok.encode(t, add_special_tokens=False).ids for t in texts]
    assert not [p for p in prepared.parent.iterdir() if p.name.startswith(".")]  # no staging left


def test_bytes_are_the_same_at_parallelism_1_and_2(prepared: Path, corpus: Path, tokenizer: Path, tmp_path: Path) -> None:
    """The command line (its own embedded cluster, 2 actors) rewrites the same output in place."""
    copy = tmp_path / "ds"
    shutil.copytree(prepared, copy)
    first = files_of(copy)
    ray_tmp = Path(tempfile.mkdtemp(prefix="rtq-", dir="/tmp"))
    try:
        result = ringtrain_cli(["prepare", str(corpus), "--tokenizer", str(tokenizer), "--out", str(prepared),
                                "--shard-tokens", SHARD_TOKENS, "--parallelism", "2", "--num-cpus", "2", "--overwrite"],
                               home=tmp_path, ray_tmp=ray_tmp, timeout=180)
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "M tokens/s" in result.stdout and "into 4 shards" in result.stdout
    assert files_of(prepared) == first


@pytest.mark.parametrize("mode", ["fail", "skip"])
def test_a_malformed_line_fails_or_is_counted(cluster: None, tmp_path: Path, capsys: pytest.CaptureFixture[str], mode: str) -> None:
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


def _bad_inputs(tmp: Path, corpus: Path) -> dict[str, tuple[list[str], str]]:
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
    return {
        "empty": ([str(tmp / "empty")], f"ringtrain: data error: {tmp / 'empty'}: no documents (every record was empty or skipped)"),
        "field": ([str(tmp / "field")], f"ringtrain: data error: {tmp / 'field' / 'f.jsonl'}:2: no field 'text' (--text-field)"),
        "gz": ([str(tmp / "gz")], f"ringtrain: data error: {tmp / 'gz' / 'c.jsonl.gz'}: corrupt compressed data after line "),
        "zst": ([str(tmp / "zst")], f"ringtrain: data error: {tmp / 'zst' / 'c.jsonl.zst'}: corrupt compressed data after line "),
        "tokenizer": ([str(corpus), "--tokenizer", str(tmp / "no-such-tokenizer")],
                      f"ringtrain: config error: --tokenizer: {tmp / 'no-such-tokenizer'} does not exist"),
        "exists": ([str(corpus), "--out", str(tmp / "taken")],
                   f"ringtrain: config error: --out: {tmp / 'taken'} already exists; pass --overwrite to replace it"),
    }


@pytest.mark.parametrize("case", ["empty", "field", "gz", "zst", "tokenizer", "exists"])
def test_bad_input_exits_2_with_one_line_and_writes_nothing(
    cluster: None, corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str
) -> None:
    args, expected = _bad_inputs(tmp_path, corpus)[case]
    if "--tokenizer" not in args:
        args += ["--tokenizer", "bytes"]
    if "--out" not in args:
        args += ["--out", str(tmp_path / "out")]
    before = sorted(p.name for p in tmp_path.iterdir())
    code, _, err = prepare(args, capsys)
    assert code == 2 and err.startswith(expected) and err.count("\n") == 1, err
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no output, no staging left behind
    assert not list(tmp_path.rglob("manifest.json"))
