"""Every S3 entry point against a real S3 server (moto) that refuses it: no credentials, an
endpoint nobody answers on, an endpoint that is no URL, credentials denied, no such bucket. Each is one line naming the key
and the cause, exit 2, before any cluster starts (starting one fails these tests), and no
traceback. Mid-run, credentials that expire and an endpoint that goes away are one incident line
each, the next save retries, and the run stops after checkpoint.max_failed_saves keeping its
newest durable checkpoint (tests/unit/controller_fakes.py's scripted workers; a real store)."""

from __future__ import annotations

import json
import socket
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import wait as wait_futures
from pathlib import Path
from typing import Any, Optional

import pytest

from ringtrain import cli, config
from ringtrain.actors.controller import Controller
from ringtrain.actors.persister import Persisted, Persister
from ringtrain.checkpoint import S3Options, open_store
from ringtrain.checkpoint.s3_access import cause
from ringtrain.telemetry.progress import Progress
from ringtrain.telemetry.rundir import RunDir
from tests.unit.controller_fakes import ScriptedGroup
from tests.unit.test_eval_cli_errors import LLAMA

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = str(REPO / "jobs" / "quickstart.yaml")
ONE_WORKER = ["mesh.dp=1", "mesh.cp=1", "data.seq_len=64"]
ALLOW_S3 = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port  # nobody listens once the socket is closed


def _set_auth(endpoint: str, first_free_requests: str) -> None:
    """moto's switch for checking credentials: "0" from now on, "inf" never (its default)."""
    request = urllib.request.Request(
        f"{endpoint}/moto-api/reset-auth", data=first_free_requests.encode(), method="POST",
        headers={"Content-Type": "text/plain"},
    )  # fmt: skip
    urllib.request.urlopen(request, timeout=10).read()


@pytest.fixture
def keys(s3_client: Any, s3_endpoint: str) -> Iterator[dict[str, tuple[str, str]]]:
    """IAM users of the test server, one allowed every S3 action and one allowed none; the server
    checks credentials while the test runs (the "testing" keys are then unknown to it)."""
    import boto3

    iam = boto3.session.Session().client("iam", endpoint_url=s3_endpoint)
    made = {}
    for name, policy in (("allowed", ALLOW_S3), ("denied", None)):
        user = f"{name}-{time.monotonic_ns()}"
        iam.create_user(UserName=user)
        if policy is not None:
            iam.put_user_policy(UserName=user, PolicyName="s3", PolicyDocument=json.dumps(policy))
        key = iam.create_access_key(UserName=user)["AccessKey"]
        made[name] = (key["AccessKeyId"], key["SecretAccessKey"])
    yield made
    _set_auth(s3_endpoint, "inf")


