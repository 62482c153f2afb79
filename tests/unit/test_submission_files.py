"""What `ringtrain submit` ships as the job's working_dir, and how it finds the token and warns
about plain http: checked without a cluster (tests/ray/test_submit.py submits to a real one)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ringtrain import config
from ringtrain.errors import ConfigError
from ringtrain.submission import (
    CLUSTER_PYTHON_VARIABLE,
    TOKEN_FILE_MAX_BYTES,
    auth_headers,
    plain_http_warning,
    resolve_cluster_python,
    resolve_token,
)
from ringtrain.submission_files import listing, shipped_inputs, working_dir

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "jobs" / "quickstart.yaml"


def job_folder(root: Path) -> Path:
    """A job file among files a submission must not ship, and the inputs it may name."""
    root.mkdir()
    job = root / "job.yaml"
    job.write_text(QUICKSTART.read_text())
    (root / ".env").write_text("AWS_SECRET_ACCESS_KEY=x\n")
    (root / ".aws").mkdir()
    (root / ".aws" / "credentials").write_text("[default]\n")
    (root / "notes.md").write_text("not declared\n")
    (root / "data" / "sub").mkdir(parents=True)
    (root / "data" / "a.txt").write_text("a")
    (root / "data" / "sub" / "b.txt").write_text("b")
    (root / "data" / ".hidden").write_text("h")
    (root / "data" / ".git").mkdir()
    (root / "data" / ".git" / "config").write_text("g")
    (root / "data" / "__pycache__").mkdir()
    (root / "data" / "__pycache__" / "x.pyc").write_bytes(b"\0")
    (root / "eval.txt").write_text("e")
    (root / "model").mkdir()
    (root / "model" / "config.json").write_text("{}")
    return job


def shipped(job: Path, overrides: list[str]) -> list[str]:
    with working_dir(job, config.load(job, overrides)) as folder:
        assert (folder.stat().st_mode & 0o777) == 0o700
        return listing(folder)


def test_only_the_job_file_ships_when_it_declares_no_local_input(tmp_path: Path) -> None:
    job = job_folder(tmp_path / "job")
    assert shipped(job, []) == ["job.yaml"]  # data.path=stdlib: nothing to ship


def test_declared_relative_inputs_ship_without_hidden_files_or_leftovers(tmp_path: Path) -> None:
    job = job_folder(tmp_path / "job")
    files = shipped(job, ["data.path=data", "eval.data=./eval.txt"])
    assert files == ["data/a.txt", "data/sub/b.txt", "eval.txt", "job.yaml"]


def test_the_folder_is_removed_once_submitted(tmp_path: Path) -> None:
    job = job_folder(tmp_path / "job")
    with working_dir(job, config.load(job, ["data.path=data"])) as folder:
        assert folder.is_dir()
    assert not folder.exists()
    assert (job.parent / "data" / "a.txt").read_text() == "a"  # hard links: the originals stay


def test_absolute_paths_and_uris_are_the_clusters_and_are_not_shipped(tmp_path: Path) -> None:
    job = job_folder(tmp_path / "job")
    overrides = [f"data.path={tmp_path / 'job' / 'data'}", "eval.data=s3://bucket/eval"]
    assert shipped(job, overrides) == ["job.yaml"]


@pytest.mark.parametrize(
    ("override", "key", "reason"),
    [
        ("data.path=.env", "data.path", "hidden"),
        ("data.path=.aws/credentials", "data.path", "hidden"),
        ("data.path=data/.hidden", "data.path", "hidden"),
        ("data.path=../secrets", "data.path", "leaves the job file's folder"),
        ("eval.data=data/../../x", "eval.data", "leaves the job file's folder"),
        ("data.path=missing", "data.path", "does not exist"),
        ("model.hf=nope", "model.hf", "does not exist"),
    ],
)
def test_inputs_that_cannot_ship_are_refused_naming_the_key(tmp_path: Path, override: str, key: str, reason: str) -> None:
    job = job_folder(tmp_path / "job")
    with pytest.raises(ConfigError) as caught:
        shipped_inputs(job, config.load(job, [override]))
    assert caught.value.key == key and reason in caught.value.reason


def test_a_link_out_of_the_folder_is_refused(tmp_path: Path) -> None:
    """A link would ship its target: ``data/creds -> ~/.aws/credentials`` is refused."""
    outside = tmp_path / "home" / ".aws"
    outside.mkdir(parents=True)
    (outside / "credentials").write_text("secret")
    job = job_folder(tmp_path / "job")
    os.symlink(outside / "credentials", job.parent / "data" / "creds")
    with pytest.raises(ConfigError, match=r"data\.path: .*creds links to .*outside the job file's folder"):
        shipped_inputs(job, config.load(job, ["data.path=data"]))
    (job.parent / "data" / "creds").unlink()
    os.symlink(job.parent / "data" / "a.txt", job.parent / "data" / "same.txt")  # inside: fine
    assert "data/same.txt" in shipped(job, ["data.path=data"])


@pytest.mark.parametrize("through", ["shared/corpus", "shared/corpus/doc.txt", "data/out/doc.txt"])
def test_a_path_through_a_linked_folder_out_of_the_folder_is_refused(tmp_path: Path, through: str) -> None:
    """``shared -> ~/private``: ``data.path=shared/corpus`` names no link itself, but what it ships
    lies outside the job's folder."""
    private = tmp_path / "home" / "private"
    (private / "corpus").mkdir(parents=True)
    (private / "corpus" / "doc.txt").write_text("secret")
    (private / "doc.txt").write_text("secret")
    job = job_folder(tmp_path / "job")
    os.symlink(private, job.parent / "shared")
    os.symlink(private, job.parent / "data" / "out")
    with pytest.raises(ConfigError) as caught:
        shipped_inputs(job, config.load(job, [f"data.path={through}"]))
    assert caught.value.key == "data.path"
    assert "passes through a link" in caught.value.reason and str(private) in caught.value.reason
    # A linked folder that stays inside ships what it holds.
    os.symlink(job.parent / "data" / "sub", job.parent / "inside")
    assert shipped(job, ["data.path=inside/b.txt"]) == ["inside/b.txt", "job.yaml"]


