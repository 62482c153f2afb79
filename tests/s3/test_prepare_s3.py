"""`ringtrain prepare` from an s3:// prefix to an s3:// prefix on the moto server, and training from it.

Run in this process without a Ray cluster (tests/prepare/serial.py): what is tested here is S3
(listing, ranged and whole-object reads, staging, publishing), and the actors' code reads the
objects exactly as on Ray; tests/prepare/test_prepare_ray.py covers the Ray transport.
"""

from __future__ import annotations

import hashlib
import io
import json
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ringtrain import cli
from ringtrain.prepared import Manifest
from ringtrain_dev.corpus import build_corpus, save_tokenizer
from ringtrain_dev.ranks import gloo_rank, run_ranks
from ringtrain_dev.tiny import TINY_MODEL
from tests.prepare.serial import run_serially


@pytest.fixture
def serial_on_s3(s3_endpoint: str, aws_env: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """`ringtrain prepare` runs in this process (tests/prepare/serial.py), its S3 calls going to
    the moto server (set after ``aws_env``, which clears every AWS setting)."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint)
    run_serially(monkeypatch)


def test_prepare_reads_and_writes_s3(
    serial_on_s3: None, s3_client: Any, bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    files = build_corpus(tmp_path / "corpus", num_modules=12, num_files=4)  # .jsonl, .gz, .parquet, .zst
    for path in files:
        s3_client.upload_file(str(path), bucket, f"corpus/{path.name}")
    s3_client.put_object(Bucket=bucket, Key="corpus-other/ignored.jsonl", Body=b'{"text": "not under corpus/"}\n')
    tokenizer = save_tokenizer(tmp_path / "tok", num_modules=12, vocab_size=512)
    out = f"s3://{bucket}/datasets/stdlib"
    # Plain JSONL in 16 KB ranges (ranged GETs), Parquet downloaded (read at random), .gz/.zst
    # streamed through one GET each, never downloaded whole.
    from ringtrain.prepare import pipeline

    downloaded: list[str] = []
    fetch = pipeline.fetch
    monkeypatch.setattr(pipeline, "fetch", lambda uri, folder: downloaded.append(uri) or fetch(uri, folder))
    code = cli.main(["prepare", f"s3://{bucket}/corpus", "--tokenizer", str(tokenizer), "--out", out,
                     "--shard-tokens", "30000", "--split-bytes", "16000", "--parallelism", "1"])
    stdout, stderr = capsys.readouterr()
    assert code == 0, stderr[-3000:]
    assert "into " in stdout and "M tokens/s" in stdout
    assert downloaded == [f"s3://{bucket}/corpus/{p.name}" for p in sorted(files) if p.suffix == ".parquet"]

    keys = sorted(o["Key"] for o in s3_client.list_objects_v2(Bucket=bucket)["Contents"])
    published = [k for k in keys if k.startswith("datasets/")]
    assert not [k for k in published if ".partial-" in k]  # the staging prefix is gone
    body = s3_client.get_object(Bucket=bucket, Key="datasets/stdlib/manifest.json")["Body"].read()
    manifest = Manifest.loads(body, f"{out}/manifest.json")
    assert [s.uri for s in manifest.sources] == [f"s3://{bucket}/corpus/{p.name}" for p in sorted(files)]
    expected = [_num_records(p) for p in sorted(files)]  # every line of the ranged file read once
    assert [s.num_documents for s in manifest.sources] == expected and files[0].stat().st_size > 3 * 16000
    assert len(manifest.shards) > 1 and len(published) == 1 + 2 * len(manifest.shards)
    for shard in manifest.shards:
        data = {k: s3_client.get_object(Bucket=bucket, Key=f"datasets/stdlib/{getattr(shard, k)}")["Body"].read()
                for k in ("tokens", "docs")}
        assert hashlib.sha256(data["tokens"]).hexdigest() == shard.tokens_sha256
        assert hashlib.sha256(data["docs"]).hexdigest() == shard.docs_sha256
        tokens, offsets = np.load(io.BytesIO(data["tokens"])), np.load(io.BytesIO(data["docs"]))
        assert offsets[-1] == tokens.size and (tokens[offsets[1:] - 1] == manifest.tokenizer.eos_id).all()

    # An existing s3 output is refused before any cluster starts.
    code = cli.main(["prepare", str(files[0]), "--tokenizer", "bytes", "--out", out])
    assert code == 2 and capsys.readouterr().err == f"ringtrain: config error: --out: {out} already exists; pass --overwrite to replace it\n"


def _num_records(path: Path) -> int:
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return int(pq.ParquetFile(path).metadata.num_rows)
    data = path.read_bytes()
    if path.suffix == ".gz":
        data = zlib.decompress(data, wbits=31)
    elif path.suffix == ".zst":
        import zstandard

        data = zstandard.ZstdDecompressor().decompressobj().decompress(data)
    return sum(1 for line in data.splitlines() if json.loads(line)["text"])


def _train_from_s3(rank: int, world: int, store: str, overrides: list[str], results: Any) -> None:
    from ringtrain import config
    from ringtrain.train.trainer import Trainer

    with gloo_rank(rank, world, store, results):
        import torch

        trainer = Trainer(config.load(None, overrides), rank=rank, device=torch.device("cpu"))
        losses = [trainer.train_step().loss for _ in range(2)]  # the process group is gloo_rank's to end
        if rank == 0:
            results.put(losses)


def test_training_reads_a_dataset_prepared_to_s3(
    serial_on_s3: None, s3_client: Any, bucket: str, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The round trip: prepared to s3://, then checked and read as ``ringtrain run`` does (shards
    fetched into the node's cache and verified) and trained on for two steps by a real rank; and
    scored as ``ringtrain eval --data`` reads it, window for window as the local copy."""
    from ringtrain import config
    from ringtrain.cachedir import CACHE_ENV
    from ringtrain.train.evalset import load_eval_set
    from ringtrain.train.mixture import check_sources, open_samples

    files = build_corpus(tmp_path / "corpus", num_modules=6, num_files=2)
    for path in files:
        s3_client.upload_file(str(path), bucket, f"corpus/{path.name}")
    out, local = f"s3://{bucket}/datasets/small", tmp_path / "local"
    for src, dst in ((f"s3://{bucket}/corpus", out), (str(tmp_path / "corpus"), str(local))):
        assert cli.main(["prepare", src, "--tokenizer", "bytes", "--out", dst, "--shard-tokens", "20000", "--parallelism", "1",
                         "--quiet"]) == 0
    capsys.readouterr()

    overrides = [f"data.path={out}", f"data.cache_dir={tmp_path / 'cache'}", "data.seq_len=64", "data.packing=doc",
                 "train.global_batch=2", "train.steps=2", "train.warmup_steps=1", "checkpoint.snapshot_every=0", *TINY_MODEL]
    job = config.load(None, overrides)
    check_sources(job)  # ringtrain run's check: manifest, tokenizer, vocabulary
    remote = open_samples(job)
    mirror = open_samples(config.load(None, [*overrides[:1], f"data.path={local}", *overrides[2:]]))
    try:
        for sample in range(0, 40, 3):  # the same windows, tokens and documents as the local copy
            a, b = remote.sample(sample), mirror.sample(sample)
            assert (a.tokens == b.tokens).all() and (a.doc_ids == b.doc_ids).all() and a.origin == b.origin
    finally:
        remote.close()
        mirror.close()
    assert any((tmp_path / "cache").rglob("*.tokens.npy"))  # fetched into this node's cache
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "eval-cache"))
    scored, mirrored = (load_eval_set(uri, seq_len=64, vocab_size=512, max_rows=6, key="--data") for uri in (out, str(local)))
    assert (scored.inputs == mirrored.inputs).all() and (scored.labels == mirrored.labels).all() and scored.num_rows == 6

    losses = run_ranks(_train_from_s3, 1, tmp_path, overrides, timeout=180)
    assert len(losses) == 2 and all(np.isfinite(losses))


