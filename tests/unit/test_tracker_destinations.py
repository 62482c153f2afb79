"""A job file never chooses where the user's MLflow credentials go; credentials written into a URI
never reach the console, an incident, config.yaml, the report or a tracker's parameters; a
tracker key read back from a checkpoint is checked as a key before it becomes query text.

The attack: a job file someone hands you names ``telemetry.mlflow.tracking_uri``, and MLflow
attaches ``MLFLOW_TRACKING_TOKEN`` to every request to it, followed by every config value,
metric, incident and the run's files. A fake tracking server on loopback stands for that host:
it must receive nothing.
"""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Optional

import pytest

from ringtrain import cli, config
from ringtrain.config.destinations import mask_credentials
from ringtrain.errors import ConfigError
from ringtrain.telemetry.rundir import RunDir
from ringtrain.telemetry.trackers import Point, Status, Trackers, TrackerSink, TrackerState, params_of

QUICKSTART = Path(__file__).resolve().parents[2] / "jobs" / "quickstart.yaml"
CREDENTIAL_VARIABLES = ("MLFLOW_TRACKING_TOKEN", "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_URI")


class FakeTracker(http.server.BaseHTTPRequestHandler):
    """Counts every request, whatever it asks."""

    requests: list[str] = []

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self._answer()

    do_POST = do_PUT = do_GET

    def _answer(self) -> None:
        type(self).requests.append(f"{self.command} {self.path} {self.headers.get('Authorization')}")
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def fake_server() -> Iterator[tuple[str, list[str]]]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), FakeTracker)
    FakeTracker.requests = []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", FakeTracker.requests
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def user_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> pytest.MonkeyPatch:
    """A user with an MLflow token in the environment, and nothing else of ours set."""
    for name in (*CREDENTIAL_VARIABLES, "RINGTRAIN_TRACKING_HOSTS", "RAY_ADDRESS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("MLFLOW_TRACKING_TOKEN", "the-users-token")
    return monkeypatch


def job_file(tmp_path: Path, uri: str) -> Path:
    path = tmp_path / "handed.yaml"
    path.write_text(QUICKSTART.read_text() + f"telemetry:\n  mlflow:\n    tracking_uri: {uri}\n")
    return path


@pytest.mark.parametrize("command", ["run", "submit"])
def test_a_job_files_tracking_server_receives_nothing(
    user_env: pytest.MonkeyPatch, fake_server: tuple[str, list[str]], tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str
) -> None:
    uri, requests = fake_server
    code = cli.main([command, str(job_file(tmp_path, uri)), f"run_dir={tmp_path / 'run'}", "train.steps=1"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith(f"ringtrain: config error: telemetry.mlflow.tracking_uri: {uri} in {tmp_path / 'handed.yaml'} names the host 127.0.0.1")
    assert "add 127.0.0.1 to RINGTRAIN_TRACKING_HOSTS, or give the URI on the command line" in err and err.count("\n") == 1
    assert requests == [] and not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("overrides", "environment"),
    [
        (["telemetry.mlflow.tracking_uri={uri}"], {}),  # repeated on the command line
        (["telemetry.mlflow={{tracking_uri: '{uri}'}}"], {}),
        ([], {"RINGTRAIN_TRACKING_HOSTS": "mlflow.internal, 127.0.0.1"}),
        ([], {"RINGTRAIN_TRACKING_HOSTS": "127.0.0.1:{port}"}),
        ([], {"MLFLOW_TRACKING_URI": "{uri}"}),  # the user's own setting
    ],
    ids=["override", "section-override", "allowed-host", "allowed-host-and-port", "user-environment"],
)
def test_the_user_allows_a_job_files_tracking_server(
    user_env: pytest.MonkeyPatch, tmp_path: Path, overrides: list[str], environment: dict[str, str]
) -> None:
    uri = "http://127.0.0.1:5123"
    for name, value in environment.items():
        user_env.setenv(name, value.format(uri=uri, port=5123))
    job = config.load(job_file(tmp_path, uri), [o.format(uri=uri) for o in overrides])
    assert job.telemetry.mlflow.tracking_uri == uri


@pytest.mark.parametrize(
    ("hosts", "overrides"),
    [
        ("127.0.0.1:5000", []),  # another port of the host
        ("mlflow.internal", []),
        ("", ["telemetry.mlflow.tracking_uri=http://127.0.0.1:9999"]),  # the command line names another
    ],
)
def test_only_the_host_allowed_is(user_env: pytest.MonkeyPatch, tmp_path: Path, hosts: str, overrides: list[str]) -> None:
    user_env.setenv("RINGTRAIN_TRACKING_HOSTS", hosts)
    path = tmp_path / "handed.yaml"
    path.write_text("telemetry:\n  mlflow: {tracking_uri: 'http://127.0.0.1:5123', experiment: '${telemetry.mlflow.tracking_uri}'}\n")
    if overrides:  # the override wins: the file's own URI is never used, so nothing to refuse
        assert config.load(path, overrides).telemetry.mlflow.tracking_uri == "http://127.0.0.1:9999"
        return
    with pytest.raises(ConfigError, match=r"^telemetry\.mlflow\.tracking_uri: http://127\.0\.0\.1:5123 in .* names the host 127\.0\.0\.1"):
        config.load(path)


def test_local_stores_need_no_allowing(user_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for uri in (f"sqlite:///{tmp_path}/mlflow.db", f"file:{tmp_path}/mlruns", "databricks"):
        assert config.load(job_file(tmp_path, uri)).telemetry.mlflow.tracking_uri == uri


def test_plain_http_to_another_machine_with_credentials_is_refused_wherever_the_uri_comes_from(
    user_env: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    refused = r"is plain http to another machine, over which MLflow would send your credentials .*: use https://"
    with pytest.raises(ConfigError, match=r"^telemetry\.mlflow\.tracking_uri: http://mlflow\.internal:5000 " + refused):
        config.load(None, ["telemetry.mlflow.tracking_uri=http://mlflow.internal:5000"])
    assert config.load(None, ["telemetry.mlflow.tracking_uri=https://mlflow.internal"]).telemetry.mlflow.tracking_uri
    user_env.delenv("MLFLOW_TRACKING_TOKEN")
    assert config.load(None, ["telemetry.mlflow.tracking_uri=http://mlflow.internal:5000"])  # nothing to send
    with pytest.raises(ConfigError, match=r"http://\*\*\*@mlflow\.internal " + refused):
        config.load(None, ["telemetry.mlflow.tracking_uri=http://alice:pw@mlflow.internal"])
    (tmp_path / "home" / ".mlflow").mkdir(parents=True)
    (tmp_path / "home" / ".mlflow" / "credentials").write_text("[mlflow]\nmlflow_tracking_username = alice\n")
    with pytest.raises(ConfigError, match=refused):
        config.load(None, ["telemetry.mlflow.tracking_uri=http://mlflow.internal:5000"])


# --- credentials written into a URI -----------------------------------------------------------------

URI_WITH_PASSWORD = "https://alice:s3cret-pw@mlflow.internal/prefix"


class FailingTracker:
    """A tracker whose client's every error quotes the URI whole, as MLflow's do."""

    name = "mlflow"

    def __init__(self, uri: str) -> None:
        self.uri = uri
        self.where = mask_credentials(uri)

    def open(self, run_id: Optional[str], key: str, params: dict[str, str]) -> str:
        raise ConnectionError(f"API request to {self.uri}/api/2.0/mlflow/runs/create failed")

    def log(self, points: Sequence[Point]) -> None: ...

    def event(self, event: Any) -> None: ...

    def finish(self, status: Status, files: Sequence[Path]) -> None: ...


def test_credentials_in_a_uri_reach_no_file_message_or_parameter(user_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from ringtrain.telemetry.mlflow_tracker import MlflowTracker
    from ringtrain.telemetry.report import write_report

    job = config.load(QUICKSTART, [f"telemetry.mlflow.tracking_uri={URI_WITH_PASSWORD}"])
    run_dir = RunDir(tmp_path / "run")
    run_dir.write_config(job)
    said: list[str] = []
    sink = TrackerSink(FailingTracker(URI_WITH_PASSWORD), run_dir.path, params_of(job), retries=1, sleep=lambda s: None)
    trackers = Trackers([sink], run_dir, said.append)
    sink._thread.join(10)
    trackers.step({"step": 1, "loss": 1.0})
    run_dir.write_summary({"status": "finished"})
    run_dir.close()
    write_report(run_dir.path)

    assert said and all("s3cret-pw" not in line for line in said)
    assert "https://***@mlflow.internal/prefix" in said[0]
    for path in run_dir.path.rglob("*"):
        if path.is_file():
            assert "s3cret-pw" not in path.read_text(errors="replace"), path
    assert "https://***@mlflow.internal/prefix" in (run_dir.path / "config.yaml").read_text()
    assert params_of(job)["telemetry.mlflow"].count("***@") == 1 and "s3cret-pw" not in str(params_of(job))
    assert MlflowTracker(job.telemetry.mlflow, default_name="x").where == "https://***@mlflow.internal/prefix"


@pytest.mark.parametrize(
    ("text", "masked"),
    [
        ("http://alice:pw@host:5000/x", "http://***@host:5000/x"),
        ("see https://tok@host and s3://b/k", "see https://***@host and s3://b/k"),
        ("http://host/a@b", "http://host/a@b"),  # an @ in the path is not a user
        ("no url here: alice@example.com", "no url here: alice@example.com"),
    ],
)
def test_mask_credentials(text: str, masked: str) -> None:
    assert mask_credentials(text) == masked


# --- the tracker key ------------------------------------------------------------------------------


@pytest.mark.parametrize("planted", ["x' OR tags.`ringtrain.run_key` != '", "0" * 31 + "'", 42, "A" * 32])
def test_a_tracker_key_that_is_not_one_is_never_adopted_nor_searched_for(tmp_path: Path, planted: Any) -> None:
    """A checkpoint's meta (or a run folder's trackers.json) from elsewhere gives the key a
    resumed run looks its MLflow run up by: spliced into the search filter, a quote in it
    would select another run to log into."""
    from ringtrain.telemetry.mlflow_tracker import MlflowTracker

    state = TrackerState(tmp_path)
    state.adopt_key(planted)
    key = state.key()
    assert key != planted and len(key) == 32 and int(key, 16) >= 0
    (tmp_path / "trackers.json").write_text('{"run": {"key": "x\' OR 1=1"}}')
    assert TrackerState(tmp_path).key() != "x' OR 1=1"

    searched: list[str] = []

    class Client:
        def search_runs(self, experiments: list[str], filter_string: str, max_results: int) -> list[Any]:
            searched.append(filter_string)
            return []

    tracker = MlflowTracker(config.load(None, []).telemetry.mlflow, default_name="x")
    tracker.client = Client()
    assert tracker._run_with_key("0", key) is None
    with pytest.raises(ValueError, match="is not a ringtrain tracker key"):
        tracker._run_with_key("0", str(planted))
    assert searched == [f"tags.`ringtrain.run_key` = '{key}'"]