def test_a_file_swapped_for_a_link_after_the_check_is_not_shipped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import ringtrain.submission_files as submission_files

    outside = tmp_path / "secret.txt"
    outside.write_text("secret")
    job = job_folder(tmp_path / "job")
    target = job.parent / "data" / "a.txt"
    checked = submission_files.shipped_inputs

    def check_then_swap(job_path: Path, job_config: config.JobConfig) -> list[Path]:
        found = checked(job_path, job_config)
        target.unlink()
        target.symlink_to(outside)
        return found

    monkeypatch.setattr(submission_files, "shipped_inputs", check_then_swap)
    with pytest.raises(ConfigError, match="outside the job file's folder"):
        with working_dir(job, config.load(job, ["data.path=data/a.txt"])):
            pass


def test_the_token_is_the_flag_then_ray_auth_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RAY_AUTH_TOKEN", raising=False)
    monkeypatch.delenv("RAY_AUTH_TOKEN_PATH", raising=False)
    assert resolve_token(None) is None
    monkeypatch.setenv("RAY_AUTH_TOKEN", " from-env\n")
    assert resolve_token(None) == "from-env"
    assert resolve_token("from-flag") == "from-flag"
    monkeypatch.setenv("RAY_AUTH_TOKEN", "")
    assert resolve_token(None) is None
    assert auth_headers("t") == {"Authorization": "Bearer t"}
    assert auth_headers(None) == {}


def test_a_token_file_from_the_flag_or_ray_auth_token_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ray's order: RAY_AUTH_TOKEN, then the file RAY_AUTH_TOKEN_PATH names; the flags before both."""
    flag_file, env_file = tmp_path / "flag-token", tmp_path / "env-token"
    flag_file.write_text("from-flag-file\n")
    env_file.write_text("  from-env-file\n")
    monkeypatch.delenv("RAY_AUTH_TOKEN", raising=False)
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(env_file))
    assert resolve_token(None) == "from-env-file"
    assert resolve_token(None, str(flag_file)) == "from-flag-file"
    assert resolve_token("from-flag", str(flag_file)) == "from-flag"
    monkeypatch.setenv("RAY_AUTH_TOKEN", "from-env")
    assert resolve_token(None) == "from-env"


@pytest.mark.parametrize("kind", ["missing", "empty", "folder", "huge"])
def test_a_bad_token_file_is_bad_input_naming_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str) -> None:
    path = tmp_path / "token"
    if kind == "empty":
        path.write_text("\n")
    elif kind == "folder":
        path.mkdir()
    elif kind == "huge":
        path.write_text("x" * (TOKEN_FILE_MAX_BYTES + 1))
    monkeypatch.delenv("RAY_AUTH_TOKEN", raising=False)
    with pytest.raises(ConfigError) as flag:
        resolve_token(None, str(path))
    assert flag.value.key == "--token-file" and str(path) in flag.value.reason
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(path))
    with pytest.raises(ConfigError) as variable:
        resolve_token(None)
    assert variable.value.key == "RAY_AUTH_TOKEN_PATH"


