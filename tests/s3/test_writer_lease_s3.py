"""One writer per checkpoint store on S3 (a moto server): the writer lease through S3's conditional
writes (If-None-Match, If-Match), and `ringtrain run` refusing a second writer and a store holding
another run's steps, before any cluster starts."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ringtrain import cli
from ringtrain.checkpoint import open_store
from ringtrain.checkpoint.lease import LEASE_KEY, Holder, WriterLease
from tests.lease_checks import CHECKS

pytestmark = pytest.mark.slow

QUICKSTART = Path(__file__).resolve().parents[2] / "jobs" / "quickstart.yaml"


def objects(client: Any, bucket: str, prefix: str) -> dict[str, bytes]:
    listed = client.list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", [])
    return {o["Key"]: client.get_object(Bucket=bucket, Key=o["Key"])["Body"].read() for o in listed}


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
def test_the_writer_lease_on_s3(check: Callable[..., None], bucket: str, s3_endpoint: str) -> None:
    check(lambda: open_store(f"s3://{bucket}/runs/shared", endpoint_url=s3_endpoint))


def test_the_conditions_reach_s3(bucket: str, s3_endpoint: str, s3_client: Any) -> None:
    """A lease written by hand under the key is live for the store: S3 refuses a create over it."""
    backend = open_store(f"s3://{bucket}/runs/x", endpoint_url=s3_endpoint).backend
    assert backend.put_if(LEASE_KEY, b"first", None) is not None
    assert backend.put_if(LEASE_KEY, b"second", None) is None  # If-None-Match: *
    data, version = backend.get_versioned(LEASE_KEY)
    assert data == b"first"
    assert backend.put_if(LEASE_KEY, b"third", '"not-the-etag"') is None  # If-Match
    assert backend.put_if(LEASE_KEY, b"third", version) is not None
    assert not backend.delete_if(LEASE_KEY, version)  # that version is gone
    assert s3_client.get_object(Bucket=bucket, Key=f"runs/x/{LEASE_KEY}")["Body"].read() == b"third"


@pytest.fixture
def on_s3(s3_endpoint: str, aws_env: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint)
    monkeypatch.setenv("HOME", str(tmp_path))


def test_a_second_writer_on_a_live_s3_store_exits_2(
    on_s3: None, bucket: str, s3_client: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    uri = f"s3://{bucket}/runs/live"
    holder = WriterLease(open_store(uri).backend, Holder("id-1", "first", "/runs/first", "node-a", 7), 600)
    holder.acquire()
    before = objects(s3_client, bucket, "runs/")
    code = cli.main(["run", str(QUICKSTART), f"checkpoint.uri={uri}", f"run_dir={tmp_path / 'run'}", "checkpoint.resume=auto"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith(f"ringtrain: config error: checkpoint.uri: {uri} is being written by run 'first' (pid 7 on node-a"), err
    assert err.count("\n") == 1
    assert objects(s3_client, bucket, "runs/") == before
    holder.check()


def test_resume_none_on_an_s3_store_of_another_run_exits_2(
    on_s3: None, bucket: str, s3_client: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    uri = f"s3://{bucket}/runs/other"
    open_store(uri).save(5, {"rank-00000": b"their state"}, {"step": 5})
    before = objects(s3_client, bucket, "runs/")
    code = cli.main(["run", str(QUICKSTART), f"checkpoint.uri={uri}", f"run_dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err == (f"ringtrain: config error: checkpoint.uri: {uri} holds another run's checkpoints (steps 5), which "
                   "checkpoint.resume=none would replace and delete: resume that run (checkpoint.resume=auto), or give "
                   "this run another checkpoint.uri\n")
    assert objects(s3_client, bucket, "runs/") == before  # the lease taken for the check is gone again