@pytest.fixture
def no_cluster(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any cluster these commands would start fails the test instead."""
    from ringtrain.actors import cluster
    from ringtrain.prepare import pipeline

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a cluster was started before the S3 input was checked")

    monkeypatch.setattr(cluster, "connect_to", refuse)
    monkeypatch.setattr(cluster, "connect", refuse)
    monkeypatch.setattr(pipeline, "connect", refuse)
    monkeypatch.setattr(pipeline, "chunks_in_process", refuse)


@pytest.fixture
def inputs(tmp_path: Path) -> dict[str, str]:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(LLAMA))
    (tmp_path / "text.jsonl").write_text('{"text": "hello"}\n')
    return {"model": str(model), "text": str(tmp_path / "text.jsonl"), "tmp": str(tmp_path)}


# Each S3 entry point: its command line (B is the bucket) and the key its error names.
ENTRY_POINTS = {
    "checkpoint-store": (["run", QUICKSTART, *ONE_WORKER, "checkpoint.uri=s3://B/run", "run_dir={tmp}/run"], "checkpoint.uri"),
    "resume": (["run", QUICKSTART, *ONE_WORKER, "checkpoint.resume=s3://B/run", "run_dir={tmp}/run"], "checkpoint.resume"),
    "training-data": (["run", QUICKSTART, *ONE_WORKER, "data.path=s3://B/data", "run_dir={tmp}/run"], "data.path"),
    "prepare-out": (["prepare", "{text}", "--out", "s3://B/prepared", "--tokenizer", "bytes"], "--out"),
    "prepare-source": (["prepare", "s3://B/corpus", "--out", "{tmp}/prepared", "--tokenizer", "bytes"], "SRC"),
    "eval-source": (["eval", "s3://B/run", "--data", "stdlib"], "SOURCE"),
    "eval-data": (["eval", "{model}", "--data", "s3://B/data"], "--data"),
    "export-source": (["export", "s3://B/run", "{tmp}/hf"], "SOURCE"),
}
FAILURES = {
    "no-credentials": "no AWS credentials were found: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY",
    "wrong-endpoint": "cannot reach the S3 endpoint http://127.0.0.1:{port} (from AWS_ENDPOINT_URL)",
    "denied": "access denied (ListObjectsV2)",
    "no-bucket": "no such bucket 'ringtrain-no-such-bucket'",
    "endpoint-not-a-url": "the S3 endpoint 127.0.0.1:{port} (from AWS_ENDPOINT_URL) is not a URL",
}


@pytest.mark.parametrize("failure", FAILURES)
@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_every_s3_entry_point_refuses_in_one_line_before_any_cluster(
    entry: str, failure: str, bucket: str, s3_endpoint: str, keys: dict[str, tuple[str, str]], no_cluster: None,
    inputs: dict[str, str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    args, key = ENTRY_POINTS[entry]
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint)
    monkeypatch.setenv("HOME", inputs["tmp"])
    port = _closed_port()
    used = bucket
    if failure == "no-credentials":
        monkeypatch.delenv("AWS_ACCESS_KEY_ID")
        monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    elif failure == "wrong-endpoint":
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    elif failure == "endpoint-not-a-url":  # botocore refuses it before any request, in its own words
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"127.0.0.1:{port}")
    elif failure == "denied":
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", keys["denied"][0])
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", keys["denied"][1])
        _set_auth(s3_endpoint, "0")
    else:
        used = "ringtrain-no-such-bucket"
    argv = [a.replace("s3://B/", f"s3://{used}/").format(**inputs) for a in args]
    code = cli.main(argv)
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err
    assert "Traceback" not in out + err and "botocore" not in err
    flag = "--data" if key == "--data" else key
    assert f" {flag}: " in lines[0] and f"s3://{used}/" in lines[0], lines[0]
    assert FAILURES[failure].format(port=port) in lines[0], lines[0]


@pytest.mark.parametrize(
    "code, says",
    [
        ("SlowDown", "the S3 endpoint throttled the requests (SlowDown, PutObject) past every retry"),
        ("AccessDenied", "access denied (PutObject)"),
        ("NoSuchBucket", "no such bucket"),
        ("ExpiredToken", "the AWS credentials were refused (ExpiredToken): the access key is wrong, or they have expired"),
    ],
)
def test_each_refusal_has_its_own_sentence(code: str, says: str) -> None:
    from boto3.exceptions import S3UploadFailedError
    from botocore.exceptions import ClientError

    error = ClientError({"Error": {"Code": code, "Message": "m"}}, "PutObject")
    assert says in (cause(error) or "")
    try:  # as boto3's transfer manager reports a multipart upload's failed part
        try:
            raise error
        except ClientError as inner:
            raise S3UploadFailedError(f"Failed to upload x to y: {inner}") from None
    except S3UploadFailedError as wrapped:
        assert says in (cause(wrapped.__context__ or wrapped) or "")
    assert cause(ValueError("not S3")) is None


class SmallShards(Persister):
    """Writes one small shard per step itself instead of fetching the workers' snapshots."""

    def _persist(self, step: int, snapshot_refs: list[Any], t0: float, timeout_s: Optional[float]) -> Persisted:
        ref = self.store.save(step, {"rank-00000": bytes([step]) * 64}, dict(self.meta, step=step, world_size=1))
        return Persisted(step, ref.uri, 64, time.perf_counter() - t0)


class BreakAfter(ScriptedGroup):
    """Two scripted ranks whose every step waits for the saves in flight, as a real step outlasts
    a small save; after step ``at`` the store goes bad (``breaks``)."""

    def __init__(self, at: int, breaks: Any, persister: Persister) -> None:
        super().__init__()
        self.at, self.breaks, self.persister = at, breaks, persister

    def train_step(self, probe: bool = False, on_safe: Any = None) -> Any:
        wait_futures(self.persister._pending)
        if self.step == self.at:
            self.breaks()
        return super().train_step(probe, on_safe)


def _run_until_the_store_fails(tmp_path: Path, store: Any, breaks: Any) -> tuple[dict[str, Any], str, list[dict[str, Any]]]:
    job = config.load(None, ["mesh.dp=2", "train.steps=12", "checkpoint.persist_every=2", "checkpoint.max_failed_saves=2"])
    out = tmp_path / "console"
    with open(out, "w") as console:
        progress = Progress(12, out=console, ticking=False)
        persister = SmallShards(store, {"model": {"dim": 64}})
        group = BreakAfter(4, breaks, persister)
        summary = Controller(job, group, RunDir(tmp_path / "run"), progress, persister=persister).run()
    incidents = [json.loads(p.read_text()) for p in sorted((tmp_path / "run" / "incidents").glob("*.json"))]
    return summary, out.read_text(), incidents


def _check_stopped_keeping_step_4(summary: dict[str, Any], console: str, incidents: list[dict[str, Any]], store: Any, says: str) -> None:
    """Saves of steps 2 and 4 written, 6 and 8 failed: an incident when each failure is seen (a
    step later), the first "retry", the second "stop"; the run stops there, step 4 kept."""
    assert summary["status"] == "stopped" and summary["final_step"] == 9, summary
    assert summary["last_durable_step"] == 4
    assert [(i["kind"], i["action"], i["detected_at_step"]) for i in incidents] == [("checkpoint", "retry", 7), ("checkpoint", "stop", 9)]
    for incident in incidents:
        assert incident["reason"].startswith(f"durable checkpoint failed: {store.uri}: {says}"), incident["reason"]
    assert incidents[0]["reason"].endswith("; the next save tries again; the newest durable step is 4")
    assert incidents[1]["reason"].endswith("; stopping after 2 failed saves in a row (checkpoint.max_failed_saves=2); the newest durable step is 4")
    incident_lines = [line for line in console.splitlines() if line.startswith("incident ")]
    assert len(incident_lines) == 2 and all(says in line for line in incident_lines)
    assert "Traceback" not in console and "botocore" not in console and "\nstop: " in console


def test_credentials_expiring_mid_run_are_one_incident_each_then_a_stop_keeping_the_newest_checkpoint(
    bucket: str, s3_endpoint: str, keys: dict[str, tuple[str, str]], tmp_path: Path
) -> None:
    store = open_store(f"s3://{bucket}/run", endpoint_url=s3_endpoint)
    summary, console, incidents = _run_until_the_store_fails(tmp_path, store, lambda: _set_auth(s3_endpoint, "0"))
    says = "the AWS credentials were refused (InvalidAccessKeyId)"
    _check_stopped_keeping_step_4(summary, console, incidents, store, says)
    _set_auth(s3_endpoint, "inf")
    assert [ref.step for ref in store.list()] == [4, 2]  # nothing deleted, the newest kept


def test_an_endpoint_gone_mid_run_is_one_incident_each_then_a_stop(aws_env: None, tmp_path: Path) -> None:
    from moto.server import ThreadedMotoServer

    port = _closed_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        endpoint = f"http://127.0.0.1:{port}"
        import boto3

        boto3.session.Session().client("s3", endpoint_url=endpoint).create_bucket(Bucket="gone-mid-run")
        # Two attempts a request: botocore's backoff between eight would make the test a minute long.
        store = open_store("s3://gone-mid-run/run", endpoint_url=endpoint, s3_options=S3Options(max_attempts=2), commit_attempts=1)
        summary, console, incidents = _run_until_the_store_fails(tmp_path, store, server.stop)
    finally:
        server.stop()
    _check_stopped_keeping_step_4(summary, console, incidents, store, f"cannot reach the S3 endpoint {endpoint}")


def test_a_dataset_named_with_a_trailing_slash_is_named_as_without(
    bucket: str, s3_endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """s3://b/p/ and s3://b/p are one dataset: a missing manifest is named the same for either."""
    from ringtrain.errors import ConfigError
    from ringtrain.train.evalset import manifest_of

    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint)
    said = []
    for uri in (f"s3://{bucket}/pairs", f"s3://{bucket}/pairs/"):
        with pytest.raises(ConfigError) as err:
            manifest_of(uri, "--data")
        said.append(str(err.value))
    assert said[0] == said[1], said
    assert f"s3://{bucket}/pairs/manifest.json: no manifest; s3://{bucket}/pairs is not" in said[0], said[0]
