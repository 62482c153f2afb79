"""The local stack's S3 endpoint: moto's server, answering only the stack's own credentials.

moto accepts any credentials unless its IAM checks are on, and its control API (``/moto-api/``)
resets every bucket, or turns those checks off, for anyone who can reach the port: on a machine
of several users, every one of them. So this runs moto's S3 and IAM with the checks on from the
first request, and refuses ``/moto-api/`` outright. Before it serves, it makes one IAM user
allowed every S3 action, a random access key for it, and the bucket, and writes the key as an
AWS shared credentials file (``[default]``, mode 0600) that only this user can read:
``infra/local-stack.sh env`` exports that file's path (``AWS_SHARED_CREDENTIALS_FILE``), never the
secret, and the stack's Ray head hands it to every job.

    python infra/s3_server.py --port 9000 --bucket ringtrain --credentials STATE/s3_credentials
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
from typing import Any, Callable, Iterable

HOST = "127.0.0.1"
REGION = "us-east-1"
USER = "ringtrain-local-stack"
CONTROL_PREFIX = "/moto-api"
ALLOW_S3 = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}

Environ = dict[str, Any]
StartResponse = Callable[..., Any]
App = Callable[[Environ, StartResponse], Iterable[bytes]]


def without_control_api(app: App) -> App:
    """``app`` with moto's control API refused (403): it could turn the checks off or wipe the store."""

    def guarded(environ: Environ, start_response: StartResponse) -> Iterable[bytes]:
        # Slashes collapsed: werkzeug would redirect "//moto-api/..." to the API, not serve it,
        # but nothing of that path is answered either way.
        if re.sub("/+", "/", str(environ.get("PATH_INFO", ""))).startswith(CONTROL_PREFIX):
            start_response("403 Forbidden", [("Content-Type", "text/plain")])
            return [b"moto's control API is off on the local stack\n"]
        return app(environ, start_response)

    return guarded


def provision(bucket: str) -> tuple[str, str]:
    """The stack's user (every S3 action allowed), its access key, and the bucket, made in moto's
    own backends before anything is served; returns (access key id, secret)."""
    from moto.core import DEFAULT_ACCOUNT_ID
    from moto.iam.models import iam_backends
    from moto.s3.models import s3_backends
    from moto.utilities.utils import get_partition

    partition = get_partition(REGION)
    iam = iam_backends[DEFAULT_ACCOUNT_ID][partition]
    iam.create_user(REGION, USER)
    iam.put_user_policy(USER, "s3", json.dumps(ALLOW_S3))
    key = iam.create_access_key(USER)
    s3_backends[DEFAULT_ACCOUNT_ID][partition].create_bucket(bucket, REGION)
    return key.access_key_id, key.secret_access_key


def write_credentials(path: str, key_id: str, secret: str) -> None:
    """An AWS shared credentials file only this user can read (made, never rewritten in place)."""
    if os.path.lexists(path):
        os.unlink(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(f"[default]\naws_access_key_id = {key_id}\naws_secret_access_key = {secret}\n")


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--bucket", required=True)
    parser.add_argument("--credentials", required=True, help="the credentials file to write")
    args = parser.parse_args(argv)

    from moto import settings
    from moto.core.authorization import ActionAuthenticatorMixin
    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
    from werkzeug.serving import run_simple

    key_id, secret = provision(args.bucket)
    # Every request from the first is checked against moto's IAM: only the key above passes.
    settings.INITIAL_NO_AUTH_ACTION_COUNT = 0
    ActionAuthenticatorMixin.request_count = 0
    write_credentials(args.credentials, key_id, secret)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))
    app = without_control_api(DomainDispatcherApplication(create_backend_app))
    run_simple(HOST, args.port, app, threaded=True, request_handler=MotoRequestHandler)


if __name__ == "__main__":
    main(sys.argv[1:])
