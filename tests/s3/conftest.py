"""An S3 endpoint for tests: a moto server on 127.0.0.1, one per session, and a fresh bucket per test.

The server runs as a subprocess (``python -m moto.server``) on a free port and is stopped by
its handle at the end of the session. Tests reach it through boto3 like any S3 endpoint.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("moto.server", reason="moto[s3] (with flask, flask-cors) runs the S3 test endpoint")
boto3 = pytest.importorskip("boto3")

START_TIMEOUT_S = 30.0
CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/moto-api/", timeout=0.5):
            return True
    except (urllib.error.URLError, OSError):
        return False


def _start(log_path: Path) -> tuple[subprocess.Popen[bytes], str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")} | CREDENTIALS
    # A port picked here can be taken before the server binds it; try a few.
    for _ in range(3):
        port = _free_port()
        url = f"http://127.0.0.1:{port}"
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
            )
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline and proc.poll() is None:
            if _answers(url):
                return proc, url
            time.sleep(0.05)
        _stop(proc)
    raise RuntimeError(f"moto server did not answer within {START_TIMEOUT_S}s; its log: {log_path}")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


@pytest.fixture(scope="session")
def s3_endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    proc, url = _start(tmp_path_factory.mktemp("moto") / "server.log")
    try:
        yield url
    finally:
        _stop(proc)


@pytest.fixture
def aws_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Dummy credentials, and no AWS settings of the machine running the tests."""
    for key in [k for k in os.environ if k.startswith("AWS_")]:
        monkeypatch.delenv(key)
    for key, value in CREDENTIALS.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


@pytest.fixture
def s3_client(s3_endpoint: str, aws_env: None) -> Any:
    """A plain boto3 client on the test endpoint, for setting up and damaging objects directly."""
    return boto3.session.Session().client("s3", endpoint_url=s3_endpoint)


@pytest.fixture
def bucket(s3_client: Any) -> str:
    name = f"ckpt-{uuid.uuid4().hex[:12]}"
    s3_client.create_bucket(Bucket=name)
    return name
