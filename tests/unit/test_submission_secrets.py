"""`ringtrain submit --secret NAME`: a secret reaches the job's driver through the cluster's store,
never its record; `--env` of a secret's name is refused naming the way. The job API and Ray's
logs after a real submission: tests/ray/test_submit.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import pytest

from ringtrain import cli
from ringtrain.errors import ConfigError
from ringtrain.submission_secrets import (
    MAGIC,
    SECRETS_VARIABLE,
    check_env_names,
    looks_secret,
    read_secrets,
    receive,
    seal,
    unseal,
    upload,
)

QUICKSTART = Path(__file__).resolve().parents[2] / "jobs" / "quickstart.yaml"


@pytest.mark.parametrize(
    ("name", "secret"),
    [
        ("WANDB_API_KEY", True), ("MLFLOW_TRACKING_TOKEN", True), ("AWS_SECRET_ACCESS_KEY", True),
        ("MLFLOW_TRACKING_PASSWORD", True), ("DB_PASSWORD_FILE", True), ("HF_TOKEN", True), ("my_client_secret", True),
        ("WANDB_PROJECT", False), ("HF_HUB_OFFLINE", False), ("AWS_DEFAULT_REGION", False), ("KEYBOARD", False),
    ],
)  # fmt: skip
def test_what_looks_like_a_secret(name: str, secret: bool) -> None:
    assert looks_secret(name) is secret


def test_env_of_a_secret_is_refused_with_the_way_to_pass_it(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("WANDB_API_KEY", "k")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    # Refused before any cluster is asked (none answers at this address).
    code = cli.main(["submit", str(QUICKSTART), "--address", "http://127.0.0.1:9", "--env", "WANDB_API_KEY"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert err.startswith("ringtrain: config error: --env: WANDB_API_KEY looks like a secret, and a variable passed with --env stays readable")
    assert "pass it with --secret WANDB_API_KEY" in err
    check_env_names(["WANDB_PROJECT", "HF_HUB_OFFLINE"])


@pytest.mark.parametrize(
    ("names", "environ", "expected"),
    [
        (["MISSING_TOKEN"], {}, "--secret: MISSING_TOKEN is not set in this shell"),
        (["A_TOKEN=x"], {"A_TOKEN": "x"}, "--secret: 'A_TOKEN=x' is not a variable name"),
        (["BIG_KEY"], {"BIG_KEY": "x" * 70_000}, "--secret: the secrets come to more than 65,536 bytes"),
    ],
)
def test_bad_secret_names_are_bad_input(names: list[str], environ: dict[str, str], expected: str) -> None:
    with pytest.raises(ConfigError) as refused:
        read_secrets(names, environ)
    assert str(refused.value).startswith(expected)


@pytest.mark.parametrize("flag", ["--env", "--secret"])
@pytest.mark.parametrize(
    ("name", "environ", "expected"),
    [
        ("WANDB_PROJECT", {}, "{flag}: WANDB_PROJECT is not set in this shell"),
        ("WANDB_PROJECT=p", {"WANDB_PROJECT": "p"}, "{flag}: 'WANDB_PROJECT=p' is not a variable name"),
        ("WANDB-PROJECT", {"WANDB-PROJECT": "p"}, "{flag}: 'WANDB-PROJECT' is not a variable name"),
        ("", {}, "{flag}: '' is not a variable name"),
    ],
)
def test_env_and_secret_read_a_name_from_this_shell_alike(flag: str, name: str, environ: dict[str, str], expected: str) -> None:
    """Both flags name a variable of this shell: what one refuses, the other does, in the same words."""
    from ringtrain.submission import passed_env

    read = passed_env if flag == "--env" else read_secrets
    with pytest.raises(ConfigError) as refused:
        read([name], environ)
    assert str(refused.value).startswith(expected.format(flag=flag))
    assert read(["HF_HUB_OFFLINE"], {"HF_HUB_OFFLINE": "1", "OTHER": "x"}) == {"HF_HUB_OFFLINE": "1"}


def test_a_password_in_the_tracking_uri_is_refused_for_a_submission(capsys: pytest.CaptureFixture[str]) -> None:
    code = cli.main(["submit", str(QUICKSTART), "telemetry.mlflow.tracking_uri=https://alice:pw@mlflow.internal", "--address", "http://127.0.0.1:9"])
    err = capsys.readouterr().err
    assert code == 2 and "pw" not in err.replace("password", "")
    assert err.startswith("ringtrain: config error: telemetry.mlflow.tracking_uri: holds a password") and "--secret" in err


def test_a_sealed_object_starts_with_no_secret_and_opens_to_the_values() -> None:
    """Ray quotes the first 15 bytes of a package whose upload failed in its error."""
    data = seal({"WANDB_API_KEY": "k-123"})
    assert data.startswith(MAGIC) and len(MAGIC) > 15 and b"k-123" not in data[:15]
    assert unseal(data) == {"WANDB_API_KEY": "k-123"}
    with pytest.raises(ValueError):
        unseal(b'{"WANDB_API_KEY": "k-123"}')


class FakeResponse:
    def __init__(self, status_code: int) -> None:
        self.status_code = status_code


class FakeJobApi:
    """The two calls of Ray's job client an upload makes, recorded."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, Optional[bytes]]] = []

    def _do_request(self, method: str, path: str, data: Optional[bytes] = None) -> FakeResponse:
        self.calls.append((method, path, data))
        return FakeResponse(404 if method == "GET" else 200)

    def _raise_error(self, response: Any) -> None:
        raise RuntimeError(response.status_code)


