"""The S3 object backend: checkpoint objects in a bucket, through boto3.

Credentials, region and endpoint come from the standard AWS configuration (environment
variables such as ``AWS_ENDPOINT_URL``, shared config files, instance roles), which boto3 reads
itself; ``S3Options.endpoint_url`` overrides the endpoint for one store. Large objects go up
and down in parts, in parallel, through boto3's transfer manager; botocore's "standard" retry
mode retries throttling and transient server and network errors with exponential backoff.

The boto3 client is made on first use, not on construction, and is left out of the pickled
state, so a backend crosses process boundaries and reconnects on the other side.
"""

from __future__ import annotations

import io
import threading
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Optional

import boto3
from boto3.s3.transfer import TransferConfig
from botocore.config import Config as BotoConfig
from botocore.exceptions import BotoCoreError, ClientError, HTTPClientError, IncompleteReadError
from botocore.exceptions import ConnectionError as BotoConnectionError

from ringtrain import uris
from ringtrain.checkpoint.backends import ObjectInfo, ObjectMissing, ObjectTooLarge
from ringtrain.checkpoint.options import S3Options

# S3's DeleteObjects takes at most this many keys per call.
_DELETE_BATCH = 1000
_MISSING_CODES = frozenset({"NoSuchKey", "404", "NotFound"})
# A conditional write or delete that lost: the object is not the version it was asked to be.
_CONDITION_CODES = frozenset({"PreconditionFailed", "412", "ConditionalRequestConflict", "409"})
_TRANSIENT_CODES = frozenset(
    {
        "InternalError",
        "ServiceUnavailable",
        "SlowDown",
        "RequestTimeout",
        "RequestTimeoutException",
        "Throttling",
        "ThrottlingException",
        "RequestLimitExceeded",
        "PriorRequestNotComplete",
    }
)


def parse_s3_uri(uri: str) -> tuple[str, str]:
    """(bucket, key prefix without a trailing '/') of ``s3://bucket[/prefix]``."""
    rest = uri[len(uris.S3) :]
    bucket, _, prefix = rest.partition("/")
    if not bucket:
        raise ValueError(f"checkpoint URI {uri!r}: expected s3://bucket/prefix")
    return bucket, prefix.strip("/")


