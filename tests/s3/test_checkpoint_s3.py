"""The checkpoint store on S3 (a moto server): multipart, pagination, retention, damage, retries."""

from __future__ import annotations

import logging
import os
import pickle
from collections.abc import Callable, Mapping
from typing import Any, Optional

import pytest
from botocore.exceptions import ClientError, EndpointConnectionError

from ringtrain.checkpoint import CheckpointCorrupt, CheckpointStore, S3Options, open_store
from ringtrain.checkpoint.layout import step_dir

pytestmark = pytest.mark.slow

MiB = 1 << 20
META = {"model": {"dim": 64, "layers": 2}}
# The smallest sizes S3 allows, so that a 6 MiB shard goes up in two parts.
SMALL_PARTS = S3Options(multipart_threshold=5 * MiB, multipart_chunksize=5 * MiB, max_concurrency=2)


def shards_of(step: int) -> dict[str, bytes]:
    return {
        "params/layers.0.wq": bytes([step % 256]) * 300,
        "params/layers.1.wk": bytes(range(256)) * 3,
        "optim/rank-0/exp_avg": f"step {step}".encode() * 20,
    }


def store_for(bucket: str, endpoint: str, prefix: str = "runs/r1", **kwargs: Any) -> CheckpointStore:
    return open_store(f"s3://{bucket}/{prefix}", endpoint_url=endpoint, **kwargs)


def keys(client: Any, bucket: str, prefix: str = "") -> list[str]:
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    return sorted(obj["Key"] for page in pages for obj in page.get("Contents", ()))


def check_shape(meta: Mapping[str, Any]) -> Optional[str]:
    return None if meta.get("model") == META["model"] else f"model {meta.get('model')} is not {META['model']}"


def test_multipart_round_trip(bucket: str, s3_endpoint: str, s3_client: Any) -> None:
    big = os.urandom(6 * MiB + 123)
    store = store_for(bucket, s3_endpoint, s3_options=SMALL_PARTS)
    ref = store.save(1, {"params/big": big, "small": b"tiny"}, META)
    assert ref.uri == f"s3://{bucket}/runs/r1/{step_dir(1)}" and ref.num_bytes == len(big) + 4
    # An S3 ETag ends in -<parts> exactly when the object was uploaded in parts.
    etag = s3_client.head_object(Bucket=bucket, Key=f"runs/r1/{step_dir(1)}/params/big")["ETag"]
    assert etag.strip('"').endswith("-2")
    assert "-" not in s3_client.head_object(Bucket=bucket, Key=f"runs/r1/{step_dir(1)}/small")["ETag"]
    assert s3_client.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []
    loaded = store.load(1, eager=True)
    assert loaded.meta == META and loaded.shards["params/big"] == big and loaded.shards["small"] == b"tiny"


def test_listing_pages_through_small_pages(bucket: str, s3_endpoint: str) -> None:
    store = store_for(bucket, s3_endpoint, keep=10, s3_options=S3Options(page_size=2))
    for step in (3, 1, 12, 7):
        store.save(step, shards_of(step), META)
    calls: list[str] = []
    store.backend.client.meta.events.register(  # type: ignore[attr-defined]
        "before-call.s3.ListObjectsV2", lambda **_: calls.append("list")
    )
    assert [ref.step for ref in store.list()] == [12, 7, 3, 1]
    # 4 checkpoints x 4 objects, 2 keys a page
    assert len(calls) == 8
    assert [ref.uri for ref in store.list()][0] == f"s3://{bucket}/runs/r1/{step_dir(12)}"


def test_retention_keeps_the_newest_k(bucket: str, s3_endpoint: str, s3_client: Any) -> None:
    store = store_for(bucket, s3_endpoint, keep=2)
    deleted = [store.save(step, shards_of(step), META).deleted_steps for step in (1, 2, 3, 4)]
    assert deleted == [(), (), (1,), (2,)]
    assert [ref.step for ref in store.list()] == [4, 3]
    assert {key.split("/")[2] for key in keys(s3_client, bucket)} == {step_dir(3), step_dir(4)}


def _key(step: int, name: str) -> str:
    return f"runs/r1/{step_dir(step)}/{name}"


def _overwrite(change: Callable[[bytes], bytes], name: str) -> Callable[[Any, str], None]:
    def damage(client: Any, bucket: str) -> None:
        data = client.get_object(Bucket=bucket, Key=_key(3, name))["Body"].read()
        client.put_object(Bucket=bucket, Key=_key(3, name), Body=change(data))

    return damage


def _flip(data: bytes) -> bytes:
    return data[:500] + bytes([data[500] ^ 0x01]) + data[501:]