def test_the_clusters_python_is_the_flag_then_the_variable_then_python(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(CLUSTER_PYTHON_VARIABLE, raising=False)
    assert resolve_cluster_python(None) == "python"
    monkeypatch.setenv(CLUSTER_PYTHON_VARIABLE, "/opt/venv/bin/python")
    assert resolve_cluster_python(None) == "/opt/venv/bin/python"
    assert resolve_cluster_python("/usr/bin/python3.11") == "/usr/bin/python3.11"
    assert resolve_cluster_python("python3") == "python3"  # a name on the head's PATH
    for relative in (".venv/bin/python", "bin/python"):
        with pytest.raises(ConfigError, match="relative path"):
            resolve_cluster_python(relative)
    with pytest.raises(ConfigError) as empty:
        resolve_cluster_python("  ")
    assert empty.value.key == "--python"


def test_submit_runs_the_job_on_the_named_python(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """What reaches the cluster's job API: the entrypoint names the interpreter; a bad one is
    one line, exit 2, before any connection."""
    from ringtrain import cli
    from ringtrain.commands import jobs as submission_command

    sent: list[dict[str, object]] = []

    class Recorded:
        def __init__(self, address: str, token: object = None) -> None:
            self.address, self.token = address, token

        def choose_id(self, job: object, requested: object = None) -> str:
            return "ringtrain-quickstart-0000000000"

        def submit(self, job_path: Path, overrides: list[str], job: object, **kwargs: object) -> str:
            from ringtrain.submission import entrypoint

            sent.append({"entrypoint": entrypoint(job_path, overrides, str(kwargs["python"]))})
            return "ringtrain-quickstart-0000000000"

        # The job as submit then follows it: running, its inputs checked (commands/submit_checks).
        def state(self, submission_id: str) -> object:
            return type("State", (), {"status": "RUNNING"})()

        def logs(self, submission_id: str) -> str:
            from ringtrain.commands.submit_checks import CHECKED

            return f"{CHECKED}\n"

    monkeypatch.setattr(submission_command, "JobsClient", Recorded)
    monkeypatch.delenv("RAY_AUTH_TOKEN", raising=False)
    monkeypatch.setenv(CLUSTER_PYTHON_VARIABLE, "/opt/cluster env/bin/python")
    args = ["submit", str(QUICKSTART), "train.steps=2", "--no-wait", "--address", "http://127.0.0.1:1"]
    assert cli.main(args) == 0
    assert cli.main([*args, "--python", "/srv/py/bin/python"]) == 0
    assert [s["entrypoint"] for s in sent] == [
        "'/opt/cluster env/bin/python' -m ringtrain run quickstart.yaml train.steps=2",
        "/srv/py/bin/python -m ringtrain run quickstart.yaml train.steps=2",
    ]
    capsys.readouterr()
    assert cli.main([*args, "--python", ".venv/bin/python"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("ringtrain: config error: --python: .venv/bin/python is a relative path")
    assert len(sent) == 2


@pytest.mark.parametrize(
    ("address", "warns"),
    [
        ("http://127.0.0.1:8265", False),
        ("http://localhost:8265", False),
        ("http://[::1]:8265", False),
        ("127.0.0.1:6379", False),
        ("auto", False),
        ("https://ray.example.com", False),
        ("http://10.0.0.5:8265", True),
        ("http://ray-head.ml.svc:8265", True),
        ("10.0.0.5:6379", True),
    ],
)
def test_plain_http_off_this_machine_is_warned_about(address: str, warns: bool) -> None:
    warning = plain_http_warning(address, sends_token=True)
    assert (warning is not None) == warns
    if warning:
        assert address in warning and "token" in warning and "https://" in warning


def test_the_command_prints_the_warning_before_it_connects(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from ringtrain import cli
    from ringtrain.commands import jobs as submission_command
    from ringtrain.errors import ClusterError

    def unreachable(address: str, token: object = None) -> None:
        raise ClusterError(f"cannot reach the Ray job API at {address}")

    monkeypatch.setattr(submission_command, "JobsClient", unreachable)
    monkeypatch.setenv("RAY_AUTH_TOKEN", "t")
    assert cli.main(["status", "--address", "http://10.0.0.5:8265"]) == 1
    first, second = capsys.readouterr().err.splitlines()
    assert first.startswith("ringtrain: warning: http://10.0.0.5:8265 is plain http to another machine: the token")
    assert second == "ringtrain: error: cannot reach the Ray job API at http://10.0.0.5:8265"
