"""`ringtrain prepare` end to end on Ray: output format, determinism across parallelism and split size.

One in-process Ray cluster serves the module (prepare borrows a connection it finds): the
reference run at parallelism 1 with whole files, the same corpus at parallelism 2 cut into many
pieces, and a bad line in a late piece, through real actors; and a small corpus tokenized in a
fresh process that starts no cluster, to the same bytes. Bad input and the command line's exit
status are in test_bad_input.py (no cluster needed to check them).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from ringtrain import cli
from ringtrain.prepared import Manifest
from ringtrain_dev.corpus import write_jsonl
from tests.prepare.prepare_cli import files_of

ray = pytest.importorskip("ray")

REPO = Path(__file__).resolve().parents[2]


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


def test_bytes_are_the_same_at_parallelism_1_and_2_and_any_split(
    prepared: Path, corpus: Path, tokenizer: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two actors, the plain JSONL in 16 KB ranges and the Parquet in row groups, rewrite the same
    output in place: the same bytes as one actor reading whole files."""
    from ringtrain.prepare import sources

    copy = tmp_path / "ds"
    shutil.copytree(prepared, copy)
    first = files_of(copy)
    files = sources.expand([str(corpus)])
    pieces = sources.plan(files, 16000)
    per_file = [sum(p.source.index == f.index for p in pieces) for f in files]
    assert per_file[:2] == [21, 1] and per_file[2] > 1  # plain jsonl in ranges, .gz whole, Parquet's 4 row groups in runs
    code, out, err = cli.main(["prepare", str(corpus), "--tokenizer", str(tokenizer), "--out", str(prepared), "--shard-tokens", SHARD_TOKENS,
                               "--parallelism", "2", "--split-bytes", "16000", "--overwrite", "--quiet"]), *capsys.readouterr()
    assert code == 0, err
    assert "M tokens/s" in out and "into 4 shards" in out
    assert files_of(prepared) == first


def test_a_small_local_corpus_is_tokenized_in_this_process_to_the_same_bytes(prepared: Path, corpus: Path, tokenizer: Path, tmp_path: Path) -> None:
    """Without --parallelism or --num-cpus, a local corpus of --split-bytes (64 MiB) or less
    starts no cluster: a fresh `ringtrain prepare` rewrites the dataset in place with nothing
    under its RAY_TMPDIR, to the same bytes as the cluster's actors wrote."""
    first = files_of(prepared)
    ray_tmp = tmp_path / "ray"
    ray_tmp.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(RAY_TMPDIR=str(ray_tmp), PYTHONPATH=os.pathsep.join([str(REPO / "platform"), env.get("PYTHONPATH", "")]))
    done = subprocess.run(
        [sys.executable, "-m", "ringtrain", "prepare", str(corpus), "--tokenizer", str(tokenizer), "--out", str(prepared),
         "--shard-tokens", SHARD_TOKENS, "--overwrite", "--quiet"],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "in this process" in done.stdout and "into 4 shards" in done.stdout
    assert list(ray_tmp.iterdir()) == [], "no cluster started"
    assert files_of(prepared) == first


def test_a_bad_line_in_a_late_piece_names_its_true_line(cluster: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "src"
    write_jsonl(src / "a.jsonl", [{"text": "first"}, {"text": "second"}])
    lines = [json.dumps({"text": f"document {n}"}) for n in range(1, 301)]
    lines[256] = '{"text": "cut'  # line 257, in the last of 5 ranges
    (src / "b.jsonl").write_text("\n".join(lines) + "\n")
    out = tmp_path / "out"
    code = cli.main(["prepare", str(src), "--tokenizer", "bytes", "--out", str(out), "--parallelism", "2", "--split-bytes", "1500", "--quiet"])
    err = capsys.readouterr().err
    assert (code, err) == (2, f"ringtrain: data error: {src / 'b.jsonl'}:257: malformed JSON (Unterminated string starting at: line 1 column 10 (char 9))\n")
    assert not out.exists() and list(tmp_path.iterdir()) == [src]