# case -> (how to damage step 3 through a raw client, or None; what the skip reason says)
DAMAGE: dict[str, tuple[Optional[Callable[[Any, str], None]], str]] = {
    "truncated": (_overwrite(lambda d: d[:100], "params/layers.1.wk"), "truncated: 100 of 768 bytes"),
    "flipped-byte": (_overwrite(_flip, "params/layers.1.wk"), "fails its sha256 checksum"),
    "missing-shard": (
        lambda c, b: c.delete_object(Bucket=b, Key=_key(3, "optim/rank-0/exp_avg")),
        "shard 'optim/rank-0/exp_avg' is missing",
    ),
    "missing-manifest": (lambda c, b: c.delete_object(Bucket=b, Key=_key(3, "manifest.json")), "manifest is missing"),
    "garbage-manifest": (
        lambda c, b: c.put_object(Bucket=b, Key=_key(3, "manifest.json"), Body=b"<html>oops"),
        "manifest is unreadable",
    ),
    "incompatible": (None, "incompatible with this model: model {'dim': 128} is not"),
}


@pytest.mark.parametrize("case", sorted(DAMAGE))
def test_latest_valid_skips_damage_and_names_it(
    bucket: str, s3_endpoint: str, s3_client: Any, case: str, caplog: pytest.LogCaptureFixture
) -> None:
    store = store_for(bucket, s3_endpoint)
    store.save(2, shards_of(2), META)
    store.save(3, shards_of(3), {"model": {"dim": 128}} if case == "incompatible" else META)
    damage, reason = DAMAGE[case]
    if damage is not None:
        damage(s3_client, bucket)
    with caplog.at_level(logging.WARNING, logger="ringtrain.checkpoint"):
        loaded = store.latest_valid(check_shape)
    assert loaded is not None and loaded.step == 2 and dict(loaded.shards) == shards_of(2)
    uri = f"s3://{bucket}/runs/r1/{step_dir(3)}"
    assert [(s.step, s.uri) for s in store.skipped] == [(3, uri)]
    assert reason in store.skipped[0].reason and f"skipping checkpoint {uri}: {store.skipped[0].reason}" in caplog.text


def test_none_valid_returns_none(bucket: str, s3_endpoint: str, s3_client: Any) -> None:
    store = store_for(bucket, s3_endpoint)
    assert store.latest_valid() is None
    store.save(1, shards_of(1), META)
    s3_client.put_object(Bucket=bucket, Key=_key(1, "params/layers.0.wq"), Body=b"x" * 300)
    assert store.latest_valid() is None
    assert "fails its sha256 checksum" in store.skipped[0].reason
    with pytest.raises(CheckpointCorrupt, match="params/layers.0.wq"):
        store.load(1, eager=True)


def test_the_endpoint_comes_from_aws_endpoint_url_alone(
    bucket: str, s3_endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint)
    store = open_store(f"s3://{bucket}")
    store.save(5, {"x": b"5"}, {})
    assert store.backend.client.meta.endpoint_url == s3_endpoint  # type: ignore[attr-defined]
    assert [ref.uri for ref in store.list()] == [f"s3://{bucket}/{step_dir(5)}"]


def test_a_transient_commit_failure_is_retried(bucket: str, s3_endpoint: str) -> None:
    delays: list[float] = []
    store = CheckpointStore(store_for(bucket, s3_endpoint).backend, sleep=delays.append)
    client = store.backend.client  # type: ignore[attr-defined]
    real_put = client.put_object
    failures = [
        ClientError({"Error": {"Code": "SlowDown"}, "ResponseMetadata": {"HTTPStatusCode": 503}}, "PutObject"),
        EndpointConnectionError(endpoint_url=s3_endpoint),
    ]

    def flaky_put(**kwargs: Any) -> Any:
        if kwargs["Key"].endswith("manifest.json") and failures:
            raise failures.pop(0)
        return real_put(**kwargs)

    client.put_object = flaky_put
    store.save(1, shards_of(1), META)
    assert len(delays) == 2 and [ref.step for ref in store.list()] == [1]

    def denied_put(**kwargs: Any) -> Any:
        raise ClientError({"Error": {"Code": "AccessDenied", "Message": "no"}}, "PutObject")

    client.put_object = denied_put
    with pytest.raises(ClientError, match="AccessDenied"):
        store.save(2, {"x": b""}, {})
    assert len(delays) == 2


def test_errors_that_are_not_damage_are_raised(s3_endpoint: str, aws_env: None) -> None:
    store = store_for("no-such-bucket-here", s3_endpoint)
    with pytest.raises(ClientError, match="NoSuchBucket"):
        store.latest_valid()


def test_a_store_pickles_and_reconnects(bucket: str, s3_endpoint: str) -> None:
    store = store_for(bucket, s3_endpoint)
    store.save(1, shards_of(1), META)
    clone = pickle.loads(pickle.dumps(store))
    assert clone.load(1).shards["params/layers.0.wq"] == shards_of(1)["params/layers.0.wq"]