class S3Backend:
    """Objects under ``s3://bucket/prefix/``; the boto3 client is thread-safe and shared."""

    def __init__(self, bucket: str, prefix: str, options: S3Options) -> None:
        self.bucket = bucket
        self.prefix = prefix
        self.options = options
        self.root_uri = f"s3://{bucket}/{prefix}" if prefix else f"s3://{bucket}"
        self._key_prefix = f"{prefix}/" if prefix else ""
        self._client_lock = threading.Lock()
        self._client: Any = None
        self._transfer = TransferConfig(
            multipart_threshold=options.multipart_threshold,
            multipart_chunksize=options.multipart_chunksize,
            max_concurrency=options.max_concurrency,
            use_threads=True,
        )

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_client"] = None
        del state["_client_lock"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._client_lock = threading.Lock()

    @property
    def client(self) -> Any:
        with self._client_lock:
            if self._client is None:
                opts = self.options
                s3_config: Any = {"addressing_style": opts.addressing_style} if opts.addressing_style else None
                config = BotoConfig(
                    retries={"mode": "standard", "max_attempts": opts.max_attempts},
                    max_pool_connections=opts.max_pool_connections,
                    s3=s3_config,
                )
                # A session per backend: boto3's default session is not safe to share across threads.
                session = boto3.session.Session()
                self._client = session.client(
                    "s3", endpoint_url=opts.endpoint_url, region_name=opts.region_name, config=config
                )
            return self._client

    def uri(self, key: str) -> str:
        return f"s3://{self.bucket}/{self._key_prefix}{key}"

    def put(self, key: str, data: bytes) -> None:
        full = self._key_prefix + key
        if len(data) >= self.options.multipart_threshold:
            self.client.upload_fileobj(io.BytesIO(data), self.bucket, full, Config=self._transfer)
        else:
            self.client.put_object(Bucket=self.bucket, Key=full, Body=data)

    def get(self, key: str, size_hint: Optional[int] = None, limit: Optional[int] = None) -> bytes:
        full = self._key_prefix + key
        try:
            if size_hint is not None and size_hint >= self.options.multipart_threshold:
                buffer = _Bounded(self.uri(key), limit)
                self.client.download_fileobj(self.bucket, full, buffer, Config=self._transfer)
                return buffer.getvalue()
            return _read(self.client.get_object(Bucket=self.bucket, Key=full)["Body"], self.uri(key), limit)
        except ClientError as exc:
            if _code(exc) in _MISSING_CODES:
                raise ObjectMissing(key) from None
            raise

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        paginator = self.client.get_paginator("list_objects_v2")
        pages = paginator.paginate(
            Bucket=self.bucket,
            Prefix=self._key_prefix + prefix,
            PaginationConfig={"PageSize": self.options.page_size},
        )
        skip = len(self._key_prefix)
        for page in pages:
            for obj in page.get("Contents", ()):
                yield ObjectInfo(key=obj["Key"][skip:], size=int(obj["Size"]))

    def delete(self, keys: Iterable[str]) -> None:
        batch: list[str] = []
        for key in keys:
            batch.append(key)
            if len(batch) == _DELETE_BATCH:
                self._delete_batch(batch)
                batch = []
        if batch:
            self._delete_batch(batch)

    def delete_prefix(self, prefix: str) -> None:
        self.delete([info.key for info in self.list(prefix)])

    def get_versioned(self, key: str, limit: Optional[int] = None) -> tuple[bytes, str]:
        try:
            response = self.client.get_object(Bucket=self.bucket, Key=self._key_prefix + key)
        except ClientError as exc:
            if _code(exc) in _MISSING_CODES:
                raise ObjectMissing(key) from None
            raise
        return _read(response["Body"], self.uri(key), limit), str(response["ETag"])

    def put_if(self, key: str, data: bytes, version: Optional[str]) -> Optional[str]:
        # S3's conditional writes: If-None-Match "*" creates only, If-Match replaces only that ETag.
        condition = {"IfNoneMatch": "*"} if version is None else {"IfMatch": version}
        try:
            response = self.client.put_object(Bucket=self.bucket, Key=self._key_prefix + key, Body=data, **condition)
        except ClientError as exc:
            if _code(exc) in _CONDITION_CODES or (version is not None and _code(exc) in _MISSING_CODES):
                return None
            raise
        return str(response["ETag"])

    def delete_if(self, key: str, version: str) -> bool:
        try:
            self.client.delete_object(Bucket=self.bucket, Key=self._key_prefix + key, IfMatch=version)
        except ClientError as exc:
            if _code(exc) in _CONDITION_CODES or _code(exc) in _MISSING_CODES:
                return False
            raise
        return True

    def is_transient(self, exc: BaseException) -> bool:
        if isinstance(exc, (BotoConnectionError, HTTPClientError, IncompleteReadError)):
            return True
        if isinstance(exc, ClientError):
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
            return _code(exc) in _TRANSIENT_CODES or int(status) >= 500
        return isinstance(exc, BotoCoreError) and "timeout" in type(exc).__name__.lower()

    def _delete_batch(self, keys: Sequence[str]) -> None:
        response = self.client.delete_objects(
            Bucket=self.bucket,
            Delete={"Objects": [{"Key": self._key_prefix + key} for key in keys], "Quiet": True},
        )
        errors = response.get("Errors") or []
        if errors:
            first = errors[0]
            raise OSError(
                f"S3 could not delete {len(errors)} object(s) under {self.root_uri}, "
                f"first s3://{self.bucket}/{first.get('Key')}: {first.get('Code')} {first.get('Message')}"
            )


def _read(body: Any, uri: str, limit: Optional[int]) -> bytes:
    """A GetObject body's bytes; at most ``limit`` + 1 read (ObjectTooLarge past ``limit``)."""
    try:
        data: bytes = body.read() if limit is None else body.read(limit + 1)
    finally:
        body.close()  # unread bytes of an oversized object are dropped with the connection
    if limit is not None and len(data) > limit:
        raise ObjectTooLarge(uri, limit)
    return data


class _Bounded(io.BytesIO):
    """A download's buffer that refuses a byte past ``limit`` (parts may land out of order)."""

    def __init__(self, uri: str, limit: Optional[int]) -> None:
        super().__init__()
        self.uri, self.limit = uri, limit

    def write(self, data: Any) -> int:
        if self.limit is not None and self.tell() + len(data) > self.limit:
            raise ObjectTooLarge(self.uri, self.limit)
        return super().write(data)


def _code(exc: ClientError) -> str:
    return str(exc.response.get("Error", {}).get("Code", ""))