class FakeStore:
    """Ray's GcsClient over a dict: what a job's driver reads and deletes."""

    objects: dict[bytes, bytes] = {}

    def __init__(self, address: str) -> None:
        self.address = address

    def internal_kv_get(self, key: bytes, namespace: Any) -> Optional[bytes]:
        return self.objects.get(key)

    def internal_kv_del(self, key: bytes, by_prefix: bool, namespace: Any) -> int:
        return 1 if self.objects.pop(key, None) is not None else 0


def test_a_secret_goes_up_by_a_random_name_and_the_job_reads_it_once(monkeypatch: pytest.MonkeyPatch) -> None:
    import ray._raylet

    api = FakeJobApi()
    env = upload(api, {"MLFLOW_TRACKING_TOKEN": "t-456"})
    (uri,) = env.values()
    name = uri.removeprefix("gcs://")
    # Asked for first (Ray's temporary hold, so an unclaimed object is deleted), then put.
    assert [(m, p) for m, p, _ in api.calls] == [("GET", f"/api/packages/gcs/{name}"), ("PUT", f"/api/packages/gcs/{name}")]
    assert env == {SECRETS_VARIABLE: uri} and "t-456" not in json.dumps(env)
    assert upload(FakeJobApi(), {"X_TOKEN": "x"})[SECRETS_VARIABLE] != uri  # random

    monkeypatch.setattr(ray._raylet, "GcsClient", FakeStore)
    FakeStore.objects = {uri.encode(): api.calls[1][2] or b""}
    driver_env = {SECRETS_VARIABLE: uri, "RAY_ADDRESS": "127.0.0.1:6379"}
    assert receive(driver_env) == ["MLFLOW_TRACKING_TOKEN"]
    assert driver_env == {"MLFLOW_TRACKING_TOKEN": "t-456", "RAY_ADDRESS": "127.0.0.1:6379"}
    assert FakeStore.objects == {}  # deleted from the cluster's store
    with pytest.raises(ConfigError, match="--secret: the job's secrets .* are not in the cluster's store"):
        receive({SECRETS_VARIABLE: uri, "RAY_ADDRESS": "127.0.0.1:6379"})
    assert receive({}) == []  # not a job submitted with --secret
