"""Reaching S3: one sentence for each way it fails, and the check every S3 entry point makes of
its URI before any work (any cluster) starts.

boto3 reports a missing credential, an unreachable endpoint, a refused key, a denied request, a
missing bucket and a throttled one as a botocore exception of 50 lines; a user needs to know which
of these it was and what to set. ``cause`` gives that sentence for any botocore or boto3 failure
(walking the exception's causes: a transfer failure carries the request's error inside it), and
None for anything else. ``check_access`` lists one key under a URI with a client that gives up
fast (two attempts, a 5 s connect timeout): credentials, endpoint, bucket and list permission
are then known good before a run or a prepare starts, and a failure is ``S3Unavailable`` naming
the URI and the cause. ``check_reachable`` is that check as every S3 entry point makes it of
its user's input: nothing for a URI that is not ``s3://``, and a ConfigError naming the key (or
option) that gave the URI. Write permission is not known until a write: a write refused mid-run is
reported with the same sentences.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Optional
from urllib.parse import urlsplit

from ringtrain.checkpoint.options import S3Options
from ringtrain.errors import ConfigError, RingtrainError, first_line
from ringtrain.uris import is_s3

CREDENTIAL_VARIABLES = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
ENDPOINT_VARIABLES = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")
NO_CREDENTIALS = (
    f"no AWS credentials were found: set {' and '.join(CREDENTIAL_VARIABLES)} (or AWS_PROFILE, or "
    "AWS_SHARED_CREDENTIALS_FILE naming a credentials file)"
)
# How the check reaches the endpoint: fast to give up, unlike a run's store (S3Options).
CHECK_ATTEMPTS = 2
CHECK_CONNECT_TIMEOUT_S = 5.0
CHECK_READ_TIMEOUT_S = 20.0

_DENIED = frozenset({"AccessDenied", "AllAccessDisabled", "403", "Forbidden", "AccountProblem"})
_NO_BUCKET = frozenset({"NoSuchBucket", "404", "NotFound"})
_BAD_KEY = frozenset(
    {
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "ExpiredToken",
        "TokenRefreshRequired",
        "InvalidToken",
        "RequestExpired",
        "AuthFailure",
        "UnrecognizedClientException",
        "InvalidClientTokenId",
    }
)
_THROTTLED = frozenset(
    {"SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded", "TooManyRequestsException", "503"}
)


class S3Unavailable(RingtrainError):
    """An S3 URI cannot be used: ``cause`` says why in one sentence (``cause()``)."""

    def __init__(self, uri: str, cause: str) -> None:
        super().__init__(f"{uri}: {cause}")
        self.uri, self.cause = uri, cause

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.uri, self.cause))


def endpoint_origin(endpoint_url: Optional[str] = None) -> str:
    """The endpoint a client reached (``endpoint_url``: a URL it requested, or the one it was
    given), else the one it would reach, and which variable named it, for messages."""
    reached = _origin(endpoint_url) if endpoint_url else None
    for name in ENDPOINT_VARIABLES:
        value = os.environ.get(name)
        if value and (reached is None or _origin(value) == reached):
            return f"{_origin(value)} (from {name})"
    return reached or "AWS's own endpoint (no AWS_ENDPOINT_URL is set)"


def _origin(url: str) -> str:
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}" if parts.scheme and parts.netloc else url


def cause(exc: BaseException, endpoint_url: Optional[str] = None) -> Optional[str]:
    """One sentence for a failure of boto3 or botocore (or one carried in ``exc``'s causes), with
    what to change; None when ``exc`` is no such failure (as it never is while botocore was never
    loaded: a file:// store's failure asks for no boto3 import)."""
    if "botocore" not in sys.modules:
        return None
    from boto3.exceptions import S3TransferFailedError, S3UploadFailedError
    from botocore import exceptions as bc

    seen: set[int] = set()
    found: Optional[BaseException] = exc
    while found is not None and id(found) not in seen:
        seen.add(id(found))
        if isinstance(found, bc.ClientError):
            return _client_error(found, endpoint_url)
        if isinstance(found, bc.NoCredentialsError):
            return NO_CREDENTIALS
        if isinstance(found, bc.PartialCredentialsError):
            missing = found.kwargs.get("cred_var", "a variable")
            return f"the AWS credentials are incomplete: {missing} is not set"
        if isinstance(found, (bc.CredentialRetrievalError, bc.NoAuthTokenError)):
            return f"the AWS credentials could not be obtained ({first_line(found)}): check AWS_PROFILE and its source"
        if isinstance(found, (bc.EndpointConnectionError, bc.ConnectTimeoutError, bc.ConnectionClosedError)):
            where = endpoint_origin(found.kwargs.get("endpoint_url") or endpoint_url)
            return f"cannot reach the S3 endpoint {where} (after retries): check AWS_ENDPOINT_URL and the network"
        if isinstance(found, bc.ReadTimeoutError):
            where = endpoint_origin(found.kwargs.get("endpoint_url") or endpoint_url)
            return f"the S3 endpoint {where} stopped answering (read timed out, after retries)"
        if isinstance(found, bc.NoRegionError):
            return "no AWS region is set: set AWS_DEFAULT_REGION"
        if isinstance(found, bc.BotoCoreError):
            return f"{type(found).__name__}: {first_line(found)}"
        if isinstance(found, (S3UploadFailedError, S3TransferFailedError)) and found.__context__ is None:
            return first_line(found)
        found = found.__cause__ or found.__context__
    return None


def _client_error(exc: Any, endpoint_url: Optional[str]) -> str:
    error = exc.response.get("Error", {})
    code = str(error.get("Code", ""))
    operation = getattr(exc, "operation_name", "the request")
    if code in _NO_BUCKET:
        bucket = error.get("BucketName") or "the bucket"
        return f"no such bucket {bucket!r} at {endpoint_origin(endpoint_url)}: create it, or name another in the URI"
    if code in _BAD_KEY:
        return (
            f"the AWS credentials were refused ({code}): the access key is wrong, or they have expired; renew them "
            f"({' and '.join(CREDENTIAL_VARIABLES)}, or AWS_PROFILE)"
        )
    if code in _DENIED:
        return (
            f"access denied ({operation}): the credentials in use may not do this here; ask for the permission, "
            "or use credentials that have it"
        )
    if code in _THROTTLED:
        return f"the S3 endpoint throttled the requests ({code}, {operation}) past every retry: try again later, or lower the load"
    message = str(error.get("Message", "")).strip()
    return f"{operation} failed: {code}{': ' + message if message else ''}"


def check_access(uri: str, options: Optional[S3Options] = None) -> None:
    """Credentials, endpoint, bucket and the permission to list under ``uri`` (``s3://bucket/prefix``),
    in one request: S3Unavailable naming the URI and the cause when any of them fails."""
    import boto3
    from botocore.config import Config

    from ringtrain.checkpoint.s3 import parse_s3_uri

    opts = options or S3Options()
    bucket, prefix = parse_s3_uri(uri)
    config = Config(
        retries={"mode": "standard", "max_attempts": CHECK_ATTEMPTS},
        connect_timeout=CHECK_CONNECT_TIMEOUT_S,
        read_timeout=CHECK_READ_TIMEOUT_S,
        s3={"addressing_style": opts.addressing_style} if opts.addressing_style else None,
    )
    try:
        session = boto3.session.Session()
        if session.get_credentials() is None:  # before any request: botocore would only say so at signing
            raise S3Unavailable(uri, NO_CREDENTIALS)
        client = _client(session, uri, opts, config)
        client.list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/" if prefix else "", MaxKeys=1)
    except S3Unavailable:
        raise
    except Exception as exc:
        said = cause(exc, opts.endpoint_url)
        if said is None:
            raise
        raise S3Unavailable(uri, said) from None


def _client(session: Any, uri: str, opts: S3Options, config: Any) -> Any:
    try:
        return session.client("s3", endpoint_url=opts.endpoint_url, region_name=opts.region_name, config=config)
    except ValueError as exc:  # botocore refuses an endpoint that is no URL before any request
        raise S3Unavailable(
            uri, f"the S3 endpoint {endpoint_origin(opts.endpoint_url)} is not a URL ({first_line(exc)}): "
            "write it as http(s)://host[:port]",
        ) from None


def check_reachable(uri: str, key: str, subject: Optional[str] = None) -> None:
    """An ``s3://`` URI's credentials, endpoint, bucket and list permission, checked in one quick
    request before any work starts (a read or a write would retry for a minute first); a
    ConfigError naming ``key`` and the cause, after ``subject`` (how the caller names what it
    reads there; the URI by default). Nothing is checked for a URI that is not ``s3://``."""
    if not is_s3(uri):
        return
    try:
        check_access(uri)
    except S3Unavailable as exc:
        raise ConfigError(key, f"{subject or exc.uri}: {exc.cause}") from None