def test_overwrite_replaces_only_a_dataset_prepare_wrote_on_s3(
    serial_on_s3: None, s3_client: Any, bucket: str, tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    src = tmp_path / "a.jsonl"
    src.write_text("".join(json.dumps({"text": f"document {i}"}) + "\n" for i in range(10)))
    args = ["prepare", str(src), "--tokenizer", "bytes", "--quiet", "--parallelism", "1", "--overwrite"]

    def objects(prefix: str) -> dict[str, bytes]:
        listed = s3_client.list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", [])
        return {o["Key"]: s3_client.get_object(Bucket=bucket, Key=o["Key"])["Body"].read() for o in listed}

    # A prefix of someone else's objects: refused, untouched.
    s3_client.put_object(Bucket=bucket, Key="backups/db.dump", Body=b"precious")
    before = objects("backups/")
    assert cli.main([*args, "--out", f"s3://{bucket}/backups"]) == 2
    err = capsys.readouterr().err
    assert err == (f"ringtrain: config error: --out: s3://{bucket}/backups holds no manifest.json of a prepared dataset: "
                   "--overwrite replaces only a dataset `ringtrain prepare` wrote; choose a new or empty --out\n")
    assert objects("backups/") == before
    assert not [k for k in objects("") if ".partial-" in k]

    # A dataset of ours is replaced; the same with an object of the user's beside it is not.
    out = f"s3://{bucket}/ds"
    assert cli.main([*args, "--out", out]) == 0, capsys.readouterr().err
    assert cli.main([*args, "--out", out]) == 0, capsys.readouterr().err
    s3_client.put_object(Bucket=bucket, Key="ds/notes.txt", Body=b"mine")
    before = objects("ds/")
    assert cli.main([*args, "--out", out]) == 2
    assert f"--out: {out} holds notes.txt, which its manifest does not list" in capsys.readouterr().err
    assert objects("ds/") == before


def test_what_appears_under_the_prefix_while_preparing_is_judged_again_before_the_copy(
    serial_on_s3: None, s3_client: Any, bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """S3 has no rename: the prefix is judged again just before the dataset is copied in. An
    object written there meanwhile stops the publish (exit 2, naming --out and where the
    prepared dataset is kept, manifest and all) and is left as it is."""
    from ringtrain.prepare import writer

    src = tmp_path / "a.jsonl"
    src.write_text("".join(json.dumps({"text": f"document {i}"}) + "\n" for i in range(10)))
    shard_written = writer.S3Output.shard_written

    def someone_writes(self: Any, info: Any) -> None:
        s3_client.put_object(Bucket=bucket, Key=f"{self.prefix}/notes.txt", Body=b"mine")
        shard_written(self, info)

    monkeypatch.setattr(writer.S3Output, "shard_written", someone_writes)
    for name, flags, why in (("new", [], "appeared while preparing; pass --overwrite to replace it"),
                             ("over", ["--overwrite"], "holds no manifest.json of a prepared dataset")):
        out = f"s3://{bucket}/{name}"
        code = cli.main(["prepare", str(src), "--tokenizer", "bytes", "--quiet", "--parallelism", "1", "--out", out, *flags])
        err = capsys.readouterr().err
        assert code == 2 and f"--out: {out} {why}" in err, err
        staged = err.split("the prepared dataset is kept at ")[1].strip()
        assert staged.startswith(f"{out}.partial-")
        listed = s3_client.list_objects_v2(Bucket=bucket, Prefix=f"{name}/")["Contents"]
        assert [o["Key"] for o in listed] == [f"{name}/notes.txt"]  # untouched, nothing copied beside it
        key = staged.removeprefix(f"s3://{bucket}/") + "/manifest.json"
        manifest = Manifest.loads(s3_client.get_object(Bucket=bucket, Key=key)["Body"].read(), staged)
        assert manifest.num_documents == 10
